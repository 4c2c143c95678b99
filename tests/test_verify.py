"""Seed cases and properties of the verification rules (docs/design.md section 2)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specdec_jax import verify
from specdec_jax.rng import position_keys

# Jitted once per shape, as the engine uses them (eager dispatch is slow).
verify_greedy = jax.jit(verify.verify_greedy, static_argnames="stop_ids")
verify_stochastic = jax.jit(verify.verify_stochastic, static_argnames="stop_ids")


def row_keys(seed, rows, width):
    """key[rows,width]: row r's keys at positions 0..width-1 (independent rows)."""
    return position_keys(jax.random.key(seed), jnp.arange(rows), jnp.broadcast_to(jnp.arange(width), (rows, width)))

G = 4
EOS = 99
# Target argmax at the G + 1 verified positions (shared by every seed case).
A = [11, 12, 13, 14, 15]


def one_hot_laws(argmax, vocab=128):
    return jax.nn.one_hot(jnp.asarray(argmax), vocab)


def run_both(draft, target_argmax, num_draft, eos_id=None, budget=None):
    """Greedy verification, and the stochastic rule on one-hot laws (which must agree)."""
    draft, target_argmax = jnp.asarray(draft), jnp.asarray(target_argmax)
    kw = dict(stop_ids=() if eos_id is None else (eos_id,), budget=budget)
    greedy = verify_greedy(draft, target_argmax, jnp.asarray(num_draft), **kw)
    keys = row_keys(0, *target_argmax.shape)
    stoch = verify_stochastic(keys, draft, None, one_hot_laws(target_argmax), jnp.asarray(num_draft), **kw)
    for field in ("tokens", "n_emit", "n_accepted"):
        np.testing.assert_array_equal(getattr(greedy, field), getattr(stoch, field), err_msg=field)
    return greedy


def emitted(result, row=0):
    return np.asarray(result.tokens)[row, : int(result.n_emit[row])].tolist()


# (name, draft row, num_draft, eos_id, budget, expected emitted tokens, expected n_accepted)
SEED_CASES = [
    ("mismatch at position 3 emits 3", [11, 12, 0, 14], 4, None, None, [11, 12, 13], 2),
    ("full match emits 5 with the bonus", [11, 12, 13, 14], 4, None, None, [11, 12, 13, 14, 15], 4),
    ("mismatch at position 1 emits only the correction", [0, 12, 13, 14], 4, None, None, [11], 0),
    # Padding equals the target so a rule reading past num_draft would accept it.
    ("2 real drafts both match: bonus from position 3", [11, 12, 13, 14], 2, None, None, [11, 12, 13], 2),
    # Padding differs from the target: the bonus must still be the target's token at row k.
    ("2 real drafts, other padding: bonus from position 3", [11, 12, 0, 0], 2, None, None, [11, 12, 13], 2),
    ("zero drafts emit 1", [11, 12, 13, 14], 0, None, None, [11], 0),
    ("EOS inside the accepted run truncates there", [11, EOS, 13, 14], 4, EOS, None, [11, EOS], 4),
    ("EOS as the correction ends the run", [11, 0, 13, 14], 4, 12, None, [11, 12], 1),
    ("budget cuts a full match", [11, 12, 13, 14], 4, None, 2, [11, 12], 4),
    ("budget 1 emits 1", [11, 12, 13, 14], 4, None, 1, [11], 4),
    ("budget larger than the run changes nothing", [11, 0, 13, 14], 4, None, 9, [11, 12], 1),
]


@pytest.mark.parametrize("name,draft,k,eos,budget,expected,n_acc", SEED_CASES, ids=[c[0] for c in SEED_CASES])
def test_seed_cases(name, draft, k, eos, budget, expected, n_acc):
    target = [A[:1] + [EOS] + A[2:]] if eos == EOS else [A]
    b = None if budget is None else jnp.array([budget])
    result = run_both([draft], target, [k], eos_id=eos, budget=b)
    assert emitted(result) == expected
    assert int(result.n_accepted[0]) == n_acc
    assert np.all(np.asarray(result.tokens[0, len(expected) :]) == 0)


def test_ragged_batch_rows_equal_solo_rows():
    """All seed cases in one batch (EOS 12 and ragged budgets) give each row's solo result."""
    drafts = [c[1] for c in SEED_CASES]
    ks = [c[2] for c in SEED_CASES]
    budgets = [c[4] or 5 for c in SEED_CASES]
    targets = [A] * len(SEED_CASES)
    batch = run_both(drafts, targets, ks, eos_id=12, budget=jnp.array(budgets))
    for row in range(len(SEED_CASES)):
        solo = run_both([drafts[row]], [A], [ks[row]], eos_id=12, budget=jnp.array([budgets[row]]))
        assert emitted(batch, row) == emitted(solo), SEED_CASES[row][0]


def test_traced_counts_and_budget():
    out = verify_greedy(jnp.array([[11, 12, 0, 14]]), jnp.array([A]), jnp.array([4]), budget=jnp.array([5]))
    assert emitted(out) == [11, 12, 13]


def reference_greedy(draft, target, k, eos, budget):
    """Plain-Python statement of docs/design.md section 2 for one row."""
    out = []
    for i in range(k):
        if draft[i] != target[i]:
            break
        out.append(draft[i])
    n_acc = len(out)
    out.append(target[n_acc])
    if eos is not None and eos in out:
        out = out[: out.index(eos) + 1]
    return out[:budget], n_acc


