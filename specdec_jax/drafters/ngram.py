"""Prompt lookup: propose what followed the latest earlier occurrence of the row's suffix.

For n from `max_n` down to `min_n`: the pattern is the last n committed tokens;
a start j matches if `h[j:j+n] == pattern` and `j + n < L` (a continuation
exists). The most recent (or earliest) match of the largest n wins and
proposes `h[j+n : j+n+gamma]`, clipped at L, so `num_draft = min(gamma, L-(j+n))`.
Rows with no match propose 0 drafts. Fixed shape: a [B, Tbuf] compare per
(n, offset), no host sync.

With a `TreeShape` (`--tree-topk K --tree-depth D --tree-nodes N`) it proposes a
trie: the K best continuation starts (longest suffix match first, then the
preferred end; a start whose continuation adds nothing to the chosen ones',
being a prefix of one, is skipped), each continued for up to D tokens, merged
where their prefixes agree (one node per distinct prefix), the best match's
continuation first, then each next match's new nodes, the first N nodes kept:
every prefix of the nodes is a trie (what a shape policy verifies when it
truncates the tree, `engine.shape`), and the first D are the chain. K = 1 is
the chain.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from specdec_jax import token_tree
from specdec_jax.drafters.base import DraftContext, DrafterBase, PrefillContext, Proposal
from specdec_jax.token_tree import TreeShape


@dataclasses.dataclass(frozen=True)
class NgramDrafter(DrafterBase):
    """N-gram prompt-lookup drafter (deterministic: q is a point mass).

    max_n, min_n: suffix lengths tried, longest first.
    prefer: "recent" (the match closest to the end) or "earliest".
    window: search only the last `window` committed tokens (None = all).
    tree: propose a trie of several matches' continuations (module docstring); None: a chain.
    """

    max_n: int = 3
    min_n: int = 1
    prefer: str = "recent"
    window: int | None = None
    tree: TreeShape | None = None
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
        if self.tree is not None:
            return self._propose_trie(ctx, gamma), state
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

    @staticmethod
    def _distinct_best(tokens, length, score, k: int, depth: int):
        """``(score, start)`` i32[B,K]: the k best-scoring starts, each skipping the starts whose
        continuation (up to ``depth`` tokens, cut at the committed length) is a prefix of a chosen
        one's, since it would add no node; score -1 where fewer remain."""
        batch, size = tokens.shape
        position = jnp.arange(size)[None, :, None] + jnp.arange(depth)[None, None, :]  # [1,T,D]
        present = position < length[:, None, None]  # [B,T,D]
        cont = jnp.take_along_axis(tokens, jnp.minimum(position, size - 1).reshape(1, -1).repeat(batch, 0), axis=1)
        cont = cont.reshape(batch, size, depth)
        batch_index = jnp.arange(batch)
        scores, starts = [], []
        for _ in range(k):
            start = jnp.argmax(score, axis=1)
            best = score[batch_index, start]
            chosen, chosen_present = cont[batch_index, start], present[batch_index, start]  # [B,D]
            covered = jnp.all(~present | (chosen_present[:, None] & (cont == chosen[:, None])), axis=2)
            score = jnp.where(covered | (best < 0)[:, None], -1, score)
            scores.append(best)
            starts.append(start)
        return jnp.stack(scores, axis=1), jnp.stack(starts, axis=1).astype(jnp.int32)

    def _propose_trie(self, ctx: DraftContext, nodes: int) -> Proposal:
        """A trie of the K best matches' continuations, N = ``nodes`` nodes (point masses)."""
        drafts, parents, count = token_tree.first_nodes(*self.trie_nodes(ctx), nodes)
        return Proposal(drafts, count, None, parents)

    def trie_nodes(self, ctx: DraftContext) -> tuple[jax.Array, jax.Array, jax.Array]:
        """``(tokens, parents, keep)``, each [B, K*D]: the trie of the K best matches' continuations
        before compaction, node m * D + d the d-th token of match m (the best match's chain first),
        kept where it is the first of its prefix (`token_tree.compact` keeps its order)."""
        k, depth = self.tree.topk, self.tree.depth
        tokens, length = ctx.tokens, ctx.num_tokens
        batch, size = tokens.shape
        starts = jnp.arange(size)[None, :]  # continuation start p: tokens[p - n : p] is the suffix
        match_len = jnp.zeros((batch, size), jnp.int32)
        running = jnp.ones((batch, size), bool)
        for i in range(1, self.max_n + 1):
            before = jnp.take_along_axis(tokens, jnp.maximum(starts - i, 0), axis=1)
            suffix = jnp.take_along_axis(tokens, jnp.maximum(length - i, 0)[:, None], axis=1)
            running &= (starts - i >= 0) & (length[:, None] - i >= 0) & (before == suffix)
            match_len = jnp.where(running, i, match_len)
        eligible = (starts < length[:, None]) & (match_len >= self.min_n)
        if self.window is not None:
            eligible &= starts - self.min_n >= length[:, None] - self.window
        order = starts if self.prefer == "recent" else size - starts
        score = jnp.where(eligible, match_len * (size + 1) + order, -1)
        top, start = self._distinct_best(tokens, length, score, k, depth)  # [B,K] best first
        offset = jnp.arange(depth)[None, None, :]
        position = start[:, :, None] + offset  # [B,K,D]
        present = (top[:, :, None] >= 0) & (position < length[:, None, None])
        cont = jnp.take_along_axis(tokens, jnp.minimum(position, size - 1).reshape(batch, -1), axis=1)
        cont = cont.reshape(batch, k, depth)
        # same[b, m, m', d]: match m' has a first d + 1 tokens, and they are match m's
        agree = (cont[:, :, None, :] == cont[:, None, :, :]) & present[:, None, :, :]
        same = jnp.cumprod(agree, axis=3).astype(bool)
        first = jnp.argmax(same, axis=2).astype(jnp.int32)  # [B,K,D] the first match sharing that prefix
        keep = present & (first == jnp.arange(k)[None, :, None])
        parent = jnp.concatenate([jnp.full((batch, k, 1), token_tree.ROOT, jnp.int32),
                                  (first[:, :, :-1] * depth + offset[:, :, :-1]).astype(jnp.int32)], axis=2)
        flat = lambda x: x.reshape(batch, k * depth)  # noqa: E731
        return flat(cont), flat(parent), flat(keep)
