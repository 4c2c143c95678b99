"""Tiny decoders of each Hugging Face family, with weights regenerated from a fixed seed (never committed).

Shared by ``scripts/make_hf_family_reference.py``, which runs them through transformers and
records the logits in ``tests/fixtures/hf_families.json`` (and ``hf_rope.json``), and
``tests/test_hf_families.py``, which runs the same weights through this project's loader and decoder.
Neither imports torch here.

``FAMILIES`` holds, per ``model_type``, the keyword arguments of transformers' config class
(``AutoConfig.for_model(model_type, **kwargs)``), ``ROPE_VARIANTS`` those of Llamas with RoPE
scaling; ``state_dict(config)`` draws every weight of a config dict (the fixture records
transformers' own ``config.to_dict()``) with numpy, named and
shaped as Hugging Face's state dict, float32 values: ``V`` vocab, ``H`` hidden, ``I`` MLP width,
``N`` / ``K`` query / kv heads of size ``D``::

    model.embed_tokens.weight                   [V, H]    N(0, (2 / sqrt(H))^2): logits of std ~2
    model.layers.{i}.input_layernorm.weight     [H]       1 + 0.1 N(0, 1) (every norm: not ones)
    model.layers.{i}.self_attn.q_proj.weight    [N*D, H]  N(0, 1 / H) (every projection: 1 / fan_in)
    model.layers.{i}.self_attn.k_proj.weight    [K*D, H]
    model.layers.{i}.self_attn.v_proj.weight    [K*D, H]
    model.layers.{i}.self_attn.o_proj.weight    [H, N*D]
    model.layers.{i}.self_attn.{q,k,v}_proj.bias [N*D] / [K*D]  0.5 N(0, 1)   (qwen2, or attention_bias)
    model.layers.{i}.self_attn.{q,k}_norm.weight [D]       1 + 0.2 N(0, 1)   (qwen3)
    model.layers.{i}.post_attention_layernorm.weight [H]
    model.layers.{i}.mlp.{gate,up}_proj.weight  [I, H]
    model.layers.{i}.mlp.down_proj.weight       [H, I]
    model.norm.weight                           [H]
    lm_head.weight                              [V, H]    N(0, (2 / sqrt(H))^2), absent when tied
"""

from __future__ import annotations

import hashlib
import math
import zlib

import numpy as np

SEED = 20261203
COMMON = dict(vocab_size=258, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16, hidden_act="silu")
FAMILIES = {  # model_type -> transformers config kwargs (rms_norm_eps: each class's default)
    "llama": dict(COMMON, rope_theta=10000.0, tie_word_embeddings=False),
    "mistral": dict(COMMON, rope_theta=1e6, tie_word_embeddings=False, sliding_window=None),
    "qwen2": dict(COMMON, rope_theta=1e6, tie_word_embeddings=True),  # q/k/v biases: the architecture's
    # head_dim 24 != hidden / heads (16): Qwen3 allows it
    "qwen3": dict(COMMON, head_dim=24, rope_theta=1e6, tie_word_embeddings=True, attention_bias=False),
}
SEQUENCES = 2  # token sequences per family
LENGTH = 12  # tokens per sequence

