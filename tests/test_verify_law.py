"""Statistical tests: speculative sampling emits tokens that follow the target law.

Every test uses a fixed seed and N = 200,000 rows, so it is deterministic. The
bounds are set so that a correct rule would fail with small probability on a
fresh seed: each chi-square test at significance 1e-4, each mean test at
|z| < 4.5 (two-sided 7e-6). With about 25 such checks in this file, the chance
that a correct implementation trips any of them on a new seed is below 0.3%.
A wrong rule (e.g. bonus read at position G, residual without the max, no
residual) moves these statistics by tens of standard errors.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from specdec_jax.rng import position_keys
from specdec_jax.verify import verify_stochastic

N = 200_000
V = 6
G = 3
CHI2_SIGNIFICANCE = 1e-4
Z_BOUND = 4.5

verify = jax.jit(verify_stochastic)


def row_keys(seed, rows, width):
    """key[rows,width]: row r's keys at positions 0..width-1 (independent rows)."""
    return position_keys(jax.random.key(seed), jnp.arange(rows), jnp.broadcast_to(jnp.arange(width), (rows, width)))


def assert_follows(samples, law, what):
    """Chi-square goodness of fit of integer samples to `law`; zero-probability tokens must never appear."""
    law = np.asarray(law, np.float64)
    counts = np.bincount(samples, minlength=len(law))
    assert counts[law == 0].sum() == 0, f"{what}: drew a token of probability 0"
    support = law > 0
    expected = law[support] / law[support].sum() * counts.sum()
    stat = ((counts[support] - expected) ** 2 / expected).sum()
    dof = support.sum() - 1
    threshold = stats.chi2.isf(CHI2_SIGNIFICANCE, dof) if dof > 0 else 0.0
    assert stat <= threshold + 1e-9, f"{what}: chi2 {stat:.1f} > {threshold:.1f} (dof {dof})"


def assert_mean(values, expected, what):
    se = values.std() / np.sqrt(len(values)) if values.std() > 0 else 1e-12
    z = (values.mean() - expected) / se
    assert abs(z) < Z_BOUND or abs(values.mean() - expected) < 1e-9, (
        f"{what}: mean {values.mean():.4f} vs {expected:.4f} (z = {z:.1f})"
    )


def laws(seed, zeros=None):
    """p f32[G+1,V], q f32[G,V] from a Dirichlet; `zeros` carves disjoint holes."""
    rng = np.random.default_rng(seed)
    p = rng.dirichlet(np.full(V, 0.7), size=G + 1)
    q = rng.dirichlet(np.full(V, 0.7), size=G)
    if zeros == "q_zero_where_p_positive":
        q[:, :2] = 0.0
    elif zeros == "p_zero_where_q_positive":
        p[:, 4:] = 0.0
    elif zeros == "both":
        q[:, :2] = 0.0
        p[:, 4:] = 0.0
    p /= p.sum(-1, keepdims=True)
    q /= q.sum(-1, keepdims=True)
    return p.astype(np.float32), q.astype(np.float32)


def simulate(p, q, num_draft, seed, point_mass_drafts=None):
    """Draw drafts from q (or use fixed drafts), verify N rows, return numpy results."""
    rng = np.random.default_rng(seed)
    if point_mass_drafts is None:
        cdf = np.cumsum(q.astype(np.float64), axis=-1)
        u = rng.random((N, G, 1))
        draft = np.minimum((u > cdf[None]).sum(-1), V - 1)
        draft_probs = jnp.broadcast_to(jnp.asarray(q), (N, G, V))
    else:
        draft = np.broadcast_to(np.asarray(point_mass_drafts), (N, G))
        draft_probs = None
    out = verify(
        row_keys(seed, N, G + 1),
        jnp.asarray(draft, jnp.int32),
        draft_probs,
        jnp.broadcast_to(jnp.asarray(p), (N, G + 1, V)),
        jnp.full((N,), num_draft, jnp.int32),
    )
    return np.asarray(out.tokens), np.asarray(out.n_emit), np.asarray(out.n_accepted), draft


def expected_n_emit(p, q, k):
    """1 + a0 + a0 a1 + ... (k terms after the 1), a_i = sum_x min(p_i(x), q_i(x))."""
    a = np.minimum(p[:k].astype(np.float64), q[:k]).sum(-1)
    return 1.0 + sum(np.prod(a[: i + 1]) for i in range(k))


@pytest.mark.parametrize("zeros", [None, "q_zero_where_p_positive", "p_zero_where_q_positive", "both"])
def test_sampled_drafts_follow_target_law(zeros):
    p, q = laws(10, zeros)
    tokens, n_emit, n_acc, draft = simulate(p, q, G, seed=11)
    assert_follows(tokens[:, 0], p[0], "first token ~ p0")
    first_accepted = n_acc >= 1
    assert_follows(tokens[first_accepted, 1], p[1], "second token ~ p1 given draft 1 accepted")
    two_accepted = n_acc >= 2
    assert_follows(tokens[two_accepted, 2], p[2], "third token ~ p2 given drafts 1-2 accepted")
    assert_mean(n_emit.astype(np.float64), expected_n_emit(p, q, G), "E[n_emit]")
    # The accepted prefix is the drafts themselves.
    for i in range(G):
        rows = n_acc > i
        assert np.array_equal(tokens[rows, i], draft[rows, i])


def test_ragged_draft_count_reads_bonus_at_the_rows_own_position():
    """num_draft = 2 < G: after two acceptances the bonus comes from p2, not p3."""
    p, q = laws(20)
    tokens, n_emit, n_acc, _ = simulate(p, q, 2, seed=21)
    assert n_emit.max() == 3
    full = n_acc == 2
    assert_follows(tokens[full, 2], p[2], "bonus ~ p2")
    assert_follows(tokens[:, 0], p[0], "first token ~ p0")
    assert_mean(n_emit.astype(np.float64), expected_n_emit(p, q, 2), "E[n_emit]")


def test_point_mass_drafts_follow_target_law():
    """Deterministic drafter: q is a point mass, the test becomes u < p(d)."""
    p, _ = laws(30)
    drafts = np.array([np.argmax(p[0]), np.argmin(p[1]), 2])
    q = np.eye(V, dtype=np.float32)[drafts]
    tokens, n_emit, n_acc, _ = simulate(p, q, G, seed=31, point_mass_drafts=drafts)
    assert_follows(tokens[:, 0], p[0], "first token ~ p0")
    assert_follows(tokens[n_acc >= 1, 1], p[1], "second token ~ p1 given draft 1 accepted")
    assert_mean(n_emit.astype(np.float64), expected_n_emit(p, q, G), "E[n_emit]")
    assert_mean((n_acc >= 1).astype(np.float64), p[0, drafts[0]], "P(accept d1) = p0(d1)")


def test_rows_with_zero_drafts_sample_from_p0():
    p, q = laws(40)
    tokens, n_emit, n_acc, _ = simulate(p, q, 0, seed=41)
    assert np.all(n_emit == 1) and np.all(n_acc == 0)
    assert_follows(tokens[:, 0], p[0], "first token ~ p0")


def test_the_check_catches_a_wrong_rule():
    """Guard on the guard: the chi-square check rejects a law that is off by a little."""
    p, q = laws(50)
    tokens, *_ = simulate(p, q, G, seed=51)
    skewed = p[0] * np.linspace(0.97, 1.03, V)
    with pytest.raises(AssertionError):
        assert_follows(tokens[:, 0], skewed / skewed.sum(), "skewed")