@st.composite
def greedy_batches(draw):
    batch = draw(st.integers(1, 8))
    gamma = draw(st.integers(0, 6))
    vocab = draw(st.integers(2, 5))  # small vocab: many matches and EOS hits
    rows = []
    for _ in range(batch):
        target = draw(st.lists(st.integers(0, vocab - 1), min_size=gamma + 1, max_size=gamma + 1))
        flips = draw(st.lists(st.booleans(), min_size=gamma, max_size=gamma))
        draft = [t if not f else (t + 1) % vocab for t, f in zip(target, flips)]
        rows.append((draft, target, draw(st.integers(0, gamma)), draw(st.integers(1, gamma + 2))))
    eos = draw(st.sampled_from([None, 0, 1]))
    return gamma, rows, eos


@settings(max_examples=60, deadline=None)
@given(greedy_batches())
def test_greedy_matches_reference(case):
    gamma, rows, eos = case
    n_real = len(rows)
    rows = rows + [rows[0]] * (8 - n_real)  # one batch shape per gamma: fewer compiles
    draft = np.array([r[0] for r in rows], np.int32).reshape(len(rows), gamma)
    target = np.array([r[1] for r in rows], np.int32)
    ks = np.array([r[2] for r in rows], np.int32)
    budget = np.array([r[3] for r in rows], np.int32)
    result = run_both(draft, target, ks, eos_id=eos, budget=budget)
    n_emit = np.asarray(result.n_emit)
    assert np.all((n_emit >= 1) & (n_emit <= ks + 1))
    for b, (d, t, k, bud) in enumerate(rows[:n_real]):
        expected, n_acc = reference_greedy(d, t, k, eos, bud)
        got = emitted(result, b)
        assert got == expected
        assert int(result.n_accepted[b]) == n_acc
        # The emitted prefix is the drafts; the last token is the argmax at its position.
        assert got[: min(n_acc, len(got))] == d[: min(n_acc, len(got))]
        if len(got) == n_acc + 1:
            assert got[-1] == t[n_acc]


def test_rejects_bad_shapes_and_raw_keys():
    with pytest.raises(ValueError, match="leading shape"):
        verify.verify_greedy(jnp.zeros((2, 3), jnp.int32), jnp.zeros((2, 3), jnp.int32), jnp.zeros(2, jnp.int32))
    with pytest.raises(ValueError, match="num_draft"):
        verify.verify_greedy(jnp.zeros((2, 3), jnp.int32), jnp.zeros((2, 4), jnp.int32), jnp.zeros(3, jnp.int32))
    with pytest.raises(ValueError, match="typed PRNG keys"):
        verify.verify_stochastic(
            jax.random.PRNGKey(0), jnp.zeros((1, 1), jnp.int32), None, jnp.ones((1, 2, 3)) / 3, jnp.ones(1, jnp.int32)
        )
    with pytest.raises(ValueError, match=r"shape \(1, 2\)"):  # one key per row and verified position
        verify.verify_stochastic(
            jax.random.key(0)[None], jnp.zeros((1, 1), jnp.int32), None, jnp.ones((1, 2, 3)) / 3, jnp.ones(1, jnp.int32)
        )


def test_draft_with_zero_draft_probability_is_rejected():
    p = jnp.array([[[0.0, 1.0, 0.0], [1.0, 0.0, 0.0]]])  # target would accept token 1 surely
    q = jnp.array([[[1.0, 0.0, 0.0]]])  # but the drafter could not have proposed it
    out = verify_stochastic(row_keys(1, 64, 2), jnp.ones((64, 1), jnp.int32), jnp.tile(q, (64, 1, 1)), jnp.tile(p, (64, 1, 1)), jnp.ones(64, jnp.int32))
    assert np.all(np.asarray(out.n_accepted) == 0)


def test_draft_with_zero_target_probability_is_never_accepted():
    """u is never 0, so p(d) = 0 cannot pass u * q < p."""
    n = 20000
    p = jnp.broadcast_to(jnp.array([[0.0, 0.5, 0.5], [1 / 3, 1 / 3, 1 / 3]]), (n, 2, 3))
    out = verify_stochastic(row_keys(2, n, 2), jnp.zeros((n, 1), jnp.int32), None, p, jnp.ones(n, jnp.int32))
    assert np.all(np.asarray(out.n_accepted) == 0)
    assert np.all(np.asarray(out.tokens[:, 0]) != 0)


def test_all_zero_residual_falls_back_to_target_law():
    """p == q except at the draft, where both are 0: rejected, residual max(p - q, 0) is all 0."""
    n = 4000
    law = jnp.array([0.0, 0.0, 0.25, 0.75])
    p = jnp.broadcast_to(jnp.stack([law, law]), (n, 2, 4))
    q = jnp.broadcast_to(law, (n, 1, 4))
    out = verify_stochastic(row_keys(3, n, 2), jnp.ones((n, 1), jnp.int32), q, p, jnp.ones(n, jnp.int32))
    first = np.asarray(out.tokens[:, 0])
    assert np.all(np.asarray(out.n_accepted) == 0)
    assert set(np.unique(first)) == {2, 3}
    assert abs(np.mean(first == 3) - 0.75) < 0.03


def test_per_row_keys_make_rows_independent_of_neighbours():
    rng = np.random.default_rng(0)
    p = jnp.asarray(rng.dirichlet(np.ones(6), size=(3, 4)), jnp.float32)
    q = jnp.asarray(rng.dirichlet(np.ones(6), size=(3, 3)), jnp.float32)
    draft = jnp.asarray(rng.integers(0, 6, size=(3, 3)), jnp.int32)
    keys = row_keys(4, 3, 4)
    batch = verify_stochastic(keys, draft, q, p, jnp.array([3, 1, 2]))
    solo = verify_stochastic(keys[1:2], draft[1:2], q[1:2], p[1:2], jnp.array([1]))
    assert emitted(batch, 1) == emitted(solo)
