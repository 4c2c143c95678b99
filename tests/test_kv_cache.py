"""KVCache: writes land at lengths + s, never past T, and lengths alone commit."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specdec_jax.kv_cache import KVCache

L, B, T, HKV, D, S = 2, 3, 8, 2, 4, 4


def filled_cache(lengths) -> KVCache:
    """A cache whose every slot holds a distinct value (so any overwrite shows)."""
    k = jnp.arange(L * B * T * HKV * D, dtype=jnp.float32).reshape(L, B, HKV, T, D)
    return KVCache(k=tuple(k), v=tuple(-k.swapaxes(3, 4)), lengths=jnp.asarray(lengths, jnp.int32))


def reference_write(cache: KVCache, layer: int, new_k: np.ndarray, new_v: np.ndarray):
    """Slot-by-slot numpy write: slot lengths[b] + s when it is < T, else nothing."""
    k, v = (np.array(a) for a in cache.stacked())
    for b, n in enumerate(np.asarray(cache.lengths)):
        for s in range(new_k.shape[1]):
            if n + s < T:
                k[layer, b, n + s], v[layer, b, n + s] = new_k[b, s], new_v[b, s]
    return k, v


write = jax.jit(KVCache.write, static_argnums=1)


class Stacked:
    """A cache's keys, values and lengths as ``[L,B,T,Hkv,D]`` numpy arrays."""

    def __init__(self, cache: KVCache):
        self.k, self.v = (np.asarray(a) for a in cache.stacked())
        self.lengths = np.asarray(cache.lengths)


def new_block(seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return (1000 + rng.standard_normal((B, S, HKV, D)).astype(np.float32),
            -1000 + rng.standard_normal((B, S, HKV, D)).astype(np.float32))


def test_init_shapes_and_capacity():
    cache = KVCache.init(L, B, T, HKV, D, dtype=jnp.bfloat16)
    assert len(cache.k) == len(cache.v) == L
    assert {a.shape for a in cache.k} == {(B, HKV, T, D)} and {a.shape for a in cache.v} == {(B, HKV, D, T)}
    assert all(a.dtype == jnp.bfloat16 for a in cache.k + cache.v)
    assert cache.stacked()[0].shape == (L, B, T, HKV, D)
    assert cache.lengths.dtype == jnp.int32 and cache.lengths.shape == (B,)
    assert not np.any(np.asarray(cache.lengths))
    assert cache.capacity == T


def test_write_lands_at_lengths_plus_s():
    cache = filled_cache([0, 3, 1])
    new_k, new_v = new_block()
    out = Stacked(write(cache, 1, new_k, new_v))
    cache = Stacked(cache)
    np.testing.assert_array_equal(out.k[1, 0, 0:S], new_k[0])
    np.testing.assert_array_equal(out.k[1, 1, 3:3 + S], new_k[1])
    np.testing.assert_array_equal(out.v[1, 2, 1:1 + S], new_v[2])
    np.testing.assert_array_equal(out.k[0], cache.k[0])  # other layer untouched
    np.testing.assert_array_equal(out.k[1, 1, :3], cache.k[1, 1, :3])  # committed kept
    np.testing.assert_array_equal(out.lengths, cache.lengths)  # write does not commit


def test_write_past_capacity_is_dropped_not_clamped():
    # Row 0 fits exactly, row 1 overflows by 2 slots, row 2 starts at T (all dropped).
    cache = filled_cache([T - S, T - S + 2, T])
    new_k, new_v = new_block()
    out = Stacked(write(cache, 0, new_k, new_v))
    cache = Stacked(cache)
    np.testing.assert_array_equal(out.k[0, 0, T - S:], new_k[0])
    np.testing.assert_array_equal(out.k[0, 1, T - 2:], new_k[1, :2])
    # Nothing below the row's start moved (a clamped write would shift left onto it).
    np.testing.assert_array_equal(out.k[0, 1, :T - 2], cache.k[0, 1, :T - 2])
    np.testing.assert_array_equal(out.v[0, 1, :T - 2], cache.v[0, 1, :T - 2])
    np.testing.assert_array_equal(out.k[0, 2], cache.k[0, 2])


@settings(max_examples=30, deadline=None)
@given(lengths=st.lists(st.integers(0, T + 2), min_size=B, max_size=B),
       layer=st.integers(0, L - 1), seed=st.integers(0, 2**16))
def test_write_matches_slotwise_reference(lengths, layer, seed):
    cache = filled_cache(lengths)
    new_k, new_v = new_block(seed)
    out = Stacked(write(cache, layer, new_k, new_v))
    want_k, want_v = reference_write(cache, layer, new_k, new_v)
    np.testing.assert_array_equal(out.k, want_k)
    np.testing.assert_array_equal(out.v, want_v)


def test_with_lengths_keeps_buffers():
    cache = filled_cache([1, 2, 3])
    rolled = cache.with_lengths(np.array([0, 2, 1]))
    assert rolled.k is cache.k and rolled.v is cache.v
    assert rolled.lengths.dtype == jnp.int32
    np.testing.assert_array_equal(rolled.lengths, [0, 2, 1])
    np.testing.assert_array_equal(cache.lengths, [1, 2, 3])  # frozen: original intact


def test_is_a_pytree():
    cache = filled_cache([1, 2, 3])
    leaves = jax.tree.leaves(cache)
    assert len(leaves) == 2 * L + 1
    doubled = jax.tree.map(lambda x: x * 2, cache)
    np.testing.assert_array_equal(doubled.lengths, [2, 4, 6])
    with pytest.raises(Exception):
        cache.lengths = jnp.zeros(B, jnp.int32)  # frozen dataclass
