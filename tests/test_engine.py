"""End-to-end tests of the engine (docs/design.md sections 2-4): spec output is the target's own output.

Models: the deterministic random `tiny-random` target and `tiny-random-draft`,
float32 on CPU. With fp32 tiny-random weights greedy spec-on and spec-off agree
token for token, so exact equality is the main assertion; the tie-aware
comparator of docs/design.md section 6 (tests/engine_helpers.py) is checked beside it.

Compiles dominate the runtime here, so most tests share one shape family (see
engine_helpers): the ragged batch RAGGED (prompt lengths 3, 9, 17, 30), 40 new
tokens, gamma 4, default capacity, and an EOS id picked from the plain output.
"""

from __future__ import annotations

import dataclasses
import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import engine_helpers as H
from specdec_jax import engine
from specdec_jax.engine import batching, generation
from specdec_jax.engine import round as engine_round
from specdec_jax.compare import compare_rows, first_divergence
from specdec_jax.drafters import EagleDrafter, ModelDrafter
from specdec_jax.drafters.eagle import EagleConfig, init_eagle
from specdec_jax.drafters.base import DrafterBase, Proposal
from specdec_jax.engine import ShapePolicy, generate
from specdec_jax.metrics import Metrics
from specdec_jax.models import LlamaConfig, random_llama
from specdec_jax.sampling import SamplingParams
from specdec_jax.theory import expected_tokens_per_round, tokens_per_round_std

SAMPLED = SamplingParams(temperature=0.8)
DRAFTERS = {
    "ngram": H.ngram,
    "model": H.model_drafter,
    "oracle": lambda: H.oracle(0.7),
}


@functools.cache
def spec_run(drafter: str, sampled: bool = False, python_loop: bool = False):
    """RAGGED through `generate` with a drafter, gamma 4, eos_id(); cached per process."""
    return generate(
        H.target(), H.RAGGED, DRAFTERS[drafter](), gamma=H.GAMMA, max_new_tokens=H.MAX_NEW,
        eos_id=H.eos_id(), sampling=SAMPLED if sampled else SamplingParams(), seed=7, python_loop=python_loop,
    )


def assert_same_metrics(a: Metrics, b: Metrics):
    np.testing.assert_equal(a.to_dict(), b.to_dict())  # nan == nan here


# ----------------------------------------------------------------------------
# 1. Greedy lossless


def test_reference_has_a_mid_run_eos():
    """The fixture itself: the EOS id ends some rows mid-run (never at their start), others hit the budget."""
    ref, free = H.reference(), H.reference_no_eos()
    eos = H.eos_id()
    assert "eos" in ref.stop_reasons and "length" in ref.stop_reasons
    for out, full, why in zip(ref.tokens, free.tokens, ref.stop_reasons):
        assert out == full[: len(out)]  # EOS only truncates
        if why == "eos":
            assert out[-1] == eos and eos not in out[:-1] and len(out) >= 4
        else:
            assert eos not in out and len(out) == H.MAX_NEW


@pytest.mark.parametrize("drafter", list(DRAFTERS))
def test_greedy_spec_equals_plain_decoding(drafter):
    ref, out = H.reference(), spec_run(drafter)
    assert out.tokens == ref.tokens
    assert out.stop_reasons == ref.stop_reasons
    # The tie-aware comparator agrees (and reports exact matches).
    cfg, params = H.target().config, H.target().model.params()
    assert H.assert_greedy_equivalent(cfg, params, H.RAGGED, ref.tokens, out.tokens) == 1.0
    m = out.metrics
    assert m.emitted_tokens == sum(map(len, ref.tokens))
    assert 0 < m.draft_tokens <= H.GAMMA * m.rounds
    if drafter == "ngram":
        # Raggedness of the drafts: some rounds propose fewer than gamma (or none).
        assert m.draft_tokens < H.GAMMA * m.rounds
    if drafter != "model":  # n-gram and oracle drafts are often right (the random draft model rarely)
        assert m.accepted_tokens > 0 and m.rounds < ref.metrics.rounds
    assert m.accepted_tokens < m.draft_tokens  # and rejections happened too


