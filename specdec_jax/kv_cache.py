"""Fixed-capacity key/value cache whose only mutable bookkeeping is ``lengths``.

Row ``b`` has committed slots ``0 .. lengths[b]-1``. A forward pass writes its S
new keys/values at slots ``lengths[b] + s`` without changing ``lengths``; the
caller commits by moving ``lengths`` forward. Rollback is moving it back
(:meth:`KVCache.with_lengths`): stale slots beyond ``lengths`` are masked out by
attention and overwritten by the next write, never zeroed.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct


@struct.dataclass
class KVCache:
    """Stacked per-layer keys and values plus the committed length of each row."""

    k: jax.Array  # f32[L,B,T,Hkv,D]
    v: jax.Array  # f32[L,B,T,Hkv,D]
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
        shape = (num_layers, batch, capacity, num_kv_heads, head_dim)
        return cls(
            k=jnp.zeros(shape, dtype),
            v=jnp.zeros(shape, dtype),
            lengths=jnp.zeros((batch,), jnp.int32),
        )

    @property
    def capacity(self) -> int:
        """T, the number of slots per row."""
        return self.k.shape[2]

    def with_lengths(self, lengths: jax.Array) -> KVCache:
        """Same buffers, new committed lengths ``i32[B]`` (commit or rollback)."""
        return self.replace(lengths=jnp.asarray(lengths, jnp.int32))

    def write(self, layer: jax.Array | int, new_k: jax.Array, new_v: jax.Array) -> KVCache:
        """Writes ``new_k, new_v: f32[B,S,Hkv,D]`` of one layer at slots ``lengths[b] + s``.

        ``layer`` is a (possibly traced) scalar index into the leading axis. It is a
        scatter with ``mode="drop"``: a slot ``>= T`` is discarded, never clamped
        onto an earlier slot (``dynamic_update_slice`` would clamp the whole block
        back into range and overwrite committed entries). ``lengths`` is unchanged.
        """
        batch, steps = new_k.shape[:2]
        rows = jnp.arange(batch)[:, None]  # i32[B,1]
        slots = self.lengths[:, None] + jnp.arange(steps)[None, :]  # i32[B,S]

        def scatter(buf: jax.Array, new: jax.Array) -> jax.Array:
            return buf.at[layer, rows, slots].set(
                new.astype(buf.dtype), mode="drop", wrap_negative_indices=False
            )

        return self.replace(k=scatter(self.k, new_k), v=scatter(self.v, new_v))
