"""Every random draw of a generation, keyed by what it decides (docs/design.md section 6).

A draw's key is a function of four things only:

    fold_in(fold_in(fold_in(fold_in(key(seed), row id), position), purpose), ...)

- the seed of the `generate` call;
- the row id (`generate(row_ids=...)`, default the row's index), so a row's
  output does not depend on which other rows share its batch;
- the absolute position, in the row's sequence (prompt included, 0-based), of
  the token the draw decides: the proposal of the draft at that position, the
  accept-uniform of that draft, or the correction/bonus emitted there;
- a purpose tag from `Purpose`, so draws for different uses never share bits.

Nothing is ever `split` over the batch: a key never depends on the batch size.
A draw that needs several random numbers at one (row, position, purpose) folds
in a small sub-index (e.g. a child index of a tree node) after the tag.
"""

from __future__ import annotations

import enum

import jax
import jax.numpy as jnp


class Purpose(enum.IntEnum):
    """Fold-in tags, one per use of randomness (the only place tags are defined)."""

    DRAFT = 0  # a drafter's sample of its proposal
    ACCEPT = 1  # the uniform u of the accept test u < p / q
    RESIDUAL = 2  # the correction (residual law) or bonus draw of the target
    CORRUPT_KEEP = 3  # oracle drafter: keep the target's token or corrupt it
    CORRUPT_TOKEN = 4  # oracle drafter: the wrong token it substitutes


def position_keys(seed_key: jax.Array, row_ids: jax.Array, positions: jax.Array) -> jax.Array:
    """key[B,S]: the key of row ``row_ids[b]`` at absolute position ``positions[b, s]``.

    ``seed_key`` is one typed key (``jax.random.key(seed)``); ``row_ids`` i32[B];
    ``positions`` i32[B,S]. Fold in a `Purpose` with :func:`for_purpose` before drawing.
    """
    def row(row_id, row_positions):
        row_key = jax.random.fold_in(seed_key, row_id)
        return jax.vmap(lambda p: jax.random.fold_in(row_key, p))(row_positions)

    return jax.vmap(row)(jnp.asarray(row_ids, jnp.int32), jnp.asarray(positions, jnp.int32))


def for_purpose(keys: jax.Array, purpose: Purpose) -> jax.Array:
    """``keys`` (any shape) with the purpose tag folded in."""
    flat = keys.reshape(-1)
    return jax.vmap(lambda k: jax.random.fold_in(k, int(purpose)))(flat).reshape(keys.shape)


def accept_uniforms(keys: jax.Array) -> jax.Array:
    """f32 of ``keys``' shape: one uniform draw in [tiny, 1) per key (``keys`` already tagged
    `Purpose.ACCEPT`). Never 0, so the accept test ``u * q < p`` never accepts a token of p = 0."""
    tiny = jnp.finfo(jnp.float32).tiny
    flat = keys.reshape(-1)
    return jax.vmap(lambda k: jax.random.uniform(k, minval=tiny, maxval=1.0))(flat).reshape(keys.shape)


def check_keys(keys: jax.Array, shape: tuple[int, ...], what: str = "keys") -> jax.Array:
    """ValueError unless ``keys`` is an array of typed PRNG keys of ``shape``."""
    if not isinstance(keys, jax.Array) or not jnp.issubdtype(keys.dtype, jax.dtypes.prng_key):
        raise ValueError(f"{what} must be typed PRNG keys (jax.random.key), not raw uint32 keys")
    if keys.shape != shape:
        raise ValueError(f"{what} must have shape {shape}, got {keys.shape}")
    return keys


def with_sub_index(keys: jax.Array, index: jax.Array) -> jax.Array:
    """``keys`` with ``index`` (same shape, >= 0) folded in where it is > 0: sub-draw 0 of a
    (row, position, purpose) uses the key itself, so a tree's first child draws what a chain's
    draft at that position would."""
    flat, idx = keys.reshape(-1), jnp.asarray(index, jnp.int32).reshape(-1)
    folded = jax.vmap(jax.random.fold_in)(flat, idx)
    data = jnp.where((idx > 0)[:, None], jax.random.key_data(folded), jax.random.key_data(flat))
    return jax.random.wrap_key_data(data, impl=jax.random.key_impl(flat)).reshape(keys.shape)


SEED_LIMIT = 2**64  # seeds are 64-bit: [0, 2**64)


def seed_key(seed: int) -> jax.Array:
    """The typed key of a run's seed, any int in [0, 2**64) (else a ValueError): ``jax.random.key(seed)``
    below 2**32, above it the key of its low 32 bits folded with its high 32, so that 2**32 is not 0
    (``jax.random.key`` keeps only the low 32 bits without x64)."""
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < SEED_LIMIT:
        raise ValueError(f"seed must be an int in [0, 2**64), got {seed!r}")
    low, high = seed & 0xFFFFFFFF, seed >> 32
    key = jax.random.key(low)
    return key if high == 0 else jax.random.fold_in(key, high)