# ----------------------------------------------------------------------------
# Tie-aware comparator (docs/design.md section 6)


def test_tie_aware_comparator_flags_a_large_margin_divergence():
    cfg, params = H.target().config, H.target().model.params()
    prompt, ref = H.RAGGED[1], H.reference().tokens[1]
    logits = H.teacher_logits(cfg, params, prompt + ref)[len(prompt) - 1 : -1]  # row i picks ref[i]
    # Teacher forcing reproduces plain greedy decoding.
    np.testing.assert_array_equal(logits.argmax(-1), ref)
    top2 = np.sort(logits, axis=-1)[:, -2:]
    margins = top2[:, 1] - top2[:, 0]
    j = int(np.argmax(margins[1:20])) + 1
    assert margins[j] > 0.1
    runner_up = int(np.argsort(logits[j])[-2])
    fake = ref[:j] + [runner_up] + ref[j + 1 :]

    assert first_divergence(ref, fake) == j
    assert first_divergence(ref, ref) is None
    assert first_divergence(ref, ref[:-1]) == len(ref) - 1

    exact, (row,) = compare_rows(cfg, params, [prompt], [ref], [fake], tol=1e-3)
    assert exact == 0.0 and row.first_divergence == j and not row.ok
    assert row.margin == pytest.approx(float(margins[j]), rel=1e-4)
    # The same divergence is a near-tie under a tolerance above its margin.
    assert compare_rows(cfg, params, [prompt], [ref], [fake], tol=float(margins[j]) + 1e-3)[1][0].ok
    # A pure length mismatch is never allowed: the stop rules must agree.
    assert not compare_rows(cfg, params, [prompt], [ref], [ref[:-3]], tol=1e9)[1][0].ok
    exact, rows = compare_rows(cfg, params, [prompt, prompt], [ref, ref], [ref, fake])
    assert exact == 0.5 and rows[0].ok and not rows[1].ok
    with pytest.raises(AssertionError, match="outside near-ties"):
        H.assert_greedy_equivalent(cfg, params, [prompt], [ref], [fake])


# ----------------------------------------------------------------------------
# 2. A row does not depend on its batch neighbours


@pytest.mark.parametrize("row", [2, 3])
def test_row_of_ragged_batch_equals_solo_run_greedy(row):
    batch = spec_run("ngram")
    solo = generate(
        H.target(), [H.RAGGED[row]], H.ngram(), gamma=H.GAMMA, max_new_tokens=H.MAX_NEW, eos_id=H.eos_id(),
        seed=7, row_ids=[row],
    )
    assert solo.tokens[0] == batch.tokens[row]
    assert solo.stop_reasons[0] == batch.stop_reasons[row]
    assert solo.row_counts[0] == batch.row_counts[row]  # its rounds, drafts and acceptances too
    assert sum(c["emitted_tokens"] for c in batch.row_counts) == batch.metrics.emitted_tokens
    assert sum(c["rounds"] for c in batch.row_counts) == batch.metrics.rounds


def test_row_of_ragged_batch_equals_solo_run_sampled():
    batch = spec_run("ngram", sampled=True)
    assert batch.tokens != spec_run("ngram").tokens  # it really sampled
    solo = lambda row, row_id: generate(  # noqa: E731
        H.target(), [H.RAGGED[row]], H.ngram(), gamma=H.GAMMA, max_new_tokens=H.MAX_NEW, eos_id=H.eos_id(),
        sampling=SAMPLED, seed=7, row_ids=[row_id],
    )
    for row in (2, 3):
        alone = solo(row, row)
        assert alone.tokens[0] == batch.tokens[row]
        assert alone.stop_reasons[0] == batch.stop_reasons[row]
    # The row id, not the batch position, is what the randomness depends on.
    assert solo(2, 5).tokens[0] != batch.tokens[2]


