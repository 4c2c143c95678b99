"""The decoder's numerical pieces, shared by the Llama decoder (`models.llama`) and the heads that
reuse its layers: :func:`linear` (``x @ w.T`` for ``[out, in]`` weights), :func:`rms_norm`,
:func:`visibility` (which cache slots a block's queries see), grouped-query :func:`attention` and
:func:`with_pending` (a block's keys/values behind those of earlier passes not yet written).

Numerics: products with weights run in the weights' dtype; RMSNorm statistics and the attention
(scores, softmax and weighted sum, rounded once) are float32 (docs/models.md "Weight dtype").
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from specdec_jax.kv_cache import KVBlock


def linear(x: jax.Array, w: jax.Array, out_dtype=None) -> jax.Array:
    """``x [..., S, in] @ w.T`` for ``w [out, in]``, computed as ``w . x`` (``[out, ...]``, x's axes kept)
    and transposed back: the form XLA CPU runs at matrix-vector speed for a few rows; flattening x's
    rows first ([out, B*S]) runs slower on it. ``out_dtype``: the product's dtype (default x's and w's).

    On a CPU, one sequence's S rows are padded to :func:`cpu_rows` first and the padding's outputs
    dropped: each output row is its own dot product, so the others do not change."""
    rows = x.shape[-2] if x.ndim >= 2 else 1
    padded = cpu_rows(x.shape)
    if padded != rows:
        x = jnp.pad(x, [(0, 0)] * (x.ndim - 2) + [(0, padded - rows), (0, 0)])
    y = jnp.moveaxis(jnp.einsum("oi,...i->o...", w, x, preferred_element_type=out_dtype), 0, -1)
    return y[..., :rows, :] if padded != rows else y


def cpu_rows(shape: tuple[int, ...]) -> int:
    """The rows a product of ``x: shape [..., S, in]`` runs with: on XLA CPU, for one sequence (the axes
    before S of size 1), 5-7 rows become 8 and 9-15 become 16, because its kernel for those counts
    reads the weights more slowly than for 8 or 16 (Qwen2.5-Coder-1.5B: a pass of 5 tokens 305 ms
    against 247 ms for 8; padded, 237 ms; docs/design.md section 8). Elsewhere S."""
    rows = shape[-2] if len(shape) >= 2 else 1
    if len(shape) < 2 or math.prod(shape[:-2]) != 1 or jax.default_backend() != "cpu":
        return rows
    return 8 if 4 < rows < 8 else 16 if 8 < rows < 16 else rows


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """``x: [..., H]`` scaled to unit RMS (in float32), times ``weight: [H]``."""
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return weight * normed.astype(x.dtype)


def visibility(lengths: jax.Array, steps: int, slots: int, block_mask: jax.Array | None) -> jax.Array:
    """bool[B,S,W]: query ``(b, s)`` of a block written at ``lengths[b] + s`` sees slot ``j``.

    It sees the committed slots ``j < lengths[b]`` and in-block slot ``lengths[b] + i``
    iff ``block_mask[b, s, i]`` (``None``: causal, ``i <= s``, which is ``j <= lengths[b] + s``).
    """
    slot = jnp.arange(slots)[None, None, :]  # i32[1,1,W]
    if block_mask is None:
        return slot <= lengths[:, None, None] + jnp.arange(steps)[None, :, None]
    offset = slot - lengths[:, None, None]  # i32[B,1,W] slot index inside the block
    in_block = jnp.take_along_axis(block_mask, jnp.broadcast_to(jnp.clip(offset, 0, steps - 1),
                                                                (lengths.shape[0], steps, slots)), axis=2)
    return (offset < 0) | ((offset < steps) & in_block)


def attention(q: jax.Array, k: jax.Array, v: jax.Array, visible: jax.Array,
              block: tuple[jax.Array, jax.Array, jax.Array] | None = None) -> jax.Array:
    """Grouped-query attention of the block over cache slots.

    ``q: [B,S,N,D]``, ``k: [B,K,W,D]``, ``v: [B,K,D,W]`` (slots ``0..W-1``; the
    cache layout, in which both products contract the minor axis), ``visible:
    bool[B,S,W]`` (:func:`visibility`). With ``block = (k_b [B,S,K,D], v_b
    [B,S,K,D], visible_b bool[B,S,S])`` the block's own keys/values are not in
    the cache: the softmax runs over the visible cache slots and block tokens
    together. Returns ``[B,S,N,D]`` in ``q``'s dtype.

    Rule: scores, probabilities and the weighted sum of values are float32, rounded to
    ``q``'s dtype once, at the end. The keys a verify pass reads from its block, the plain
    step of the same token reads from the cache: the sum over keys is split in other places,
    and rounding each part (or the probabilities) to bfloat16 would make the two outputs
    differ (docs/models.md "Weight dtype").
    """
    batch, steps, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    f32 = jnp.float32
    q = q.reshape(batch, steps, num_kv_heads, num_heads // num_kv_heads, head_dim)
    scores = jnp.einsum("bskgd,bktd->bkgst", q, k, preferred_element_type=f32) / math.sqrt(head_dim)
    scores = jnp.where(visible[:, None, None], scores, -jnp.inf)
    if block is None:
        probs = jax.nn.softmax(scores, axis=-1)
        out = jnp.einsum("bkgst,bkdt->bskgd", probs, v, preferred_element_type=f32)
        return out.reshape(batch, steps, num_heads, head_dim).astype(q.dtype)
    k_block, v_block, visible_block = block
    own = jnp.einsum("bskgd,bjkd->bkgsj", q, k_block, preferred_element_type=f32) / math.sqrt(head_dim)
    own = jnp.where(visible_block[:, None, None], own, -jnp.inf)
    probs = jax.nn.softmax(jnp.concatenate([scores, own], axis=-1), axis=-1)
    width = k.shape[2]
    out = (jnp.einsum("bkgst,bkdt->bskgd", probs[..., :width], v, preferred_element_type=f32)
           + jnp.einsum("bkgsj,bjkd->bskgd", probs[..., width:], v_block, preferred_element_type=f32))
    return out.reshape(batch, steps, num_heads, head_dim).astype(q.dtype)


def with_pending(k: jax.Array, v: jax.Array, own: jax.Array, pending: tuple[KVBlock, jax.Array] | None,
                 layer: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The ``block`` argument of :func:`attention` for a pass's own keys/values ``k, v [B,S,K,D]`` and their
    visibility ``own bool[B,S,S]``, with ``pending = (block, seen bool[B,S,P])`` (earlier passes' keys/values
    not yet in the cache, `models.llama.apply`) put first: ``(k [B,P+S,K,D], v, visible [B,S,P+S])``."""
    if pending is None:
        return k, v, own
    block, seen = pending
    cast = lambda x, like: x.astype(like.dtype)  # noqa: E731
    return (jnp.concatenate([block.k[layer], cast(k, block.k[layer])], axis=1),
            jnp.concatenate([block.v[layer], cast(v, block.v[layer])], axis=1),
            jnp.concatenate([seen, own], axis=2))
