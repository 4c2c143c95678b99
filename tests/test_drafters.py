"""Drafters: n-gram prompt lookup on hand-made buffers, the draft model's proposals, and the
all-accepted trap of docs/design.md section 2 (a drafter cache missing d_gamma)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import engine_helpers as H
from specdec_jax import engine
from specdec_jax import rng
from specdec_jax.drafters import DraftContext, NgramDrafter
from specdec_jax.drafters.base import PrefillContext
from specdec_jax.sampling import RowSampling, SamplingParams

BUF = 24  # token buffer width of the hand-made contexts
MAX_GAMMA = 8  # keys the hand-made contexts carry (one per draft position)


def context(rows, sampling=SamplingParams(), width=BUF, junk=None):
    """DraftContext of hand-made rows (committed tokens); past each row: zeros, or `junk` if given."""
    tokens = np.zeros((len(rows), width), np.int32)
    for b, row in enumerate(rows):
        tokens[b, : len(row)] = row
        if junk is not None and junk[b]:
            tokens[b, len(row) :] = np.resize(np.asarray(junk[b], np.int32), width - len(row))
    lens = jnp.asarray([len(r) for r in rows], jnp.int32)
    batch = len(rows)
    zeros = jnp.zeros((batch,), jnp.int32)
    keys = rng.position_keys(jax.random.key(0), jnp.arange(batch), lens[:, None] + jnp.arange(MAX_GAMMA)[None, :])
    return DraftContext(
        tokens=jnp.asarray(tokens), num_tokens=lens, prompt_lens=lens, room=jnp.full((batch,), width, jnp.int32),
        last_emit=zeros, last_accepted=zeros, features=None, keys=keys,
        sampling=RowSampling.from_params(sampling, batch), target_params=None, target=H.target().as_target()[0],
    )


@functools.partial(jax.jit, static_argnums=(0, 2))
def _ngram_propose(drafter, ctx, gamma):
    proposal, _ = drafter.propose(None, None, ctx, gamma)
    return proposal


def propose(drafter, rows, gamma, **kw):
    """(drafts per row as lists cut at num_draft, num_draft list)."""
    p = jax.device_get(_ngram_propose(drafter, context(rows, **kw), gamma))
    assert p.drafts.shape == (len(rows), gamma) and p.num_draft.shape == (len(rows),) and p.probs is None
    k = p.num_draft.tolist()
    return [p.drafts[b, : k[b]].tolist() for b in range(len(rows))], k


# ----------------------------------------------------------------------------
# NgramDrafter


def test_ngram_proposes_what_followed_the_suffix():
    drafts, k = propose(NgramDrafter(), [[5, 6, 7, 8, 5, 6]], 3)
    assert (drafts, k) == ([[7, 8, 5]], [3])  # suffix [5, 6] occurred at 0, followed by 7 8 5 6


def test_ngram_num_draft_is_clipped_at_the_committed_length():
    # [5, 6] at 0 is followed by only 3 committed tokens (7 5 6) before L.
    drafts, k = propose(NgramDrafter(), [[5, 6, 7, 5, 6], [5, 6, 7, 8, 5, 6]], 4)
    assert (drafts, k) == ([[7, 5, 6], [7, 8, 5, 6]], [3, 4])


def test_ngram_no_match_gives_no_drafts():
    rows = [[1, 2, 3, 4], [9], [3, 3]]  # no earlier occurrence; one token; [3] at 0 is followed by 3
    drafts, k = propose(NgramDrafter(), rows, 3)
    assert k == [0, 0, 1] and drafts[2] == [3]


def test_ngram_ignores_junk_past_the_committed_length():
    # The buffer past L repeats the suffix; a match there (or the suffix itself) must not count.
    drafts, k = propose(NgramDrafter(), [[4, 5], [1, 4, 5]], 3, junk=[[4, 5, 6], [4, 5, 6]])
    assert k == [0, 0]


def test_ngram_prefers_the_longest_suffix():
    row = [1, 2, 9, 3, 2, 8, 1, 2]  # [1, 2] -> 9 (n = 2); the most recent [2] -> 8 (n = 1)
    assert propose(NgramDrafter(max_n=3), [row], 1)[0] == [[9]]
    assert propose(NgramDrafter(max_n=1), [row], 1)[0] == [[8]]
    # min_n = 2 ignores 1-token matches entirely.
    assert propose(NgramDrafter(min_n=2, max_n=2), [[7, 2, 8, 5, 2]], 2)[1] == [0]
    assert propose(NgramDrafter(min_n=1, max_n=2), [[7, 2, 8, 5, 2]], 2)[0] == [[8, 5]]


def test_ngram_prefer_recent_or_earliest():
    row = [1, 2, 7, 1, 2, 8, 1, 2]
    assert propose(NgramDrafter(prefer="recent"), [row], 2)[0] == [[8, 1]]
    assert propose(NgramDrafter(prefer="earliest"), [row], 2)[0] == [[7, 1]]


def test_ngram_window_limits_the_search():
    row = [1, 2, 7, 9, 9, 9, 9, 9, 1, 2]  # the only earlier [1, 2] (and [2]) starts at 0
    assert propose(NgramDrafter(window=None), [row], 2)[0] == [[7, 9]]
    assert propose(NgramDrafter(window=10), [row], 2)[0] == [[7, 9]]
    # window 9 drops the [1, 2] at 0 but keeps the [2] at 1: the shorter n takes over.
    assert propose(NgramDrafter(window=9), [row], 2)[0] == [[7, 9]]
    assert propose(NgramDrafter(window=8), [row], 2)[1] == [0]
    assert propose(NgramDrafter(window=4), [row], 2)[1] == [0]


@pytest.mark.parametrize(
    "settings",
    [dict(), dict(max_n=2, min_n=2), dict(prefer="earliest", max_n=4), dict(window=6, max_n=2)],
    ids=["default", "n2", "earliest", "window"],
)
def test_ngram_matches_a_python_reference_on_random_buffers(settings):
    rng = np.random.default_rng(3)
    rows = [rng.integers(0, 3, int(n)).tolist() for n in rng.integers(1, BUF - 4, 64)]
    drafter = NgramDrafter(**settings)
    drafts, k = propose(drafter, rows, 3, junk=[rng.integers(0, 3, 5).tolist() for _ in rows])
    expected = [
        H.reference_ngram(r, 3, drafter.max_n, drafter.min_n, drafter.prefer, drafter.window) for r in rows
    ]
    assert drafts == expected
    assert 0 < sum(k) and 0 in k  # both matches and misses occurred


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(min_n=0), "min_n"),
        (dict(min_n=3, max_n=2), "min_n"),
        (dict(prefer="middle"), "prefer"),
        (dict(window=0), "window"),
    ],
)
def test_ngram_bad_settings_raise(kwargs, message):
    with pytest.raises(ValueError, match=message):
        NgramDrafter(**kwargs)


# ----------------------------------------------------------------------------
# ModelDrafter


@functools.partial(jax.jit, static_argnums=(0, 1))
def _model_propose(drafter, gamma, params, prompts, prompt_lens, ctx):
    prefill = PrefillContext(prompts=prompts, prompt_lens=prompt_lens, features=None, target_params=None,
                             capacity=BUF + 8, target=ctx.target)
    proposal, _ = drafter.propose(params, drafter.init(params, prefill), ctx, gamma)
    return proposal


MODEL_PROMPTS = [H.RAGGED[0], [7], H.RAGGED[1], H.RAGGED[2][:12]]  # includes a 1-token prompt


@pytest.mark.parametrize(
    "gamma, temperature", [(1, 0.0), (1, 0.8), (3, 0.8)], ids=["greedy-g1", "sampled-g1", "sampled-g3"]
)
def test_model_drafter_proposals(gamma, temperature):
    drafter = H.model_drafter()
    ctx = context(MODEL_PROMPTS, sampling=SamplingParams(temperature=temperature))
    lens = ctx.num_tokens
    p = jax.device_get(_model_propose(drafter, gamma, drafter.params, ctx.tokens[:, :16], lens, ctx))
    batch, vocab = len(MODEL_PROMPTS), drafter.config.vocab_size
    assert p.drafts.shape == (batch, gamma) and p.drafts.dtype == np.int32
    assert p.num_draft.tolist() == [gamma] * batch
    assert ((0 <= p.drafts) & (p.drafts < vocab)).all()
    if temperature == 0:
        assert p.probs is None  # greedy batch: point mass, no law carried
    else:
        assert p.probs.shape == (batch, gamma, vocab) and p.probs.dtype == np.float32
        assert (p.probs >= 0).all()
        np.testing.assert_allclose(p.probs.sum(-1), 1.0, atol=1e-5)
        assert (np.take_along_axis(p.probs, p.drafts[..., None], -1) > 0).all()
    # Each draft comes from the draft model's law after the prompt and the earlier drafts.
    for b, prompt in enumerate(MODEL_PROMPTS):
        logits = H.teacher_logits(drafter.config, drafter.params, prompt + p.drafts[b].tolist())
        for i in range(gamma):
            row = logits[len(prompt) - 1 + i]
            if temperature == 0:
                assert p.drafts[b, i] == row.argmax()
            else:
                np.testing.assert_allclose(p.probs[b, i], jax.nn.softmax(row / temperature), atol=2e-5)


def test_oracle_alpha_must_be_a_probability():
    with pytest.raises(ValueError, match="alpha"):
        H.oracle(1.5)


def test_all_accepted_trap_oracle_alpha_one():
    """alpha = 1: every round accepts all drafts; the drafter must still hold d_gamma next round."""
    hist = H.oracle_all_accept_history()
    out, why = hist.run.outputs()
    assert (out, why) == H.truncated_reference(H.ORACLE_MAX_NEW)
    eos = H.eos_id()
    full_accepts_then_continue = 0
    capacity = hist.run.spec.capacity
    for r, prop in enumerate(hist.proposals):
        before, after = H.host(hist.states[r]), H.host(hist.states[r + 1])
        for b in range(hist.run.num_rows):
            if before.done[b]:
                continue
            k, n_emit = int(prop.num_draft[b]), int(after.num_tokens[b] - before.num_tokens[b])
            if n_emit == k + 1:  # all drafts accepted, plus the bonus
                full_accepts_then_continue += bool(k == H.GAMMA and not after.done[b])
            else:  # only an EOS among the accepted drafts cuts the run
                assert after.stop_reason[b] == engine.EOS and int(prop.drafts[b, n_emit - 1]) == eos
        # The oracle's cache below its trusted length equals a fresh prefill (it is the target's config).
        committed = np.where(np.arange(capacity)[None] < after.num_tokens[:, None], after.tokens[:, :capacity], 0)
        k_ref, v_ref = H.rebuild_cache(hist.run.spec.drafter.config, hist.run.params.drafter, committed, capacity)
        for b in range(hist.run.num_rows):
            trusted = max(int(after.num_tokens[b]) - 2, 0)
            np.testing.assert_allclose(after.drafter_state.stacked()[0][:, b, :trusted], k_ref[:, b, :trusted], atol=1e-5)
            np.testing.assert_allclose(after.drafter_state.stacked()[1][:, b, :trusted], v_ref[:, b, :trusted], atol=1e-5)
    assert full_accepts_then_continue >= 5  # the trap was sprung many times
    # After the next draft step the slot of d_gamma (n - 2) is filled too: the 2-token window
    # [token at n - 2, t0] rewrote it, so every slot up to t0's (n - 1) equals a fresh prefill.
    trap_slots_checked = 0
    for r in range(1, len(hist.drafted)):
        before, drafted = H.host(hist.states[r - 1]), H.host(hist.drafted[r])
        committed = np.where(np.arange(capacity)[None] < drafted.num_tokens[:, None], drafted.tokens[:, :capacity], 0)
        k_ref, v_ref = H.rebuild_cache(hist.run.spec.drafter.config, hist.run.params.drafter, committed, capacity)
        for b in range(hist.run.num_rows):
            if drafted.done[b]:
                continue
            n = int(drafted.num_tokens[b])
            np.testing.assert_allclose(drafted.drafter_state.stacked()[0][:, b, :n], k_ref[:, b, :n], atol=1e-5)
            np.testing.assert_allclose(drafted.drafter_state.stacked()[1][:, b, :n], v_ref[:, b, :n], atol=1e-5)
            trap_slots_checked += int(n - before.num_tokens[b]) == H.GAMMA + 1  # last round accepted all drafts
    assert trap_slots_checked >= 5
    counters = H.host(hist.states[-1]).counters
    assert counters.accepted.sum() > 0.9 * counters.drafted.sum()