# ----------------------------------------------------------------------------
# 3. while_loop path == Python-loop path


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
def test_python_loop_equals_while_loop(sampled):
    loop, py = spec_run("ngram", sampled), spec_run("ngram", sampled, python_loop=True)
    assert py.tokens == loop.tokens
    assert py.stop_reasons == loop.stop_reasons
    assert py.loop_rounds == loop.loop_rounds
    assert_same_metrics(py.metrics, loop.metrics)
    assert loop.metrics.accepted_tokens > 0


# ----------------------------------------------------------------------------
# 4. One trace per shape bucket


def test_one_trace_for_prompt_lengths_in_one_bucket(monkeypatch, caplog):
    traces = []
    original = engine.decode_round

    def counted(*args):
        traces.append(1)
        return original(*args)

    monkeypatch.setattr(engine_round, "decode_round", chex.assert_max_traces(counted, n=1))
    loop_cache = engine.run_loop._cache_size()
    rng = np.random.default_rng(5)
    # A spec no other test uses (capacity 80), prompt lengths 5, 11, 16: all in the 16 bucket.
    with jax.log_compiles(), caplog.at_level("WARNING"):
        for length in (5, 11, 16):
            out = generate(H.target(), [rng.integers(0, 256, length).tolist()], max_new_tokens=23, capacity=80)
            assert len(out.tokens[0]) == 23
    assert len(traces) == 1
    assert engine.run_loop._cache_size() == loop_cache + 1
    # prefill runs as compiled by the memory check (engine.batching.compiled_prefill): once for the bucket
    assert sum(r.getMessage().startswith("Compiling jit(prefill)") for r in caplog.records) == 1


# ----------------------------------------------------------------------------
# 5. Rollback: committed cache slots equal a fresh prefill of the committed sequence


def test_rollback_leaves_caches_equal_to_fresh_prefill():
    drafter = H.model_drafter()
    run = H.prepare(H.RAGGED, drafter, gamma=H.GAMMA, eos=H.eos_id())
    for _ in range(6):
        run.round()
        H.assert_caches_rebuilt(run, H.host(run.state), drafter)
    c = jax.device_get(run.state.counters)
    assert c.drafted.sum() > c.accepted.sum()  # there were rejections
    out, _ = run.outputs()
    assert all(o == r[: len(o)] for o, r in zip(out, H.reference().tokens))


# ----------------------------------------------------------------------------
# 6. EOS and budget stops; finished rows stop changing


def _row_snapshot(state, b):
    n = int(state.num_tokens[b])
    c = state.counters
    k, v = state.cache.stacked()
    return dict(
        tokens=np.asarray(state.tokens[b]), num_tokens=n, stop=int(state.stop_reason[b]),
        counters=[int(c.rounds[b]), int(c.drafted[b]), int(c.accepted[b]), int(c.emitted[b])],
        k=k[:, b, : n - 1], v=v[:, b, : n - 1], dk=state.drafter_state.stacked()[0][:, b, : n - 2],
    )


def test_eos_and_budget_stop_where_plain_decoding_stops():
    hist = H.oracle_all_accept_history()
    out, why = hist.run.outputs()
    assert (out, why) == H.truncated_reference(H.ORACLE_MAX_NEW)
    eos = H.eos_id()
    eos_inside_accepted = budget_clipped = False
    live_rounds = np.zeros(hist.run.num_rows, int)
    frozen = {}
    for r, prop in enumerate(hist.proposals):
        before, after = H.host(hist.states[r]), H.host(hist.states[r + 1])
        for b in range(hist.run.num_rows):
            if before.done[b]:
                assert int(prop.num_draft[b]) == 0
                # A finished row never changes: tokens, counts, reason, counters, committed cache.
                now = _row_snapshot(after, b)
                np.testing.assert_equal(now, frozen[b])
                continue
            live_rounds[b] += 1
            n_emit = int(after.num_tokens[b] - before.num_tokens[b])
            k = int(prop.num_draft[b])
            if after.stop_reason[b] == engine.EOS and n_emit <= k:
                # The EOS was an accepted draft and cut the run short (no bonus token).
                assert int(prop.drafts[b, n_emit - 1]) == eos
                eos_inside_accepted = True
            if after.stop_reason[b] == engine.LENGTH and k < H.GAMMA:
                budget_clipped = True  # the budget, not the drafter, limited the last round
            if after.done[b]:
                frozen[b] = _row_snapshot(after, b)
    assert eos_inside_accepted and budget_clipped
    assert sorted(frozen) == list(range(hist.run.num_rows))
    final = jax.device_get(hist.states[-1].counters)
    np.testing.assert_array_equal(final.rounds[: hist.run.num_rows], live_rounds)
    np.testing.assert_array_equal(final.emitted[: hist.run.num_rows], [len(o) for o in out])