# RoPE scalings of a Llama (the weights of FAMILIES["llama"]): name -> transformers config kwargs.
# Their original contexts (32 or 64 positions; wavelengths 2 pi * 10000^(2i/16) = 6.3, 20, 63, 199, ...)
# put each type's bands inside the head: kept, blended and scaled pairs (yarn_options' betas put both
# ends of yarn's ramp strictly inside, so that each of its options moves the logits). The
# `rope_scaling` dicts are spelled as config.json files of Llama 3.1 / 3.2 and older ones spell them
# (``rope_type`` or the older ``type``).
ROPE_COMMON = dict(COMMON, rope_theta=10000.0)
ROPE_VARIANTS = {
    "llama3": dict(ROPE_COMMON, tie_word_embeddings=False, max_position_embeddings=512, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64}),
    "llama3_tied": dict(ROPE_COMMON, tie_word_embeddings=True, max_position_embeddings=1024, rope_scaling={
        "rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32}),
    "linear": dict(ROPE_COMMON, tie_word_embeddings=False, max_position_embeddings=256,
                   rope_scaling={"type": "linear", "factor": 4.0}),
    "yarn_tied": dict(ROPE_COMMON, tie_word_embeddings=True, max_position_embeddings=256, rope_scaling={
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}),
    "yarn_options": dict(ROPE_COMMON, tie_word_embeddings=False, max_position_embeddings=128, rope_scaling={
        "type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, "beta_fast": 4.0, "beta_slow": 0.5,
        "mscale": 1.0, "mscale_all_dim": 0.5, "truncate": False}),
}
ROPE_PROMPT = 16  # prompt tokens of each RoPE sequence
ROPE_NEW_TOKENS = 24  # greedy tokens after it: positions up to 39


def sequences(vocab_size: int, length: int = LENGTH, stream: int = 1) -> np.ndarray:
    """``i32[SEQUENCES, length]`` token ids in ``[0, vocab_size)``, fixed by ``SEED`` and ``stream``."""
    return np.random.default_rng([SEED, stream]).integers(0, vocab_size, (SEQUENCES, length)).astype(np.int32)


def rope_prompts(vocab_size: int) -> np.ndarray:
    """``i32[SEQUENCES, ROPE_PROMPT]``: the prompts of the RoPE scaling fixture (a stream whose greedy steps
    all have a top-2 margin above the script's ``MIN_MARGIN``, for every variant)."""
    return sequences(vocab_size, ROPE_PROMPT, stream=6)


def _has_bias(config: dict) -> bool:
    return config["model_type"] == "qwen2" or bool(config.get("attention_bias"))


def state_dict(config: dict) -> dict[str, np.ndarray]:
    """Hugging Face name -> float32 weight (shapes in the module docstring) of the config dict
    ``config``; deterministic in ``SEED`` and ``config["model_type"]``."""
    rng = np.random.default_rng([SEED, zlib.crc32(config["model_type"].encode())])
    V, H, I = config["vocab_size"], config["hidden_size"], config["intermediate_size"]
    N, K = config["num_attention_heads"], config["num_key_value_heads"]
    D = config.get("head_dim") or H // N

    def normal(std: float, *shape: int) -> np.ndarray:
        return (std * rng.standard_normal(shape)).astype(np.float32)

    def norm(spread: float, size: int) -> np.ndarray:
        return (1.0 + spread * rng.standard_normal(size)).astype(np.float32)

    weights = {"model.embed_tokens.weight": normal(2.0 / math.sqrt(H), V, H)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        weights[p + "input_layernorm.weight"] = norm(0.1, H)
        for name, out, fan_in in (("q", N * D, H), ("k", K * D, H), ("v", K * D, H), ("o", H, N * D)):
            weights[p + f"self_attn.{name}_proj.weight"] = normal(1.0 / math.sqrt(fan_in), out, fan_in)
        if _has_bias(config):
            for name, out in (("q", N * D), ("k", K * D), ("v", K * D)):
                weights[p + f"self_attn.{name}_proj.bias"] = normal(0.5, out)
        if config["model_type"] == "qwen3":
            weights[p + "self_attn.q_norm.weight"] = norm(0.2, D)
            weights[p + "self_attn.k_norm.weight"] = norm(0.2, D)
        weights[p + "post_attention_layernorm.weight"] = norm(0.1, H)
        weights[p + "mlp.gate_proj.weight"] = normal(1.0 / math.sqrt(H), I, H)
        weights[p + "mlp.up_proj.weight"] = normal(1.0 / math.sqrt(H), I, H)
        weights[p + "mlp.down_proj.weight"] = normal(1.0 / math.sqrt(I), H, I)
    weights["model.norm.weight"] = norm(0.1, H)
    if not config.get("tie_word_embeddings", False):
        weights["lm_head.weight"] = normal(2.0 / math.sqrt(H), V, H)
    return weights


def checksum(weights: dict[str, np.ndarray]) -> str:
    """sha256 over the names, shapes and float32 bytes of ``weights`` (sorted by name): the fixture
    records it, so a changed generator (or numpy stream) is caught before the logits are compared."""
    digest = hashlib.sha256()
    for name in sorted(weights):
        array = np.ascontiguousarray(weights[name], np.float32)
        digest.update(f"{name}{array.shape}".encode())
        digest.update(array.tobytes())
    return digest.hexdigest()
