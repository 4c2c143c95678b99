"""A draft model skips the rounds that draft nothing and catches up when drafting resumes (`drafters.model`,
module docstring).

Rounds are driven by hand with forced shapes (`DecodeState.forced_shape`): runs of plain rounds of several
lengths, so that a drafting round finds what it missed within its window, or first catches up in one pass of
`CATCH_UP` tokens, or in several (a drafter with ``catch_up`` 8, so that the runs fit a row's budget). The
references are external to the drafter: a fresh prefill of the committed tokens (its cache) and the draft
model's own teacher-forced argmax (its greedy drafts), and plain decoding (the outputs).
"""

from __future__ import annotations

import dataclasses

import numpy as np

import engine_helpers as H
from specdec_jax.drafters.model import WINDOW

GAMMAS = (0, 1, 2, 3, 4)
CATCH_UP = 8
# Draft-shape indices into GAMMAS, one per round: plain runs between drafting rounds of several lengths (after
# more than WINDOW - 2 of them the next drafting round catches up first; after more than CATCH_UP + WINDOW - 2,
# in several passes).
SCHEDULE = (0, 2, 0, 0, 1) + (0,) * 5 + (4,) + (0,) * 5 + (3,) + (0,) * (2 * CATCH_UP) + (2, 1) + (4, 3, 2, 1) * 4


def drafter():
    return dataclasses.replace(H.model_drafter(), catch_up=CATCH_UP)


def forced_run(max_new: int = H.MAX_NEW) -> tuple[H.HandRun, list]:
    """The ragged batch under SCHEDULE; (the run, [(choice, state before, drafted, after) per round])."""
    return H.forced_rounds(drafter(), SCHEDULE, GAMMAS, max_new)


def test_skipped_rounds_leave_outputs_and_greedy_drafts_as_without_skipping():
    hand, rounds = forced_run()
    out, why = hand.outputs()
    reference = H.reference()
    assert out == [reference.tokens[b] for b in range(len(out))]
    draft = drafter()
    checked = behind = far_behind = 0
    for choice, before, drafted, after in rounds:
        for b in range(hand.num_rows):
            if drafted.done[b] or GAMMAS[choice] == 0:
                continue
            n = int(drafted.num_tokens[b])
            k = int(drafted.proposal.num_draft[b])
            chain = drafted.tokens[b, :n].tolist() + drafted.proposal.drafts[b, :k].tolist()
            logits = H.teacher_logits(draft.config, draft.params, chain)
            # each draft is the draft model's argmax after the committed tokens and the drafts before it
            assert drafted.proposal.drafts[b, :k].tolist() == [int(logits[n - 1 + i].argmax()) for i in range(k)]
            checked += k
        if GAMMAS[choice] > 0:
            live = ~before.done
            lag = before.num_tokens[live] - before.drafter_state.lengths[live]  # tokens it lacks, t0 included
            behind += bool(np.any(lag > WINDOW))
            far_behind += bool(np.any(lag > CATCH_UP + WINDOW))
    assert checked >= 40 and behind >= 2 and far_behind >= 1


def test_a_plain_round_leaves_the_draft_cache_as_it_was_and_right_below_its_length():
    hand, rounds = forced_run()
    capacity = hand.spec.capacity
    draft = drafter()
    plain_rounds = 0
    for choice, before, _, after in rounds:
        if GAMMAS[choice] != 0:
            continue
        plain_rounds += 1
        # only the length moves: down to the first slot it lacks, below a rejected draft's
        first_missing = np.minimum(before.drafter_state.lengths, np.maximum(before.num_tokens - 2, 0))
        np.testing.assert_array_equal(after.drafter_state.lengths, first_missing)
        for got, was in zip(after.drafter_state.stacked(), before.drafter_state.stacked()):
            np.testing.assert_array_equal(got, was)
        committed = np.where(np.arange(capacity)[None] < after.num_tokens[:, None], after.tokens[:, :capacity], 0)
        want = H.rebuild_cache(draft.config, draft.params, committed, capacity)
        for b in range(hand.num_rows):
            if after.done[b]:
                continue
            kept = int(after.drafter_state.lengths[b])
            for got, expected in zip(after.drafter_state.stacked(), want):
                np.testing.assert_allclose(got[:, b, :kept], expected[:, b, :kept], rtol=1e-5, atol=1e-5)
    assert plain_rounds >= 25