# ----------------------------------------------------------------------------
# 7. Capacity


CAPACITY = 36  # >= 30 + gamma + 1; rows of prompt length P stop after CAPACITY + 1 - P tokens


@pytest.mark.parametrize("gamma", [0, 4])
def test_small_capacity_stops_rows_with_a_prefix_of_plain_output(gamma):
    ref = H.reference()
    out = generate(
        H.target(), H.RAGGED, H.ngram() if gamma else None, gamma=gamma, max_new_tokens=H.MAX_NEW,
        eos_id=H.eos_id(), capacity=CAPACITY,
    )
    reasons = []
    for b, prompt in enumerate(H.RAGGED):
        room = CAPACITY + 1 - len(prompt)
        full = ref.tokens[b]
        assert out.tokens[b] == full[:room]
        reasons.append(ref.stop_reasons[b] if len(full) <= room else "capacity")
    assert out.stop_reasons == reasons
    assert reasons.count("capacity") >= 2


def test_capacity_below_the_prompt_bucket():
    """Regression: prefill used to write the whole prompt bucket into a token buffer of only
    capacity + gamma + 2 slots, so a valid capacity below the bucket crashed while tracing."""
    prompt = H.RAGGED[1]  # 9 tokens: prompt bucket 16, but capacity 12 is valid (>= 9 + 0 + 1)
    out = generate(H.target(), [prompt], max_new_tokens=H.MAX_NEW, capacity=12)
    assert out.stop_reasons == ["capacity"]
    assert out.tokens[0] == H.reference_no_eos().tokens[1][: 12 + 1 - len(prompt)]


# ----------------------------------------------------------------------------
# 8. Oracle drafter: tokens per round follow the closed form


def test_oracle_tokens_per_round_matches_closed_form():
    alpha, gamma, max_new, rows = 0.8, 4, 256, 8
    rng = np.random.default_rng(8)
    prompts = [rng.integers(0, 256, int(n)).tolist() for n in rng.integers(2, 17, rows)]
    out = generate(H.target(), prompts, H.oracle(alpha), gamma=gamma, max_new_tokens=max_new)
    m = out.metrics
    assert out.stop_reasons == ["length"] * rows and m.emitted_tokens == rows * max_new
    expected = expected_tokens_per_round(alpha, gamma)
    sigma = tokens_per_round_std(alpha, gamma) / np.sqrt(m.rounds)
    # Residual bias: each row's last round has its drafts clipped by the budget, and
    # emitted / rounds is a ratio over a stopped renewal process. A direct simulation
    # of that process (8 rows x 256 tokens) gives mean 3.343 vs 3.362: a bias of
    # -0.018 tokens/round, 0.28 sigma here, well inside the 3-sigma band.
    assert abs(m.mean_accepted_length - expected) < 3 * sigma, (m.mean_accepted_length, expected, sigma)
    # The first draft is accepted with probability alpha (nothing clips position 1 but the last round).
    first = m.per_position_acceptance[0]
    assert abs(first - alpha) < 4 * np.sqrt(alpha * (1 - alpha) / m.rounds), first


