"""Fixed-capacity key/value cache whose only mutable bookkeeping is ``lengths``.

Keys are one ``[B,Hkv,T,D]`` buffer per layer and values one ``[B,Hkv,D,T]``
buffer per layer (tuples): both attention products then contract the buffer's
minor axis, so attention reads each layer's buffers in place (no slice copy, no
transpose; a ``[B,Hkv,T,D]`` value buffer was transposed every step, a cost that
grew with T).

A pass may also leave its keys/values unwritten (a :class:`KVBlock`, written
later by :meth:`KVCache.write_block`): inside a ``lax.switch`` that picks the
pass's width, writing the cache would make XLA copy every layer's buffers into
the branch (measured: +6% per round on SmolLM2), reading it does not. The
converse holds at top level: a pass that reads the cache followed by
`write_block` made XLA (CPU) copy every layer's buffers each call, so a pass
of one width runs in a conditional too (`ordered_read`).

Row ``b`` has committed slots ``0 .. lengths[b]-1``. A forward pass writes its S
new keys/values at slots ``lengths[b] + s`` without changing ``lengths``; the
caller commits by moving ``lengths`` forward. Rollback is moving it back
(:meth:`KVCache.with_lengths`): stale slots beyond ``lengths`` are masked out by
attention and overwritten by the next write, never zeroed.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct


def ordered_read(read, cache: "KVCache"):
    """``read(cache)`` (a pass that reads the cache and returns a `KVBlock` to write later) inside a
    conditional whose predicate is never false. A top-level read followed by `KVCache.write_block`
    made XLA (CPU) copy every layer's buffers so that the in-place write could not overtake the
    reads (docs/design.md section 3 has the cost); a conditional's reads are all done before
    anything after it runs."""
    always = jnp.all(cache.lengths >= 0)
    return jax.lax.cond(always, read, read, cache)


@struct.dataclass
class KVBlock:
    """The keys and values a pass computed for its S block tokens, not yet written into a cache
    (`TargetModel.apply(..., defer_writes=True)`): L x [B,S,Hkv,D] each, in the model's dtype."""

    k: tuple[jax.Array, ...]
    v: tuple[jax.Array, ...]

    def padded(self, steps: int) -> KVBlock:
        """The block widened with zeros to ``steps`` tokens (written past what is committed)."""
        pad = lambda x: jnp.pad(x, ((0, 0), (0, steps - x.shape[1]), (0, 0), (0, 0)))  # noqa: E731
        return KVBlock(tuple(map(pad, self.k)), tuple(map(pad, self.v)))

    @classmethod
    def zeros(cls, num_layers: int, batch: int, steps: int, num_kv_heads: int, head_dim: int,
              dtype: jnp.dtype = jnp.float32) -> KVBlock:
        """An empty block of ``steps`` tokens (a drafter's pending writes, `KVBlock.insert`)."""
        zero = lambda: jnp.zeros((batch, steps, num_kv_heads, head_dim), dtype)  # noqa: E731
        return cls(tuple(zero() for _ in range(num_layers)), tuple(zero() for _ in range(num_layers)))

    def insert(self, new: KVBlock, at: jax.Array) -> KVBlock:
        """This block with ``new``'s S tokens written at its columns ``at[b] + s`` (``at``: i32[B]; columns
        past the block dropped): a pass's keys/values added to the pending writes of the passes before it."""
        steps = new.k[0].shape[1]
        columns = at[:, None] + jnp.arange(steps)[None, :]  # i32[B,S]
        rows = jnp.arange(columns.shape[0])[:, None]
        put = lambda old, x: old.at[rows, columns].set(x.astype(old.dtype), mode="drop")  # noqa: E731
        return KVBlock(tuple(map(put, self.k, new.k)), tuple(map(put, self.v, new.v)))

    def take(self, order: jax.Array) -> KVBlock:
        """The block's tokens reordered: token ``s`` of the result is token ``order[b, s]``
        (i32[B,S']); a token tree's accepted path, moved to the front before it is written."""
        gather = lambda x: jnp.take_along_axis(x, order[:, :, None, None], axis=1)  # noqa: E731
        return KVBlock(tuple(map(gather, self.k)), tuple(map(gather, self.v)))


