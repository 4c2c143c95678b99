"""Retrieval drafting: the row's own history first (prompt lookup), token datastores to fill, on device.

Every round, for every row, inside the jitted loop (docs/retrieval.md):

1. Prompt lookup (`NgramDrafter`, ``lookup``) over the row's prompt and output.
2. Each datastore (`specdec_jax.datastore`: a token array and its suffix array,
   in the drafter's params; the target's own outputs first when it keeps them,
   then the fixed one): for n from ``max_n`` down to ``min_n``, the run of
   suffixes that begin with the row's last n tokens, by binary search
   (`suffix_run`: ceil(log2 N) steps, each one gather of n tokens, every n and
   both ends of each run searched at once); the longest n with a run wins. Its continuation is grown token by token: at each depth,
   PROBES suffixes evenly spaced over the run name candidate next tokens (any
   token followed by more than 1/PROBES of the run is among them), each
   candidate's exact count is its own sub-run (two more binary searches, the run
   being sorted by that token), and the most frequent one is drafted, the run
   narrowed to it. A continuation stops at a document's end.
3. Combination: a chain is prompt lookup's when it found one, else that of the
   datastore with the longest match (the first datastore among equals). A tree
   (``tree``: K = topk, D = depth) holds prompt lookup's trie first
   (`NgramDrafter.trie_nodes`), then each datastore's K most frequent next
   tokens, each grown greedily to depth D, up to ``tree.nodes`` nodes. The
   target's own outputs come before prompt lookup (chain and tree) where they
   match more tokens than prompt lookup can (its max_n): a repeated request.

The outputs datastore (``outputs`` > 0) starts empty; `observe` adds each
generate call's outputs after the call, so a row drafts from what earlier calls
produced, never from its own future. Its arrays keep one shape as it fills.

The drafter is deterministic (q is a point mass), so stochastic verification
stays exact. Its cost does not depend on a datastore's size but through log N.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from specdec_jax import token_tree
from specdec_jax.datastore import SEP, Datastore, OutputsStore
from specdec_jax.drafters.base import DraftContext, DrafterBase, PrefillContext, Proposal
from specdec_jax.drafters.ngram import NgramDrafter
from specdec_jax.token_tree import TreeShape

PROBES = 8  # candidate next tokens read per depth of a continuation
END = -1  # what a read past the datastore's end gives


def read(data: jax.Array, starts: jax.Array, width: int) -> jax.Array:
    """i32[..., width]: ``data[s : s + width]`` for each start (END past the end)."""
    index = starts[..., None] + jnp.arange(width)
    return jnp.take(data, index, mode="fill", fill_value=END)


def compare(window: jax.Array, key: jax.Array, n: jax.Array) -> jax.Array:
    """i32[...]: the sign of ``window[:n]`` against ``key[:n]`` (lexicographic; both [..., W], n <= W)."""
    live = jnp.arange(window.shape[-1]) < n[..., None]
    differ = (window != key) & live
    first = jnp.argmax(differ, axis=-1)[..., None]
    sign = jnp.sign(jnp.take_along_axis(window, first, -1) - jnp.take_along_axis(key, first, -1))[..., 0]
    return jnp.where(differ.any(-1), sign, 0)


def bound(data, suffixes, lo, hi, key, n, offset, upper) -> jax.Array:
    """The first index in [lo, hi) of ``suffixes`` whose n symbols from ``offset`` are >= ``key[:n]``
    (where ``upper``: > key[:n]); all arguments broadcast over the leading shape, key [..., W]."""
    size = suffixes.shape[0]

    def step(_, bounds):
        lo, hi = bounds
        mid = (lo + hi) // 2
        sign = compare(read(data, suffixes[jnp.minimum(mid, size - 1)] + offset, key.shape[-1]), key, n)
        right = (sign < 0) | (upper & (sign == 0))
        live = lo < hi
        return jnp.where(live & right, mid + 1, lo), jnp.where(live & ~right, mid, hi)

    return jax.lax.fori_loop(0, max(1, math.ceil(math.log2(size + 1))), step, (lo, hi))[0]


def suffix_run(data, suffixes, key, n, lo=None, hi=None, offset=0) -> tuple[jax.Array, jax.Array]:
    """``(lo, hi)``: the run of ``suffixes`` (within [lo, hi), default all) whose n symbols from
    ``offset`` equal ``key[:n]``; empty (lo == hi) where none does. Both ends are searched at once
    (one loop of ceil(log2 N) steps over a leading axis of 2)."""
    shape = n.shape
    lo = jnp.zeros(shape, jnp.int32) if lo is None else jnp.broadcast_to(lo, shape)
    hi = jnp.full(shape, suffixes.shape[0], jnp.int32) if hi is None else jnp.broadcast_to(hi, shape)
    both = lambda x: jnp.broadcast_to(x, (2,) + jnp.shape(x))  # noqa: E731
    upper = jnp.arange(2).reshape((2,) + (1,) * len(shape)) == 1
    ends = bound(data, suffixes, both(lo), both(hi), both(key), both(n), both(jnp.broadcast_to(offset, shape)), upper)
    return ends[0], ends[1]


def longest_match(data, suffixes, tokens, length, min_n: int, max_n: int):
    """``(lo, hi, n)`` i32[B]: the run of datastore suffixes that begin with the longest suffix of each
    row's context (``tokens`` i32[B,T], ``length`` i32[B] committed), n in [min_n, max_n]; n = 0 and
    an empty run where none of those lengths is found. Every n is searched at once."""
    lengths = jnp.arange(min_n, max_n + 1)  # [M]
    start = length[:, None] - lengths[None, :]  # [B,M] the suffix of length n starts here
    index = jnp.clip(start[:, :, None] + jnp.arange(max_n)[None, None, :], 0, tokens.shape[1] - 1)
    key = jnp.take_along_axis(tokens, index.reshape(tokens.shape[0], -1), 1).reshape(index.shape)  # [B,M,W]
    n = jnp.broadcast_to(lengths, start.shape).astype(jnp.int32)
    lo, hi = suffix_run(data, suffixes, key, n)
    hit = (hi > lo) & (start >= 0)
    best = (max_n - min_n) - jnp.argmax(hit[:, ::-1], axis=1)  # the longest n found
    pick = lambda x: jnp.take_along_axis(x, best[:, None], 1)[:, 0]  # noqa: E731
    found = hit.any(axis=1)
    return (jnp.where(found, pick(lo), 0), jnp.where(found, pick(hi), 0),
            jnp.where(found, pick(n), 0).astype(jnp.int32))


def next_tokens(data, suffixes, lo, hi, offset, probes: int = PROBES):
    """``(token, count, lo, hi)`` [..., P]: the candidate next tokens of a run (the symbol at ``offset`` of
    P suffixes evenly spaced over [lo, hi)), each candidate's count in the run and its sub-run; a
    candidate repeated among the probes is counted once (count 0 after its first), END and SEP
    (a document's end) count 0."""
    spread = lo[..., None] + (jnp.arange(probes) * (hi - lo)[..., None]) // probes
    token = jnp.take(data, suffixes[jnp.minimum(spread, suffixes.shape[0] - 1)] + offset[..., None], mode="fill",
                     fill_value=END)
    shape = token.shape
    sub_lo, sub_hi = suffix_run(data, suffixes, token[..., None], jnp.ones(shape, jnp.int32), lo[..., None],
                                hi[..., None], offset[..., None])
    repeat = jnp.tril(token[..., :, None] == token[..., None, :], -1).any(-1)  # an earlier probe has it
    count = jnp.where((hi > lo)[..., None] & ~repeat & (token != END) & (token != SEP), sub_hi - sub_lo, 0)
    return token, count, sub_lo, sub_hi


def grow(data, suffixes, lo, hi, offset, depth: int):
    """``(tokens, present)`` [..., depth]: a run's continuation, the most frequent next token at each
    depth (the first probe's among equals); present until the run has no next token."""
    tokens, present = [], []
    alive = hi > lo
    for _ in range(depth):
        token, count, sub_lo, sub_hi = next_tokens(data, suffixes, lo, hi, offset)
        best = jnp.argmax(count, axis=-1)[..., None]
        pick = lambda x: jnp.take_along_axis(x, best, -1)[..., 0]  # noqa: E731
        alive &= pick(count) > 0
        tokens.append(jnp.where(alive, pick(token), 0))
        present.append(alive)
        lo, hi, offset = pick(sub_lo), pick(sub_hi), offset + 1
    if not tokens:
        return jnp.zeros(lo.shape + (0,), jnp.int32), jnp.zeros(lo.shape + (0,), bool)
    return jnp.stack(tokens, -1).astype(jnp.int32), jnp.stack(present, -1)


@dataclasses.dataclass(frozen=True)
class RetrievalDrafter(DrafterBase):
    """Prompt lookup, then token datastores (module docstring). Build one with `from_datastore`.

    datastore: names the fixed datastore (its sources, tokenizer and size; "" for none), for equality and caches.
    min_n, max_n: context suffix lengths searched in the datastores, longest first.
    lookup: the prompt-lookup drafter tried first (its own n-gram lengths); None: the datastores alone.
    tree: propose a trie (module docstring); None: a chain.
    outputs: the capacity in tokens of the target's own outputs as a datastore (`OutputsStore`); 0: none.
    memory: that outputs store (host side), filled by `observe`.
    params: {"stores": [{"tokens": i32[N], "suffixes": i32[N]}, ...]}, the datastores on device, the
      outputs one first.
    """

    datastore: str
    max_token: int  # the largest token id in the fixed datastore (checked against the target's vocabulary)
    min_n: int = 2
    max_n: int = 8
    lookup: NgramDrafter | None = NgramDrafter(max_n=3, min_n=1)
    tree: TreeShape | None = None
    outputs: int = 0
    name: str = dataclasses.field(default="retrieval", init=False)
    memory: OutputsStore | None = dataclasses.field(default=None, compare=False)
    params: dict | None = dataclasses.field(default=None, compare=False)

    def __post_init__(self):
        if not 1 <= self.min_n <= self.max_n:
            raise ValueError(f"need 1 <= min_n <= max_n for the datastore lookup, got {self.min_n}, {self.max_n}")
        if self.lookup is not None and self.lookup.tree != self.tree:
            object.__setattr__(self, "lookup", dataclasses.replace(self.lookup, tree=self.tree))

    @classmethod
    def from_datastore(cls, store: Datastore | None, outputs: int = 0, **options) -> RetrievalDrafter:
        """The drafter over ``store`` (placed on the default device) and, with ``outputs`` > 0, an
        outputs datastore of that many tokens; at least one of the two."""
        if store is None and not outputs:
            raise ValueError("a retrieval drafter needs a datastore: a fixed one, the outputs one, or both")
        memory = OutputsStore(outputs) if outputs else None
        stores = [_on_device(*memory.arrays())] if memory else []
        name, max_token = "", 0
        if store is not None:
            tokens = store.tokens
            name = f"{'+'.join(store.meta['sources'])}:{store.meta['tokenizer']}:{tokens.size}"
            max_token = int(np.max(tokens, where=tokens != SEP, initial=0))
            stores.append(_on_device(tokens, store.suffixes))
        return cls(datastore=name, max_token=max_token, outputs=outputs, memory=memory, params={"stores": stores},
                   **options)

    def observe(self, outputs) -> None:
        """Adds a finished generate call's outputs to the outputs datastore (when the drafter keeps one)."""
        if self.memory is not None:
            self.memory.add(outputs)
            self.params["stores"][0] = _on_device(*self.memory.arrays())

    def check(self, target, mesh) -> None:
        if self.max_token >= target.vocab_size:
            raise ValueError(f"the datastore {self.datastore} holds token {self.max_token}, past the target's "
                             f"{target.vocab_size}-token vocabulary: it was built with another tokenizer")
        if mesh is not None:
            raise ValueError("the retrieval drafter runs on one device: --mesh is not supported with it")

    def init(self, params, prefill: PrefillContext):
        return None

    def propose(self, params, state, ctx: DraftContext, gamma: int):
        matches = [(s["tokens"], s["suffixes"], *longest_match(s["tokens"], s["suffixes"], ctx.tokens, ctx.num_tokens,
                                                               self.min_n, self.max_n)) for s in params["stores"]]
        if self.tree is not None:
            return self._propose_tree(matches, ctx, gamma), state
        chains = [grow(data, suffixes, lo, hi, n, gamma) for data, suffixes, lo, hi, n in matches]
        best = jnp.argmax(jnp.stack([m[-1] for m in matches], axis=1), axis=1)  # longest match, first among equals
        drafts = jnp.stack([c[0] for c in chains], axis=1)[jnp.arange(best.size), best]  # [B,G]
        present = jnp.stack([c[1] for c in chains], axis=1)[jnp.arange(best.size), best]
        num_draft = jnp.cumprod(present, axis=1).sum(axis=1).astype(jnp.int32)
        if self.lookup is not None:
            own, _ = self.lookup.propose(None, None, ctx, gamma)
            mine = (own.num_draft > 0) & ~self._outputs_first(matches)
            drafts = jnp.where(mine[:, None], own.drafts, drafts)
            num_draft = jnp.where(mine, own.num_draft, num_draft)
        return Proposal(drafts, num_draft, None), state

    def _outputs_first(self, matches) -> jax.Array:
        """bool[B]: the outputs datastore matched more tokens than prompt lookup can (its max_n)."""
        if not self.outputs or self.lookup is None:
            return jnp.zeros(matches[0][-1].shape, bool)
        return matches[0][-1] > self.lookup.max_n

    def _propose_tree(self, matches, ctx: DraftContext, nodes: int) -> Proposal:
        parts = [self._branches(*m) for m in matches]
        if self.lookup is None:
            drafts, num, parents = _first_nodes_of(parts, nodes)
            return Proposal(drafts, num, None, parents)
        own = self.lookup.trie_nodes(ctx)
        drafts, num, parents = _first_nodes_of([own, *parts], nodes)  # own history first
        if self.outputs:  # unless the outputs datastore matched longer
            first = self._outputs_first(matches)
            drafts_o, num_o, parents_o = _first_nodes_of([parts[0], own, *parts[1:]], nodes)
            drafts, num, parents = (jnp.where(first[:, None], drafts_o, drafts), jnp.where(first, num_o, num),
                                    jnp.where(first[:, None], parents_o, parents))
        return Proposal(drafts, num, None, parents)

    def _branches(self, data, suffixes, lo, hi, n):
        """``(tokens, parents, keep)`` [B, K*D]: a datastore's K most frequent next tokens, each grown to depth D."""
        k, depth = self.tree.topk, self.tree.depth
        batch = lo.shape[0]
        token, count, sub_lo, sub_hi = next_tokens(data, suffixes, lo, hi, n, max(PROBES, k))
        count, best = jax.lax.top_k(count, k)  # [B,K] the K most frequent first tokens
        pick = lambda x: jnp.take_along_axis(x, best, 1)  # noqa: E731
        rest, rest_present = grow(data, suffixes, pick(sub_lo), pick(sub_hi), (n + 1)[:, None].repeat(k, 1),
                                  depth - 1)
        cont = jnp.concatenate([pick(token)[:, :, None], rest], axis=2)  # [B,K,D]
        present = jnp.cumprod(jnp.concatenate([(count > 0)[:, :, None], rest_present], axis=2), axis=2).astype(bool)
        offset = jnp.arange(depth)[None, None, :]
        parent = jnp.where(offset == 0, token_tree.ROOT, jnp.arange(k)[None, :, None] * depth + offset - 1)
        return tuple(x.reshape(batch, k * depth) for x in (cont, jnp.broadcast_to(parent, cont.shape), present))


def _first_nodes_of(parts, nodes: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``(drafts, num, parents)``: the first ``nodes`` kept nodes of the tries ``parts`` [(tokens, parents,
    keep) each [B, M_i], parents within the part] in order (`token_tree.first_nodes`)."""
    tokens, parents, keep, shift = [], [], [], 0
    for t, p, k in parts:  # each part's parents point into itself: shift them past the earlier parts
        tokens.append(t)
        parents.append(jnp.where(p >= 0, p + shift, p))
        keep.append(k)
        shift += t.shape[1]
    drafts, parents, num = token_tree.first_nodes(jnp.concatenate(tokens, 1), jnp.concatenate(parents, 1).astype(jnp.int32),
                                             jnp.concatenate(keep, 1), nodes)
    return drafts, num, parents


def _on_device(tokens: np.ndarray, suffixes: np.ndarray) -> dict:
    return {"tokens": jnp.asarray(tokens), "suffixes": jnp.asarray(suffixes)}
