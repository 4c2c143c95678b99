"""An EAGLE head skips the rounds that draft nothing and catches up from its ring of target features when drafting
resumes, or, drafting or not, when a row would fall out of the ring's reach (`drafters.eagle`, module docstring).

Rounds are driven by hand with forced shapes (`DecodeState.forced_shape`), as in test_draft_catch_up.py: runs of
plain rounds of several lengths, the longest past the ring (``max_lag`` 10, twice the widest verify pass), with
catch-up passes of 4 slots so that a drafting round needs several. The references are external to the catching
up: plain decoding (the outputs) and a fresh prefill of the head over the committed tokens with the target's
features of them (`EagleDrafter.init`, the head's cache).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import engine_helpers as H
from specdec_jax import engine
from specdec_jax.drafters import EagleDrafter
from specdec_jax.drafters.base import PrefillContext
from specdec_jax.drafters.eagle import EagleConfig, init_eagle
from specdec_jax.engine import ShapePolicy

GAMMAS = (0, 1, 2, 3, 4)
MAX_LAG, CATCH_UP = 10, 2
# Draft-shape indices into GAMMAS, one per round: plain runs of 1, 2, 6, 12 and 7 rounds between drafting rounds.
SCHEDULE = (0, 2, 0, 0, 1) + (0,) * 6 + (4,) + (0,) * 12 + (3,) + (0,) * 7 + (2, 1) + (4, 3, 2, 1) * 4


def drafter(max_lag: int = MAX_LAG) -> EagleDrafter:
    cfg = H.target().config
    head = EagleConfig(cfg.hidden_size, cfg.vocab_size, 64, 2, 1, 32)
    return EagleDrafter(head, init_eagle(head, jax.random.key(5)), max_lag=max_lag, catch_up=CATCH_UP)


def forced_run() -> tuple[H.HandRun, list]:
    """The ragged batch under SCHEDULE; (the run, [(choice, state before, after) per round])."""
    hand, rounds = H.forced_rounds(drafter(), SCHEDULE, GAMMAS)
    return hand, [(choice, before, after) for choice, before, _, after in rounds]


def fresh_head_cache(draft: EagleDrafter, state: engine.DecodeState, capacity: int) -> tuple[np.ndarray, np.ndarray]:
    """(k, v) [B,T,Hkv,D] of the head's cache prefilled over each row's committed tokens, from the target's
    features of them (one pass of the target over the whole sequence)."""
    model, params = H.target().as_target()
    tokens = jnp.asarray(np.where(np.arange(capacity)[None] < state.num_tokens[:, None], state.tokens[:, :capacity], 0))
    positions = jnp.broadcast_to(jnp.arange(capacity)[None], tokens.shape)
    _, hidden, _ = model.apply(params, tokens, model.init_cache(tokens.shape[0], capacity), positions, None,
                               draft.reads_hidden, compute_logits=False)
    fresh = draft.init(draft.params, PrefillContext(prompts=tokens, prompt_lens=jnp.asarray(state.num_tokens),
                                                    features=hidden.transpose(1, 2, 0, 3), target_params=params,
                                                    capacity=capacity, target=model))
    return tuple(np.asarray(x)[0] for x in fresh.cache.stacked())


@pytest.fixture(scope="module")
def run():
    return forced_run()


def test_outputs_equal_plain_decoding(run):
    hand, rounds = run
    out, _ = hand.outputs()
    assert out == [H.reference().tokens[b] for b in range(len(out))]
    assert sum(GAMMAS[choice] > 0 for choice, _, _ in rounds) >= 10


def test_the_head_cache_below_its_length_is_a_fresh_prefill_after_every_round(run):
    hand, rounds = run
    capacity = hand.spec.capacity
    draft = drafter()
    caught_up_several = forced = 0
    for choice, before, after in rounds:
        head, was = after.drafter_state.cache, before.drafter_state.cache
        live = ~before.done
        if GAMMAS[choice] == 0:
            moved = live & (head.lengths != was.lengths)
            forced += int(np.any(moved))  # the ring's reach ran out: caught up without drafting
            if not np.any(moved):  # nothing ran: buffers and lengths as they were
                np.testing.assert_array_equal(head.lengths, was.lengths)
                for got, old in zip(head.stacked(), was.stacked()):
                    np.testing.assert_array_equal(got, old)
        else:
            caught_up_several += int(np.any(before.num_tokens[live] - 2 - was.lengths[live] > CATCH_UP))
        k_ref, v_ref = fresh_head_cache(draft, after, capacity)
        k, v = (np.asarray(x)[0] for x in head.stacked())
        for b in range(hand.num_rows):
            if after.done[b]:
                continue
            kept = int(head.lengths[b])
            np.testing.assert_allclose(k[b, :kept], k_ref[b, :kept], rtol=1e-4, atol=1e-4)
            np.testing.assert_allclose(v[b, :kept], v_ref[b, :kept], rtol=1e-4, atol=1e-4)
    assert caught_up_several >= 2 and forced >= 1


def test_a_ring_shorter_than_two_verify_passes_is_refused():
    policy = ShapePolicy(GAMMAS, (1.0,) * 5, (0.0,) + (1.0,) * 4)
    with pytest.raises(ValueError, match="max_lag 9 must be at least 10"):
        engine.generate(H.target(), [[1, 2, 3]], drafter(max_lag=9), policy=policy, max_new_tokens=4)