@struct.dataclass
class KVCache:
    """Per-layer keys and values plus the committed length of each row."""

    k: tuple[jax.Array, ...]  # L x [B,Hkv,T,D], in the model's dtype (float32 or bfloat16)
    v: tuple[jax.Array, ...]  # L x [B,Hkv,D,T], likewise
    lengths: jax.Array  # i32[B]

    @classmethod
    def init(
        cls,
        num_layers: int,
        batch: int,
        capacity: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: jnp.dtype = jnp.float32,
    ) -> KVCache:
        """An empty cache: zero keys/values, ``lengths == 0``."""
        return cls(
            k=tuple(jnp.zeros((batch, num_kv_heads, capacity, head_dim), dtype) for _ in range(num_layers)),
            v=tuple(jnp.zeros((batch, num_kv_heads, head_dim, capacity), dtype) for _ in range(num_layers)),
            lengths=jnp.zeros((batch,), jnp.int32),
        )

    @property
    def capacity(self) -> int:
        """T, the number of slots per row."""
        return self.k[0].shape[2]

    def stacked(self) -> tuple[np.ndarray, np.ndarray]:
        """``(k, v)`` as numpy ``[L,B,T,Hkv,D]`` arrays: a host copy, for inspection and tests (sliced on the
        host, where a device slice would compile a program per shape)."""
        return np.stack(self.k).transpose(0, 1, 3, 2, 4), np.stack(self.v).transpose(0, 1, 4, 2, 3)

    def with_lengths(self, lengths: jax.Array) -> KVCache:
        """Same buffers, new committed lengths ``i32[B]`` (commit or rollback)."""
        return self.replace(lengths=jnp.asarray(lengths, jnp.int32))

    def write(self, layer: int, new_k: jax.Array, new_v: jax.Array) -> KVCache:
        """Writes ``new_k, new_v: [B,S,Hkv,D]`` of layer ``layer`` at slots ``lengths[b] + s``, cast
        to the buffers' dtype.

        It is a scatter with ``mode="drop"``: a slot ``>= T`` is discarded, never
        clamped onto an earlier slot (``dynamic_update_slice`` would clamp the whole
        block back into range and overwrite committed entries). ``lengths`` is unchanged.
        """
        batch, steps = new_k.shape[:2]
        batch_index = jnp.arange(batch)[:, None]  # i32[B,1]
        slots = self.lengths[:, None] + jnp.arange(steps)[None, :]  # i32[B,S]

        # (row, slot) index pairs with [Hkv,D] windows: one scatter index per token, not per element,
        # so the scatter's index work grows with the tokens written, not with their elements
        # (docs/design.md section 3).
        def put(buffers: tuple[jax.Array, ...], index: tuple, values: jax.Array) -> tuple[jax.Array, ...]:
            buf = buffers[layer].at[index].set(values.astype(buffers[layer].dtype), mode="drop",
                                               wrap_negative_indices=False)
            return buffers[:layer] + (buf,) + buffers[layer + 1:]

        # Advanced indices split by slices put their [B,S] axes first: the updates are [B,S,Hkv,D].
        return self.replace(k=put(self.k, (batch_index, slice(None), slots, slice(None)), new_k),
                            v=put(self.v, (batch_index, slice(None), slice(None), slots), new_v))

    def write_block(self, block: KVBlock) -> KVCache:
        """Every layer's block keys/values written at slots ``lengths[b] + s`` (as :meth:`write`)."""
        cache = self
        for layer, (k, v) in enumerate(zip(block.k, block.v)):
            cache = cache.write(layer, k, v)
        return cache


class CacheWrite(NamedTuple):
    """Keys/values a drafter's proposal computed without writing its cache, for its ``settle`` hook to write
    after the engine's per-size switch (docs/design.md section 3, "Writes outside conditionals and loops")."""

    block: KVBlock  # keys/values of slots start + c (a width that may depend on the proposal; the engine pads it)
    start: jax.Array  # i32[B] the slot the block is written from (the capacity: nothing written)
    lengths: jax.Array  # i32[B] the cache's length after the write

    def into(self, cache: KVCache) -> KVCache:
        """``cache`` with the block written from ``start`` on and its lengths set to ``lengths``."""
        return cache.with_lengths(self.start).write_block(self.block).with_lengths(self.lengths)
