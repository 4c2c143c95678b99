"""Prompt lookup: propose what followed the latest earlier occurrence of the row's suffix.

For n from `max_n` down to `min_n`: the pattern is the last n committed tokens;
a start j matches if `h[j:j+n] == pattern` and `j + n < L` (a continuation
exists). The most recent (or earliest) match of the largest n wins and
proposes `h[j+n : j+n+gamma]`, clipped at L, so `num_draft = min(gamma, L-(j+n))`.
Rows with no match propose 0 drafts. Fixed shape: a [B, Tbuf] compare per
(n, offset), no host sync.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from specdec_jax.drafters.base import DraftContext, DrafterBase, PrefillContext, Proposal


@dataclasses.dataclass(frozen=True)
class NgramDrafter(DrafterBase):
    """N-gram prompt-lookup drafter (deterministic: q is a point mass).

    max_n, min_n: suffix lengths tried, longest first.
    prefer: "recent" (the match closest to the end) or "earliest".
    window: search only the last `window` committed tokens (None = all).
    """

    max_n: int = 3
    min_n: int = 1
    prefer: str = "recent"
    window: int | None = None
    name: str = dataclasses.field(default="ngram", init=False)
    params: None = dataclasses.field(default=None, init=False, compare=False)

    def __post_init__(self):
        if not 1 <= self.min_n <= self.max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got min_n={self.min_n}, max_n={self.max_n}")
        if self.prefer not in ("recent", "earliest"):
            raise ValueError(f"prefer must be 'recent' or 'earliest', got {self.prefer!r}")
        if self.window is not None and self.window < 1:
            raise ValueError(f"window must be >= 1 or None, got {self.window}")

    def init(self, params, prefill: PrefillContext):
        return None

    def propose(self, params, state, ctx: DraftContext, gamma: int):
        tokens, length = ctx.tokens, ctx.num_tokens
        batch, size = tokens.shape
        starts = jnp.arange(size)[None, :]  # i32[1,Tbuf]
        padded = jnp.pad(tokens, ((0, 0), (0, self.max_n)), constant_values=-1)
        found = jnp.zeros((batch,), bool)
        cont = jnp.zeros((batch,), jnp.int32)  # index of the first proposed token
        for n in range(self.max_n, self.min_n - 1, -1):
            pattern = jnp.take_along_axis(tokens, jnp.maximum(length[:, None] - n + jnp.arange(n), 0), axis=1)
            match = (starts + n < length[:, None]) & (length[:, None] >= n)
            if self.window is not None:
                match &= starts >= length[:, None] - self.window
            for i in range(n):
                match &= padded[:, i : i + size] == pattern[:, i : i + 1]
            if self.prefer == "recent":
                start = size - 1 - jnp.argmax(match[:, ::-1], axis=1)
            else:
                start = jnp.argmax(match, axis=1)
            hit = match.any(axis=1) & ~found
            cont = jnp.where(hit, start + n, cont)
            found |= hit
        index = jnp.minimum(cont[:, None] + jnp.arange(gamma)[None, :], size - 1)
        drafts = jnp.take_along_axis(tokens, index, axis=1)
        num_draft = jnp.where(found, jnp.minimum(gamma, length - cont), 0).astype(jnp.int32)
        return Proposal(drafts.astype(jnp.int32), num_draft, None), state