# ----------------------------------------------------------------------------
# 10. Bad input raises a clear ValueError before anything is compiled


def _vocab_300_drafter():
    cfg = LlamaConfig(vocab_size=300, hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2,
                      num_kv_heads=1, head_dim=8)
    return ModelDrafter(cfg, random_llama(cfg, 0).params())


BAD_INPUTS = {
    "no prompts": (dict(prompts=[]), "no prompts"),
    "empty prompt": (dict(prompts=[[1, 2], []]), "prompt 1 is empty"),
    "token too large": (dict(prompts=[[1, 258]]), "outside the vocabulary"),
    "negative token": (dict(prompts=[[-1, 3]]), "outside the vocabulary"),
    "negative gamma": (dict(gamma=-1), "gamma must be an int >= 0"),
    "gamma without drafter": (dict(drafter=None, gamma=2), "needs a drafter"),
    "zero max_new_tokens": (dict(max_new_tokens=0), "max_new_tokens must be in \\[1, "),
    "eos out of range": (dict(eos_id=258), "stop token id 258"),
    "stop id out of range": (dict(stop_ids=[3, -1]), "stop token id -1"),
    "capacity too small": (dict(prompts=[[1] * 10], gamma=4, capacity=14), "capacity 14 is too small"),
    "zero capacity": (dict(capacity=0), "capacity 0 is too small"),
    "draft vocabulary differs": (dict(drafter=_vocab_300_drafter), r"vocabulary \(300\) differs"),
    "row_ids length": (dict(row_ids=[0, 1]), "row_ids"),
    "sampling list length": (dict(sampling=[SamplingParams()] * 2), "SamplingParams"),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input_raises_before_compiling(case, monkeypatch):
    def must_not_run(*args, **kwargs):
        raise AssertionError("compiled/ran before validating the input")

    monkeypatch.setattr(batching, "prefill", must_not_run)
    monkeypatch.setattr(generation, "run_loop", must_not_run)
    overrides, message = BAD_INPUTS[case]
    kwargs = dict(prompts=[[1, 2, 3]], drafter=H.ngram(), gamma=2, max_new_tokens=8)
    kwargs.update(overrides)
    if callable(kwargs["drafter"]):
        kwargs["drafter"] = kwargs["drafter"]()
    with pytest.raises(ValueError, match=message):
        generate(H.target(), kwargs.pop("prompts"), kwargs.pop("drafter"), **kwargs)


# ----------------------------------------------------------------------------
# Metrics


def test_metrics_are_consistent():
    plain = H.reference().metrics
    total = sum(map(len, H.reference().tokens))
    assert plain.emitted_tokens == plain.rounds == total
    assert plain.mean_accepted_length == 1.0
    assert plain.draft_tokens == plain.accepted_tokens == 0 and plain.per_position_acceptance == []

    m = spec_run("ngram").metrics
    assert m.emitted_tokens == total
    assert m.mean_accepted_length == pytest.approx(m.emitted_tokens / m.rounds)
    assert m.acceptance_rate == pytest.approx(m.accepted_tokens / m.draft_tokens)
    # Each round emits its accepted drafts plus one token, except a final round cut
    # by EOS inside the accepted drafts (at most one per row).
    rows = len(H.RAGGED)
    assert m.accepted_tokens + m.rounds - rows <= m.emitted_tokens <= m.accepted_tokens + m.rounds
    assert all(0.0 <= p <= 1.0 for p in m.per_position_acceptance)

    # Per-row counters (hand-driven run): rounds = rounds the row was live; totals add up.
    hist = H.oracle_all_accept_history()
    counters = jax.device_get(hist.states[-1].counters)
    batch = Metrics.from_counters(hist.states[-1].counters, hist.run.num_rows)
    live = [sum(not bool(s.done[b]) for s in hist.states[:-1]) for b in range(hist.run.num_rows)]
    assert batch.rounds == sum(live) == counters.rounds[: hist.run.num_rows].sum()
    out, _ = hist.run.outputs()
    assert batch.emitted_tokens == sum(map(len, out))


# ----------------------------------------------------------------------------
# Verify width: each round runs the narrowest compiled width that holds its drafts


@dataclasses.dataclass(frozen=True)
class FixedCountDrafter(DrafterBase):
    """Proposes `count` junk tokens (id 0) per row every round; a point-mass drafter."""

    count: int
    name: str = "fixed"
    params: None = None

    def init(self, params, prefill):
        return None

    def propose(self, params, state, ctx, gamma):
        batch = ctx.num_tokens.shape[0]
        drafts = jnp.zeros((batch, gamma), jnp.int32)
        return Proposal(drafts, jnp.full((batch,), min(self.count, gamma), jnp.int32), None), state


@pytest.mark.parametrize("count, width_index", [(0, 0), (2, 1), (4, 1)])
def test_each_round_verifies_at_the_narrowest_width_that_holds_its_drafts(count, width_index):
    prompts, max_new = [[5, 6, 7], [9, 10, 11, 12, 13]], 9
    plain = generate(H.target(), prompts, None, max_new_tokens=max_new)
    spec = generate(H.target(), prompts, FixedCountDrafter(count), gamma=4, max_new_tokens=max_new)
    assert spec.tokens == plain.tokens
    widths = engine.EngineSpec(H.target().as_target()[0], None, 4, 64).verify_widths
    assert widths == (1, 5)
    # Drafts are capped by the budget near the end, so late rounds may run narrower, never wider.
    hist = spec.metrics.width_rounds
    assert sum(hist) == spec.loop_rounds and not any(hist[width_index + 1:])
    assert hist[width_index] >= spec.loop_rounds - 3


@pytest.mark.parametrize("drafter,gamma,policy", [("ngram", 0, False), ("ngram", H.GAMMA, False),
                                                   ("model", H.GAMMA, False), ("model", 4, True),
                                                   ("eagle", 4, True)])
def test_rounds_copy_no_cache_buffer(drafter, gamma, policy):
    """The caches are updated in place: two compiled rounds in a loop (state donated, as the decoding loop
    runs them) hold no copy of a layer's key or value buffer, the target's or the drafter's. A top-level
    pass read the cache before commit's in-place write and XLA copied every buffer each plain round
    (`kv_cache.ordered_read`); the draft model and the EAGLE head wrote their caches inside the per-size
    switch, and the draft model in its chain's loop too, and XLA copied their buffers a few times a round
    (`Drafter.settle`)."""
    head = EagleConfig(H.target().config.hidden_size, H.target().config.vocab_size, 64, 2, 1, 32)
    draft = {"ngram": H.ngram, "model": H.model_drafter,
             "eagle": lambda: EagleDrafter(head, init_eagle(head, jax.random.key(5)))}[drafter]()
    kwargs = dict(policy=ShapePolicy((0, 1, 2, 3, 4), (1.0,) * 5, (0.0,) + (1.0,) * 4)) if policy else dict(gamma=gamma)
    run = engine.prepare(H.target(), H.RAGGED, draft if gamma else None, max_new_tokens=H.MAX_NEW, **kwargs)
    rounds = jax.jit(lambda params, state: jax.lax.fori_loop(
        0, 2, lambda _, s: engine_round.decode_round(run.spec, params, s), state), donate_argnums=1)
    text = rounds.lower(run.params, run.state).compile().as_text()
    own = run.state.drafter_state  # the draft model's cache, or the EAGLE head's state
    caches = [run.state.cache] + ([] if drafter == "ngram" else [own if drafter == "model" else own.cache])
    shapes = {",".join(map(str, a.shape)) for c in caches for a in (*c.k, *c.v)}
    copies = [line for line in text.splitlines() if " copy(" in line
              and any(f"f32[{s}]" in line.split(" copy(")[0] for s in shapes)]
    assert not copies, copies[:3]
