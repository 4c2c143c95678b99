"""The drafter protocol (DESIGN section 5).

A drafter is a frozen, hashable dataclass (it is a static argument of the
jitted round) whose arrays live in `params`, a field left out of hashing and
equality. Its methods are pure functions of explicit arguments and must read
weights from the `params` argument, never from `self.params`, so weights enter
the compiled program as inputs rather than as constants:

    init(params, prompts i32[B,P], prompt_lens i32[B], capacity) -> state
    propose(params, state, ctx: DraftContext, gamma) -> (Proposal, state)

A drafter keeps no committed length of its own: `ctx.num_tokens` says what is
committed, so rejected drafts are rolled back for free (DESIGN section 2).
"""

from __future__ import annotations

from typing import Any, NamedTuple, Protocol

import flax.struct
import jax

from specdec_jax.sampling import RowSampling

# fold_in tags under a row's per-round key (engine.row_keys), one per use.
DRAFT_TAG = 0
VERIFY_TAG = 1
CORRUPT_TAG = 2


class Proposal(NamedTuple):
    drafts: jax.Array  # i32[B,G] proposed tokens, padded past num_draft
    num_draft: jax.Array  # i32[B] real drafts per row, 0..G
    probs: jax.Array | None  # f32[B,G,V] law each draft was drawn from; None = point mass


@flax.struct.dataclass
class DraftContext:
    """What a drafter may read about the committed sequences of a round."""

    tokens: jax.Array  # i32[B,Tbuf] committed tokens (prompt, then generated), junk past num_tokens
    num_tokens: jax.Array  # i32[B] committed count; tokens[b, num_tokens[b]-1] is t0
    row_keys: jax.Array  # key[B] this round's per-row keys (fold in DRAFT_TAG / CORRUPT_TAG)
    sampling: RowSampling  # per-row sampling settings (the drafter's q uses the same transforms)


class Drafter(Protocol):
    name: str
    params: Any

    def init(self, params, prompts: jax.Array, prompt_lens: jax.Array, capacity: int) -> Any: ...

    def propose(self, params, state, ctx: DraftContext, gamma: int) -> tuple[Proposal, Any]: ...
