"""Llama forward through the KV cache vs a cache-free numpy reference; registry; tokenizer.

Compiles are the cost here (~2 s each on a busy 2-core CPU), so the tests share
shapes: batch 3, capacity 16, blocks of 8, 3 and 1 tokens.
"""

import dataclasses
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from specdec_jax.models import (
    ByteTokenizer,
    Llama,
    LlamaConfig,
    forward,
    known_models,
    load_model,
    param_shapes,
    random_llama,
)
from specdec_jax.models.llama import apply
from specdec_jax.models.rope import RopeScaling
from specdec_jax.target import FINAL_NORM

CFG = LlamaConfig(vocab_size=40, hidden_size=32, intermediate_size=64, num_layers=2,
                  num_heads=4, num_kv_heads=2, head_dim=8, rope_theta=10000.0)
B, T, S = 3, 16, 8
TOL = dict(rtol=1e-4, atol=1e-4)


@pytest.fixture(scope="module", autouse=True)
def full_precision_matmuls():
    """The 1e-4 tolerances assume true fp32 dots (GPUs/TPUs default to TF32/bf16 passes)."""
    with jax.default_matmul_precision("highest"):
        yield


@functools.cache
def jitted_apply(cfg: LlamaConfig):
    """One jitted forward per config, shared by all tests (compile once per shape)."""
    return jax.jit(functools.partial(forward, cfg), static_argnames="compute_logits")


def run(cfg, params, tokens, cache, **kw):
    return jitted_apply(cfg)(params, jnp.asarray(tokens, jnp.int32), cache, **kw)


def reference_logits(cfg: LlamaConfig, params, tokens) -> np.ndarray:
    """float64 numpy forward of one row ``tokens: [S]``, no cache, causal mask -> ``[S,V]``."""
    return reference_pass(cfg, params, tokens)[0]


