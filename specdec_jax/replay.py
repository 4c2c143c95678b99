"""Greedy speculation replayed along recorded greedy outputs: tokens per round without the target.

Under greedy decoding the output does not depend on the drafter, and a round's drafts depend only on the
committed prefix, which is the target's own output. So once the plain greedy output of a prompt is
known, any deterministic drafter's rounds can be replayed exactly without running the target: draft from
the prefix, accept the drafts up to the first one the output does not have, emit one more token. This is
how experiments compare drafters on a large model cheaply (tokens per round is what the engine would
count; `tests/test_retrieval.py` checks the replay against the engine).
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from specdec_jax.drafters.base import DraftContext


def replay_greedy(matches: Sequence[bool], gamma: int) -> tuple[int, list[int], list[int]]:
    """A draft model's greedy speculation replayed: ``matches[i]`` says whether the draft's greedy token
    equals output token i given the output before it (one teacher-forced pass of the draft). A round
    accepts the drafts up to the first mismatch (at most gamma) and emits one more token. Returns (rounds,
    proposed per position, accepted per position)."""
    i, rounds, proposed, accepted = 0, 0, [0] * gamma, [0] * gamma
    while i < len(matches):
        k = 0
        while k < gamma and i + k < len(matches) and matches[i + k]:
            k += 1
        for j in range(gamma):
            proposed[j] += 1
            accepted[j] += j < k
        i += k + 1
        rounds += 1
    return rounds, proposed, accepted


def replay_drafter(drafter, rows: Sequence[tuple[Sequence[int], Sequence[int]]], gamma: int,
                   matches: Sequence[Sequence[bool]] | None = None) -> list[dict]:
    """Per row: ``rounds``, ``emitted_tokens``, ``drafts`` (the drafter's) and ``model_drafts`` of a
    greedy replay of ``drafter`` (a chain drafter that reads only committed tokens: n-gram, retrieval;
    None: no drafts) over ``rows`` [(prompt ids, greedy output ids)], every unfinished row drafting each
    round from its prefix. With ``matches`` (per row, as in `replay_greedy`), a draft model drafts the
    rest of the gamma after a chain the output wholly follows: the chain first, the model to extend it
    (after a wrong draft the round ends anyway, so what the model would draft there does not matter)."""
    sequences = [list(p) + list(o) for p, o in rows]
    tokens = np.zeros((len(rows), max(map(len, sequences))), np.int32)
    for b, seq in enumerate(sequences):
        tokens[b, : len(seq)] = seq
    start = np.array([len(p) for p, _ in rows])
    pos, end = start.copy(), np.array([len(s) for s in sequences])
    stats = [{"rounds": 0, "emitted_tokens": 0, "drafts": 0, "model_drafts": 0} for _ in rows]
    propose = jax.jit(lambda params, tokens, num: _propose(drafter, params, tokens, num, gamma))
    while (pos < end).any():
        if drafter is None:
            drafts, num = np.zeros((len(rows), gamma), np.int32), np.zeros(len(rows), np.int32)
        else:
            drafts, num = jax.device_get(propose(drafter.params, jnp.asarray(tokens), jnp.asarray(pos, jnp.int32)))
        for b in np.flatnonzero(pos < end):
            k = 0
            while k < num[b] and pos[b] + k < end[b] and drafts[b, k] == tokens[b, pos[b] + k]:
                k += 1
            more = gamma - int(num[b]) if matches is not None and k == num[b] else 0
            extension = list(matches[b][pos[b] + k - start[b]:][:more]) if more else []
            k += next((i for i, m in enumerate(extension) if not m), len(extension))
            emit = min(k + 1, end[b] - pos[b])
            stats[b]["rounds"] += 1
            stats[b]["emitted_tokens"] += int(emit)
            stats[b]["drafts"] += int(num[b])
            stats[b]["model_drafts"] += more
            pos[b] += emit
    return stats


def _propose(drafter, params, tokens, num_tokens, gamma: int):
    """(drafts i32[B,gamma], num_draft i32[B]) from a context of committed tokens only."""
    zeros = jnp.zeros_like(num_tokens)
    ctx = DraftContext(tokens=tokens, num_tokens=num_tokens, prompt_lens=num_tokens, room=zeros + gamma,
                       last_emit=zeros, last_accepted=zeros, features=None, keys=None, sampling=None,
                       target_params=None, target=None)
    proposal, _ = drafter.propose(params, None, ctx, gamma)
    return proposal.drafts, proposal.num_draft
