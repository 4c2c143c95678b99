"""The target model as the engine sees it: a pure apply function and a few static facts.

The engine (``specdec_jax.engine``) imports no model module. It runs any
``TargetModel``, a frozen, hashable object (a static argument of the jitted
round) with

    apply(params, tokens i32[B,S], cache, positions i32[B,S], block_mask bool[B,S,S] | None,
          hidden_layers tuple[int, ...], *, compute_logits=True)
        -> (logits f32[B,S,V] | None, hidden f32[len(hidden_layers),B,S,H] | None, cache)

with these semantics (docs/design.md sections 3 and 9):

- keys/values of input ``s`` are written at slot ``cache.lengths[b] + s``
  (slots ``>= T`` are dropped); ``cache.lengths`` is returned unchanged;
- query ``(b, s)`` sees the committed slots ``< cache.lengths[b]`` and in-block
  slot ``cache.lengths[b] + j`` iff ``block_mask[b, s, j]``; ``None`` is the
  causal mask ``j <= s`` (a chain);
- ``positions`` drive RoPE only (a chain: ``lengths + s``; a token tree:
  ``lengths + depth``);
- ``hidden_layers`` names the hidden states to return, stacked in that order:
  ``l >= 0`` is the residual stream after decoder layer ``l`` (0-based), and
  ``FINAL_NORM`` (-1) the final-norm output the LM head reads. ``()`` returns
  ``hidden = None``. Drafters that read the target (EAGLE, Medusa) declare the
  layers they need; the engine asks for exactly those.
- ``compute_logits=False`` skips the LM head (prefill), ``logits = None``.
- ``defer_writes=True`` only reads the cache and returns the block's keys and
  values as a ``KVBlock`` in place of the cache (the engine writes it with
  ``cache.write_block`` outside the ``lax.switch`` over verify widths, where a
  write would copy the cache); the outputs are those of the writing pass.

Besides ``apply``: ``embed(params, tokens i32[B,S]) -> f32[B,S,H]`` (the input
embedding) and ``logits_of(params, normed f32[B,S,H]) -> f32[B,S,V]`` (the LM
head applied to final-norm states: ``logits_of(apply(...).hidden[FINAL_NORM])``
is ``apply``'s logits), for drafter heads that share them with the target;
``init_cache(batch, capacity)`` (an empty ``KVCache``),
``vocab_size``, ``hidden_size``, ``num_layers``, ``max_positions`` (the trained
context length, or None) and ``check_mesh(mesh)`` (ValueError unless the
model's sharding rules fit the mesh).

Something that can be generated from (a ``Llama``, a ``LoadedModel``) hands out
``as_target() -> (TargetModel, params)``.
"""

from __future__ import annotations

from typing import Any, Protocol

import jax
import jax.numpy as jnp

from specdec_jax.kv_cache import KVBlock, KVCache

FINAL_NORM = -1  # hidden_layers entry: the final-norm hidden state (the LM head's input)


class TargetModel(Protocol):
    vocab_size: int
    hidden_size: int
    num_layers: int
    max_positions: int | None

    def init_cache(self, batch: int, capacity: int) -> KVCache: ...

    def apply(self, params: Any, tokens: jax.Array, cache: KVCache, positions: jax.Array,
              block_mask: jax.Array | None = None, hidden_layers: tuple[int, ...] = (), *,
              compute_logits: bool = True,
              defer_writes: bool = False) -> tuple[jax.Array | None, jax.Array | None, KVCache | KVBlock]: ...

    def embed(self, params: Any, tokens: jax.Array) -> jax.Array: ...

    def logits_of(self, params: Any, normed: jax.Array) -> jax.Array: ...

    def check_mesh(self, mesh) -> None: ...


def chain_positions(lengths: jax.Array, width: int) -> jax.Array:
    """i32[B,S]: positions of a chain block of ``width`` tokens after ``lengths`` i32[B]."""
    return lengths[:, None] + jnp.arange(width, dtype=jnp.int32)[None, :]


def resolve_target(target) -> tuple[TargetModel, Any]:
    """``(TargetModel, params)`` of anything with ``as_target()`` (a ``Llama``, a ``LoadedModel``)."""
    if not hasattr(target, "as_target"):
        raise ValueError(f"{type(target).__name__} is not a target model (it has no as_target())")
    return target.as_target()