def reference_pass(cfg: LlamaConfig, params, tokens) -> tuple[np.ndarray, dict]:
    """``(logits [S,V], hidden)`` of one row, float64 numpy, no cache, causal; ``hidden[l]`` is the
    residual stream ``[S,H]`` after layer ``l`` and ``hidden[-1]`` the final-norm output."""
    p = {name: np.asarray(a, np.float64) for name, a in params.items()}
    steps, dim = len(tokens), cfg.head_dim

    def norm(x, w):
        return w * x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + cfg.rms_norm_eps)

    inv_freq, gain = cfg.rope_theta ** -(np.arange(0, dim, 2) / dim), 1.0
    if cfg.rope_scaling is not None:  # the rope_freqs rule: divisors, cos and sin times the attention factor
        assert cfg.rope_scaling.rope_type == "rope_freqs"
        inv_freq, gain = inv_freq / np.asarray(cfg.rope_scaling.freq_factors), cfg.rope_scaling.attention_factor
    angles = np.arange(steps)[:, None] * inv_freq
    cos = gain * np.cos(np.concatenate([angles, angles], -1))[:, None, :]
    sin = gain * np.sin(np.concatenate([angles, angles], -1))[:, None, :]

    def rope(x):  # [S,heads,D], HF rotate_half
        return x * cos + np.concatenate([-x[..., dim // 2:], x[..., :dim // 2]], -1) * sin

    group = cfg.num_heads // cfg.num_kv_heads
    causal = np.tril(np.ones((steps, steps), bool))
    x = p["embed"][np.asarray(tokens)]
    hidden = {}
    for l in range(cfg.num_layers):
        h = norm(x, p["attn_norm"][l])
        q, k, v = h @ p["wq"][l].T, h @ p["wk"][l].T, h @ p["wv"][l].T
        if cfg.attention_bias:  # Qwen2
            q, k, v = q + p["bq"][l], k + p["bk"][l], v + p["bv"][l]
        q = q.reshape(steps, cfg.num_heads, dim)
        k = k.reshape(steps, cfg.num_kv_heads, dim)
        v = v.reshape(steps, cfg.num_kv_heads, dim)
        if cfg.qk_norm:  # Qwen3: RMSNorm over each head's dim, before RoPE
            q, k = norm(q, p["q_norm"][l]), norm(k, p["k_norm"][l])
        q, k = rope(q), rope(k)
        k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)  # GQA
        scores = np.einsum("snd,tnd->nst", q, k) / np.sqrt(dim)
        scores = np.where(causal, scores, -np.inf)
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        x = x + np.einsum("nst,tnd->snd", probs, v).reshape(steps, -1) @ p["wo"][l].T
        h = norm(x, p["mlp_norm"][l])
        gate = h @ p["w_gate"][l].T
        x = x + (gate / (1 + np.exp(-gate)) * (h @ p["w_up"][l].T)) @ p["w_down"][l].T
        hidden[l] = x
    head = (p["embed"] if cfg.tie_embeddings else p["lm_head"]).T
    hidden[-1] = norm(x, p["final_norm"])
    return hidden[-1] @ head, hidden


@pytest.fixture(scope="module")
def params():
    return random_llama(CFG, seed=0).params()


@pytest.fixture(scope="module")
def tokens():
    return np.random.default_rng(0).integers(0, CFG.vocab_size, (B, S))


@pytest.fixture(scope="module")
def full_logits(params, tokens):
    logits, cache = run(CFG, params, tokens, CFG.init_cache(B, T))
    np.testing.assert_array_equal(cache.lengths, 0)  # apply never commits
    return np.asarray(logits)


def test_one_pass_matches_cache_free_reference(params, tokens, full_logits):
    assert full_logits.shape == (B, S, CFG.vocab_size) and full_logits.dtype == np.float32
    for b in range(B):
        np.testing.assert_allclose(full_logits[b], reference_logits(CFG, params, tokens[b]), **TOL)


@pytest.mark.parametrize("rows", [(1, 1), (1, 5), (2, 4), (3, 3)])
def test_few_row_passes_match_the_reference(params, tokens, rows):
    """Few-row passes (a verify pass, a small batch) match the reference too."""
    batch, steps = rows
    logits, _ = run(CFG, params, tokens[:batch, :steps], CFG.init_cache(batch, T))
    for b in range(batch):
        np.testing.assert_allclose(logits[b], reference_logits(CFG, params, tokens[b, :steps]), **TOL)


def token_by_token(cfg, params, tokens) -> np.ndarray:
    """f32[B,S,V]: the logits of each position from one-token passes through the cache."""
    cache, steps = cfg.init_cache(B, T), []
    for s in range(S):
        logits, cache = run(cfg, params, tokens[:, s:s + 1], cache)
        steps.append(logits[:, 0])
        cache = cache.with_lengths(cache.lengths + 1)
    return np.stack(steps, axis=1)


def test_one_pass_matches_token_by_token(params, tokens, full_logits):
    np.testing.assert_allclose(token_by_token(CFG, params, tokens), full_logits, **TOL)


def assert_healthy_spread(logits):
    """Random models must give a clear argmax and a law far from uniform and one-hot."""
    std = np.asarray(logits).std(-1).mean()
    top = np.asarray(jax.nn.softmax(logits, -1)).max(-1).mean()
    assert 1.0 < std < 3.5, std
    assert 2.0 / logits.shape[-1] < top < 0.9, top


def test_logits_have_healthy_spread(full_logits):
    assert_healthy_spread(full_logits)


def prefilled(params, tokens, lengths):
    """Writes all of ``tokens`` (compute_logits=False), then commits only ``lengths``."""
    logits, cache = run(CFG, params, tokens, CFG.init_cache(B, T), compute_logits=False)
    assert logits is None
    return cache.with_lengths(np.asarray(lengths))


def test_ragged_rows_match_each_row_alone(params, tokens):
    # Slots beyond each row's length hold the rest of the prefill: stale, like
    # rejected drafts after a rollback.
    lengths = np.array([0, 2, 5])
    block = np.random.default_rng(1).integers(0, CFG.vocab_size, (B, 3))
    logits, cache = run(CFG, params, block, prefilled(params, tokens, lengths))
    np.testing.assert_array_equal(cache.lengths, lengths)
    for b, n in enumerate(lengths):
        row = np.concatenate([tokens[b, :n], block[b]])
        np.testing.assert_allclose(logits[b], reference_logits(CFG, params, row)[n:], **TOL)


def test_garbage_beyond_lengths_is_invisible(params, tokens):
    lengths = np.array([1, 4, 6])
    block = np.random.default_rng(2).integers(0, CFG.vocab_size, (B, 3))
    clean = prefilled(params, tokens, lengths)
    stale = np.arange(T)[None, None, :, None] >= lengths[:, None, None, None]  # [B,1,T,1], keys [B,K,T,D]
    rng = np.random.default_rng(3)
    noisy = lambda bufs, mask: tuple(  # noqa: E731
        jnp.where(mask, 1e3 * rng.standard_normal(b.shape).astype(np.float32), b) for b in bufs)
    dirty = clean.replace(k=noisy(clean.k, stale), v=noisy(clean.v, stale.swapaxes(2, 3)))  # values [B,K,D,T]
    want, _ = run(CFG, params, block, clean)
    got, _ = run(CFG, params, block, dirty)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)


def test_compute_logits_false_writes_the_same_cache(params, tokens):
    _, with_logits = run(CFG, params, tokens, CFG.init_cache(B, T))
    without = prefilled(params, tokens, np.zeros(B))
    for got, want in zip(without.stacked(), with_logits.stacked()):
        np.testing.assert_array_equal(got, want)


def test_tied_embeddings_use_embed_as_head(params, tokens):
    tied_cfg = dataclasses.replace(CFG, tie_embeddings=True)
    assert "lm_head" not in param_shapes(tied_cfg)
    tied = random_llama(tied_cfg, seed=4)
    call = nnx.jit(lambda model, tokens, cache: model(tokens, cache))
    logits, _ = call(tied, jnp.asarray(tokens), tied_cfg.init_cache(B, T))
    tied_params = tied.params()
    np.testing.assert_allclose(logits[0], reference_logits(tied_cfg, tied_params, tokens[0]), **TOL)
    # An untied model whose head is the embedding computes the same function.
    untied = {**tied_params, "lm_head": tied_params["embed"]}
    same, _ = run(CFG, untied, tokens, CFG.init_cache(B, T))
    np.testing.assert_allclose(same, logits, **TOL)
    other, _ = run(CFG, {**untied, "lm_head": params["lm_head"]}, tokens, CFG.init_cache(B, T))
    assert np.abs(np.asarray(other) - np.asarray(logits)).max() > 0.1


def test_rope_theta_changes_positions_but_not_position_zero(params, tokens, full_logits):
    cfg = dataclasses.replace(CFG, rope_theta=50.0)
    logits, _ = run(cfg, params, tokens, cfg.init_cache(B, T))
    np.testing.assert_allclose(logits[:, 0], full_logits[:, 0], **TOL)  # rotation by 0
    assert np.abs(np.asarray(logits[:, 2:]) - full_logits[:, 2:]).max() > 0.1
    np.testing.assert_allclose(logits[1], reference_logits(cfg, params, tokens[1]), **TOL)


def test_scaled_rope_reaches_every_position_and_the_config_stays_static(params, tokens, full_logits):
    """A `RopeScaling`'s frequencies and attention factor (here llama.cpp's rope_freqs divisors; each rule
    against transformers: tests/test_hf_families.py) match the reference in one pass and token by token
    through the cache; the config stays hashable and reads back from its JSON form."""
    scaling = RopeScaling("rope_freqs", freq_factors=(1.0, 3.0, 8.0, 0.5), attention_factor=1.2)
    cfg = dataclasses.replace(CFG, rope_scaling=scaling)
    logits, _ = run(cfg, params, tokens, cfg.init_cache(B, T))
    for b in range(B):
        np.testing.assert_allclose(logits[b], reference_logits(cfg, params, tokens[b]), **TOL)
    assert np.abs(np.asarray(logits) - full_logits).max() > 0.1
    np.testing.assert_allclose(token_by_token(cfg, params, tokens), logits, **TOL)
    again = LlamaConfig(**json.loads(json.dumps(dataclasses.asdict(cfg))))
    assert again == cfg and hash(again) == hash(cfg) and again.rope_scaling.freq_factors == scaling.freq_factors
    with pytest.raises(ValueError, match=r"rope_freqs has 3 factors, head_dim 8 needs 4"):
        dataclasses.replace(CFG, rope_scaling=RopeScaling("rope_freqs", freq_factors=(1.0, 2.0, 3.0)))
    with pytest.raises(ValueError, match=r"freq_factors \(positive\) are given exactly for rope_type 'rope_freqs'"):
        RopeScaling("linear", factor=2.0, freq_factors=(1.0, 2.0, 3.0, 4.0))


def test_traced_once_for_any_cache_lengths(params, tokens):
    traces = []

    def apply(params, tokens, cache):
        traces.append(None)
        return forward(CFG, params, tokens, cache)

    step = jax.jit(apply)
    cache = prefilled(params, tokens, np.zeros(B))
    for lengths in ([0, 0, 0], [3, 1, 7], [15, 2, 9]):
        step(params, jnp.asarray(tokens[:, :1], jnp.int32), cache.with_lengths(np.array(lengths)))
    assert len(traces) == 1


FAMILY_CFGS = {  # Qwen2's biased projections; Qwen3's q/k norms, with head_dim 12 where hidden / heads is 8
    "qwen2": dataclasses.replace(CFG, attention_bias=True, rope_theta=1e6, rms_norm_eps=1e-6),
    "qwen3": dataclasses.replace(CFG, qk_norm=True, head_dim=12, rope_theta=1e6, rms_norm_eps=1e-6),
}


def family_params(cfg: LlamaConfig) -> dict:
    """Random weights of ``cfg``; q/k norm weights drawn away from 1 (ones would hide a missing norm)."""
    arrays = random_llama(cfg, seed=1).arrays()
    rng = np.random.default_rng(2)
    for name in ("q_norm", "k_norm"):
        if name in arrays:
            arrays[name] = rng.uniform(0.5, 1.5, arrays[name].shape).astype(np.float32)
    return Llama.from_arrays(cfg, arrays).params()


@pytest.mark.parametrize("family", FAMILY_CFGS)
def test_each_family_matches_the_reference_in_one_pass_and_through_the_cache(family, tokens):
    cfg = FAMILY_CFGS[family]
    params = family_params(cfg)
    logits, _ = run(cfg, params, tokens, cfg.init_cache(B, T))
    for b in range(B):
        np.testing.assert_allclose(logits[b], reference_logits(cfg, params, tokens[b]), **TOL)
    cache, steps = cfg.init_cache(B, T), []
    for s in range(S):
        step, cache = run(cfg, params, tokens[:, s:s + 1], cache)
        steps.append(step[:, 0])
        cache = cache.with_lengths(cache.lengths + 1)
    np.testing.assert_allclose(np.stack(steps, 1), logits, **TOL)
    # The declared difference matters: the same weights without it give other logits.
    plain = dataclasses.replace(cfg, attention_bias=False, qk_norm=False)
    without, _ = run(plain, {k: v for k, v in params.items() if k in param_shapes(plain)}, tokens,
                     plain.init_cache(B, T))
    assert np.abs(np.asarray(without) - np.asarray(logits)).max() > 0.1


def test_config_validation():
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        dataclasses.replace(CFG, num_heads=4, num_kv_heads=3)
    with pytest.raises(ValueError, match="even"):
        dataclasses.replace(CFG, head_dim=7)
    with pytest.raises(ValueError, match="positive"):
        dataclasses.replace(CFG, num_layers=0)
    with pytest.raises(ValueError, match="dtype must be one of float32, bfloat16, got 'float16'"):
        dataclasses.replace(CFG, dtype="float16")
    assert hash(CFG) == hash(dataclasses.replace(CFG))


def test_from_arrays_round_trip_and_checks(params):
    arrays = {name: np.asarray(a) for name, a in params.items()}
    model = Llama.from_arrays(CFG, arrays)
    for name, array in model.arrays().items():
        np.testing.assert_array_equal(array, arrays[name])
    assert {k: v.shape for k, v in model.arrays().items()} == param_shapes(CFG)
    # Every layer weight is its own nnx.Param (its own buffer): no slicing in the decode loop.
    layer_params = nnx.state(model.layers, nnx.Param)
    assert len(jax.tree.leaves(layer_params)) == CFG.num_layers * 9
    with pytest.raises(ValueError, match="missing \\['wq'\\]"):
        Llama.from_arrays(CFG, {k: v for k, v in arrays.items() if k != "wq"})
    with pytest.raises(ValueError, match="wo: expected shape"):
        Llama.from_arrays(CFG, {**arrays, "wo": arrays["wo"][:, :, :-1]})
    with pytest.raises(ValueError, match="exactly one"):
        Llama(CFG, rngs=nnx.Rngs(0), arrays=arrays)


# --- registry and tokenizer ----------------------------------------------------


def test_registry_is_deterministic():
    first = load_model("tiny-random", seed=7)
    again, other = load_model("tiny-random", seed=7), load_model("tiny-random", seed=8)
    a, b, c = first.model.params(), again.model.params(), other.model.params()
    for name in a:
        np.testing.assert_array_equal(a[name], b[name])
    assert not np.array_equal(a["wq"], c["wq"])


def test_registry_models_share_the_byte_tokenizer():
    assert {"tiny-random", "tiny-random-draft"} <= set(known_models())
    model, config, tokenizer = load_model("tiny-random")
    draft = load_model("tiny-random-draft")
    assert isinstance(tokenizer, ByteTokenizer) and isinstance(draft.tokenizer, ByteTokenizer)
    assert config.vocab_size == draft.config.vocab_size == tokenizer.vocab_size
    assert config.num_kv_heads < config.num_heads  # GQA
    assert draft.config.num_layers < config.num_layers
    assert draft.config.hidden_size < config.hidden_size
    assert model.config == config


@pytest.mark.parametrize("name", ["tiny-random", "tiny-random-draft"])
def test_registry_models_have_healthy_spread(name):
    model, config, tokenizer = load_model(name)
    tokens = jnp.asarray([tokenizer.encode("speculative decoding")], jnp.int32)
    logits, _ = jax.jit(functools.partial(forward, config))(model.params(), tokens, config.init_cache(1, 32))
    assert_healthy_spread(logits)


def test_unknown_model_lists_known_names():
    with pytest.raises(ValueError, match="tiny-random-draft"):
        load_model("no-such-model")


def test_byte_tokenizer():
    tok = ByteTokenizer()
    ids = tok.encode("héllo")
    assert ids == list("héllo".encode()) and max(ids) < 256
    assert tok.encode("a", add_bos=True) == [tok.bos_id, 97]
    assert tok.decode([tok.bos_id, *ids, tok.eos_id]) == "héllo"
    assert tok.decode([0xFF]) == "\ufffd"
    assert (tok.bos_id, tok.eos_id, tok.vocab_size) == (256, 257, 258)


# ----------------------------------------------------------------------------
# The target pass with explicit positions, block masks and hidden states (specdec_jax.target)

PREFIX = 5  # committed tokens before the block
# A token tree of 6 nodes after t0 (node 0): parent of node i (docs/design.md section 10); depth = hops to node 0
TREE_PARENTS = [-1, 0, 0, 1, 1, 3]


def tree_mask_and_depth(parents):
    """(bool[N,N] ancestor-or-self mask, i32[N] depth) of a parent list (-1: the root)."""
    n = len(parents)
    mask, depth = np.zeros((n, n), bool), np.zeros(n, np.int32)
    for i in range(n):
        j = i
        while j >= 0:
            mask[i, j] = True
            j = parents[j]
        depth[i] = mask[i].sum() - 1
    return mask, depth


def path_to(parents, i):
    path = []
    while i >= 0:
        path.append(i)
        i = parents[i]
    return path[::-1]


def test_tree_block_matches_each_path_run_as_a_chain(params):
    """Nodes of a token tree, verified in one pass (positions = lengths + depth, ancestor-or-self
    mask), give the logits the numpy reference gives for prefix + that node's root path."""
    rng = np.random.default_rng(3)
    prefix = rng.integers(0, CFG.vocab_size, (B, PREFIX))
    nodes = rng.integers(0, CFG.vocab_size, (B, len(TREE_PARENTS)))
    mask, depth = tree_mask_and_depth(TREE_PARENTS)
    _, cache = run(CFG, params, prefix, CFG.init_cache(B, T), compute_logits=False)
    cache = cache.with_lengths(jnp.full((B,), PREFIX, jnp.int32))
    positions = PREFIX + np.broadcast_to(depth, nodes.shape)
    apply_fn = jax.jit(functools.partial(apply, CFG))
    logits, hidden, out = apply_fn(params, jnp.asarray(nodes, jnp.int32), cache, jnp.asarray(positions),
                                   jnp.asarray(np.broadcast_to(mask, (B,) + mask.shape)))
    assert hidden is None and np.asarray(out.lengths).tolist() == [PREFIX] * B
    for b in range(B):
        for i in range(len(TREE_PARENTS)):
            chain = np.concatenate([prefix[b], nodes[b, path_to(TREE_PARENTS, i)]])
            np.testing.assert_allclose(logits[b, i], reference_logits(CFG, params, chain)[-1], **TOL)


def test_a_causal_block_mask_equals_no_mask(params, tokens, full_logits):
    causal = jnp.asarray(np.broadcast_to(np.tril(np.ones((S, S), bool)), (B, S, S)))
    positions = jnp.broadcast_to(jnp.arange(S), (B, S))
    logits, _, _ = jax.jit(functools.partial(apply, CFG))(params, jnp.asarray(tokens), CFG.init_cache(B, T),
                                                          positions, causal)
    np.testing.assert_allclose(logits, full_logits, **TOL)


def test_hidden_layers_match_the_reference(params, tokens):
    """hidden_layers (0, last, FINAL_NORM) are the reference's residual streams and final norm, in that order."""
    layers = (0, CFG.num_layers - 1, FINAL_NORM)
    positions = jnp.broadcast_to(jnp.arange(S), (B, S))
    apply_fn = jax.jit(functools.partial(apply, CFG), static_argnames=("hidden_layers", "compute_logits"))
    logits, hidden, _ = apply_fn(params, jnp.asarray(tokens), CFG.init_cache(B, T), positions, None, layers)
    assert hidden.shape == (len(layers), B, S, CFG.hidden_size)
    _, prefill_hidden, _ = apply_fn(params, jnp.asarray(tokens), CFG.init_cache(B, T), positions, None, layers,
                                    compute_logits=False)
    np.testing.assert_array_equal(prefill_hidden, hidden)  # the LM head is not needed for features
    for b in range(B):
        _, expected = reference_pass(CFG, params, tokens[b])
        for index, layer in enumerate(layers):
            np.testing.assert_allclose(hidden[index, b], expected[layer], **TOL)
    with pytest.raises(ValueError, match="hidden layer 2"):
        apply(CFG, params, jnp.asarray(tokens), CFG.init_cache(B, T), positions, None, (CFG.num_layers,))


@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
def test_deferred_writes_match_the_reference_and_write_the_same_cache(params, tree):
    """A pass that only reads the cache (defer_writes, the engine's verify pass) gives the numpy
    reference's logits over ragged committed prefixes with stale slots, and its KVBlock written
    afterwards equals the cache a writing pass leaves."""
    rng = np.random.default_rng(5)
    prefix = rng.integers(0, CFG.vocab_size, (B, PREFIX))
    lengths = np.array([2, PREFIX, 5])
    cache = prefilled(params, prefix, np.zeros(B)).with_lengths(jnp.asarray(lengths, jnp.int32))  # stale past lengths
    nodes = rng.integers(0, CFG.vocab_size, (B, len(TREE_PARENTS)))
    mask, depth = tree_mask_and_depth(TREE_PARENTS) if tree else (np.tril(np.ones((len(TREE_PARENTS),) * 2, bool)),
                                                                 np.arange(len(TREE_PARENTS)))
    positions = jnp.asarray(lengths[:, None] + depth[None, :], jnp.int32)
    block_mask = jnp.asarray(np.broadcast_to(mask, (B,) + mask.shape)) if tree else None
    apply_fn = jax.jit(functools.partial(apply, CFG), static_argnames=("defer_writes",))
    want_logits, _, want_cache = apply_fn(params, jnp.asarray(nodes, jnp.int32), cache, positions, block_mask)
    logits, _, block = apply_fn(params, jnp.asarray(nodes, jnp.int32), cache, positions, block_mask, defer_writes=True)
    for b in range(B):
        for i in range(len(TREE_PARENTS)):
            path = path_to(TREE_PARENTS, i) if tree else list(range(i + 1))
            chain = np.concatenate([prefix[b, : lengths[b]], nodes[b, path]])
            np.testing.assert_allclose(logits[b, i], reference_logits(CFG, params, chain)[-1], **TOL)
    np.testing.assert_allclose(logits, want_logits, rtol=1e-5, atol=1e-5)
    for got, want in zip(cache.write_block(block).stacked(), want_cache.stacked()):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("family", FAMILY_CFGS)
def test_speculative_decoding_of_each_family_equals_plain_decoding(family):
    """The engine runs every family through the same target interface: greedy n-gram speculation
    (a tree too) emits exactly the plain greedy tokens of a Qwen2- or Qwen3-shaped target."""
    from specdec_jax.drafters import NgramDrafter
    from specdec_jax.engine import generate
    from specdec_jax.token_tree import TreeShape

    cfg = FAMILY_CFGS[family]
    target = Llama.from_arrays(cfg, {k: np.asarray(v) for k, v in family_params(cfg).items()})
    prompts = [[1, 2, 3, 1, 2, 3, 1, 2], [7, 8, 9, 10, 7, 8]]
    plain = generate(target, prompts, max_new_tokens=12).tokens
    chain = generate(target, prompts, NgramDrafter(min_n=1), gamma=3, max_new_tokens=12)
    tree = generate(target, prompts, NgramDrafter(tree=TreeShape(nodes=6, depth=3, topk=2)), max_new_tokens=12)
    assert chain.tokens == tree.tokens == plain and chain.metrics.accepted_tokens > 0


# ---------------------------------------------------------------- bfloat16 weights


@pytest.mark.parametrize("family", ["llama", *FAMILY_CFGS])
def test_bfloat16_weights_keep_logits_near_float32(family):
    """``astype("bfloat16")``: every floating weight and the KV cache in bfloat16, integer arrays kept,
    logits in float32 within bfloat16's rounding of the float32 model's (8 mantissa bits over 2 layers)."""
    cfg = dataclasses.replace(FAMILY_CFGS.get(family, CFG), output_vocab_size=32)  # a vocab_map too
    f32 = Llama.from_arrays(cfg, {k: np.asarray(v) for k, v in family_params(cfg).items()})
    bf16 = f32.astype("bfloat16")
    assert f32.astype("float32") is f32 and bf16.config == dataclasses.replace(cfg, dtype="bfloat16")
    arrays = bf16.arrays()
    assert {str(a.dtype) for k, a in arrays.items() if k != "vocab_map"} == {"bfloat16"}
    np.testing.assert_array_equal(arrays["vocab_map"], f32.arrays()["vocab_map"])
    tokens = jnp.asarray(np.random.default_rng(5).integers(0, cfg.vocab_size, (2, 12)))
    want, _ = forward(cfg, f32.params(), tokens, cfg.init_cache(2, 12))
    got, cache = forward(bf16.config, bf16.params(), tokens, bf16.config.init_cache(2, 12))
    assert got.dtype == jnp.float32 and cache.k[0].dtype == cache.v[0].dtype == jnp.bfloat16
    spread = float(jnp.std(want))
    assert 0 < float(jnp.max(jnp.abs(got - want))) < 0.1 * spread  # rounded, not broken


@pytest.mark.slow  # tests/test_bfloat16.py guards it by default, row by row
def test_bfloat16_speculation_equals_bfloat16_plain_decoding():
    """Greedy speculation (chain and tree) of a bfloat16 Qwen2-shaped target emits exactly its plain greedy
    tokens: verification is exact whatever the dtype."""
    from specdec_jax.drafters import NgramDrafter
    from specdec_jax.engine import generate
    from specdec_jax.token_tree import TreeShape

    cfg = FAMILY_CFGS["qwen2"]
    bf16 = Llama.from_arrays(cfg, {k: np.asarray(v) for k, v in family_params(cfg).items()}).astype("bfloat16")
    prompts = [[1, 2, 3, 1, 2, 3, 1, 2], [7, 8, 9, 10, 7, 8]]
    plain = generate(bf16, prompts, max_new_tokens=12).tokens
    chain = generate(bf16, prompts, NgramDrafter(min_n=1), gamma=3, max_new_tokens=12)
    tree = generate(bf16, prompts, NgramDrafter(tree=TreeShape(nodes=6, depth=3, topk=2)), max_new_tokens=12)
    assert chain.tokens == tree.tokens == plain and chain.metrics.accepted_tokens > 0


@pytest.mark.parametrize("shape, rows", [((1, 5, 24), 8), ((1, 7, 24), 8), ((1, 9, 24), 16), ((1, 15, 24), 16),
                                         ((1, 4, 24), 4), ((1, 8, 24), 8), ((1, 17, 24), 17), ((2, 5, 24), 5),
                                         ((1, 1, 6, 24), 8)])
def test_a_sequence_of_5_to_15_rows_is_multiplied_padded_on_cpu_and_each_row_is_its_own_product(shape, rows):
    from specdec_jax.models.layers import cpu_rows, linear

    assert cpu_rows(shape) == (rows if jax.default_backend() == "cpu" else shape[-2])
    rng = np.random.default_rng(0)
    x, w = rng.standard_normal(shape, np.float32), rng.standard_normal((40, shape[-1]), np.float32)
    got = jax.jit(linear)(jnp.asarray(x), jnp.asarray(w))
    assert got.shape == shape[:-1] + (40,)
    np.testing.assert_allclose(np.asarray(got), x @ w.T, rtol=1e-5, atol=1e-5)
