"""KV-head replication (specdec_jax.sharding.replicate_kv_heads): a model whose KV heads are
repeated gives the logits of the original, with a KV cache of K*r heads; the model-axis checks
name what would work. One process, one device (meshes here are abstract: only their sizes are read)."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AbstractMesh

from specdec_jax import sharding
from specdec_jax.models import ByteTokenizer, LlamaConfig, forward, random_llama
from specdec_jax.models.loaded import LoadedModel
from specdec_jax.models.registry import TINY_RANDOM

SMALL = LlamaConfig(vocab_size=ByteTokenizer.vocab_size, hidden_size=32, intermediate_size=64, num_layers=2,
                    num_heads=8, num_kv_heads=2, head_dim=8)
TOKENS = np.array([[5, 17, 250, 3, 99], [1, 2, 3, 4, 5]], np.int32)  # i32[B=2,S=5], then one step each


def loaded(config: LlamaConfig, seed: int = 3) -> LoadedModel:
    return LoadedModel(random_llama(config, seed), config, ByteTokenizer())


@functools.cache
def jitted_forward(config: LlamaConfig):
    return jax.jit(functools.partial(forward, config))


def prefill_then_step(model: LoadedModel):
    """``(logits f32[2,6,V], cache)``: the 5-token block, then one more token per row, through the cache."""
    step = jitted_forward(model.config)
    params = model.model.params()
    logits, cache = step(params, jnp.asarray(TOKENS), model.config.init_cache(2, 16))
    more, cache = step(params, jnp.asarray(TOKENS[:, -1:]), cache)
    return np.concatenate([np.asarray(logits), np.asarray(more)], axis=1), cache


@pytest.mark.parametrize("config, factor", [
    (TINY_RANDOM, 2),  # 4 query heads, 2 KV heads -> 4
    (dataclasses.replace(SMALL, attention_bias=True), 4),  # Qwen2's k/v biases repeated too: 2 -> 8
    (dataclasses.replace(SMALL, qk_norm=True), 2),  # Qwen3's k_norm is per head_dim: unchanged
], ids=["tiny-random", "attention-bias", "qk-norm"])
def test_replicated_kv_heads_give_the_same_logits(config, factor):
    original = loaded(config)
    replicated = sharding.replicate_kv_heads(original, factor)
    heads = config.num_kv_heads * factor
    assert replicated.config == replicated.model.config == dataclasses.replace(config, num_kv_heads=heads)
    assert original.config.num_kv_heads == config.num_kv_heads  # the original is untouched
    with jax.default_matmul_precision("highest"):
        want, want_cache = prefill_then_step(original)
        got, got_cache = prefill_then_step(replicated)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert (got.argmax(-1) == want.argmax(-1)).all()
    for layer in range(config.num_layers):
        k, v = np.asarray(got_cache.k[layer]), np.asarray(got_cache.v[layer])
        assert k.shape[1] == v.shape[1] == heads  # k [B,K*r,T,D], v [B,K*r,D,T]
        np.testing.assert_allclose(k, np.repeat(np.asarray(want_cache.k[layer]), factor, axis=1), atol=1e-5)
        np.testing.assert_allclose(v, np.repeat(np.asarray(want_cache.v[layer]), factor, axis=1), atol=1e-5)


def test_factor_one_is_the_model_itself_and_a_factor_must_fit_the_query_heads():
    original = loaded(TINY_RANDOM)
    assert sharding.replicate_kv_heads(original, 1) is original
    with pytest.raises(ValueError, match="cannot repeat 2 KV heads 4 times: 8 heads do not divide num_heads 4"):
        sharding.replicate_kv_heads(original, 4)


@pytest.mark.parametrize("size, kv_heads, factor", [(1, 2, 1), (2, 2, 1), (4, 2, 2), (8, 2, 4), (8, 1, 8),
                                                    (2, 4, 1), (6, 4, 3)])
def test_kv_replication_is_lcm_over_kv_heads(size, kv_heads, factor):
    assert sharding.kv_replication(size, kv_heads) == factor


def model_axis(size: int) -> AbstractMesh:
    return AbstractMesh((1, size), sharding.AXES)


def test_a_model_axis_beyond_the_kv_heads_needs_replication():
    with pytest.raises(ValueError) as err:
        sharding.check_model_axis(model_axis(4), TINY_RANDOM, "the target")
    assert str(err.value).startswith(
        "mesh axis model=4 does not divide num_kv_heads = 2 of the target (num_heads 4, num_kv_heads 2, "
        "intermediate_size 256): replicate its KV heads to 4 first, as sharding.place_model does")
    sharding.check_model_axis(model_axis(4), dataclasses.replace(TINY_RANDOM, num_kv_heads=4), "the target")


@pytest.mark.parametrize("size, name, sizes", [(3, "num_heads = 4", "1, 2, 4"), (8, "num_heads = 4", "1, 2, 4")])
def test_a_model_axis_that_no_replication_helps_names_the_sizes_that_work(size, name, sizes):
    """place_model refuses before it copies or places anything (the mesh here has no devices)."""
    with pytest.raises(ValueError) as err:
        sharding.place_model(loaded(TINY_RANDOM), model_axis(size), "the target")
    assert str(err.value).startswith(f"mesh axis model={size} does not divide {name} of the target ")
    assert f"model must divide num_heads and intermediate_size ({sizes})" in str(err.value)
