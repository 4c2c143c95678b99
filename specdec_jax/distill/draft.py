"""The draft's architecture and initial weights, and the distillation loss.

A draft shares the target's tokenizer and input vocabulary. Its output head may
cover only `draft_vocab` ids (`LlamaConfig.output_vocab_size`, the `vocab_map`
weight): on SmolLM2 the 49152 x 576 head is 113 MB, more than 4 draft layers.

`init: target` copies the target's embedding (kept frozen), final norm, the
head's rows of the kept ids, and its first `num_layers` layers. It needs the
target's widths.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from specdec_jax.distill.config import TrainConfig
from specdec_jax.models.llama import LlamaConfig, forward, init_params, layer_params

def random_weights(shapes: dict, seed: int, skip: tuple[str, ...] = ()) -> dict:
    """Random weights of ``shapes`` (name -> shape, or a nested dict of them), names in ``skip`` left out:
    norms 1, matrices ~ N(0, 1 / fan_in) with fan_in the last axis (the ``[out, in]`` layout)."""
    rng = np.random.default_rng(seed)

    def draw(table: dict) -> dict:
        return {name: draw(shape) if isinstance(shape, dict) else
                np.ones(shape, np.float32) if "norm" in name else
                (rng.standard_normal(shape) / np.sqrt(shape[-1])).astype(np.float32)
                for name, shape in table.items() if name not in skip}

    return draw(shapes)


WIDTH_KEYS = ("hidden_size", "intermediate_size", "num_heads", "num_kv_heads", "head_dim")


def draft_config(target: LlamaConfig, tc: TrainConfig) -> LlamaConfig:
    """The draft's LlamaConfig: tc's widths (None: the target's), untied head over draft_vocab ids."""
    widths = {k: getattr(tc, k) or getattr(target, k) for k in WIDTH_KEYS}
    if tc.init == "target" and any(widths[k] != getattr(target, k) for k in WIDTH_KEYS):
        raise ValueError("init 'target' copies the target's weights: leave the widths at the target's "
                         "(null), or use init 'random'")
    output = tc.draft_vocab if 0 < tc.draft_vocab < target.vocab_size else None
    return dataclasses.replace(target, num_layers=tc.num_layers, tie_embeddings=False, output_vocab_size=output,
                               **widths)


def copied_layers(target_layers: int, num_layers: int) -> list[int]:
    """Target layer indices copied into the draft: the first `num_layers` (an early exit of the
    target). SmolLM2's first and last layers instead started at a loss of 64 nats: its last
    layer expects the residual stream of layer 28, not of layer 0."""
    if num_layers > target_layers:
        raise ValueError(f"the target has {target_layers} layers: a draft of {num_layers} cannot copy them")
    return list(range(num_layers))


def init_draft(cfg: LlamaConfig, target_cfg: LlamaConfig, target_arrays: dict, tc: TrainConfig,
               vocab_map: np.ndarray | None) -> dict[str, np.ndarray]:
    """Initial draft weights (stacked layout of `param_shapes(cfg)`)."""
    arrays = init_params(cfg, jax.random.key(tc.seed))
    if vocab_map is not None:
        arrays["vocab_map"] = np.asarray(vocab_map, np.int32)
    if tc.init == "random":
        return arrays
    layers = copied_layers(target_cfg.num_layers, cfg.num_layers)
    arrays["embed"] = target_arrays["embed"]
    arrays["final_norm"] = target_arrays["final_norm"]
    head = target_arrays["embed"] if target_cfg.tie_embeddings else target_arrays["lm_head"]  # [V,H]
    arrays["lm_head"] = np.ascontiguousarray(head if vocab_map is None else head[vocab_map])
    for name in layer_params(cfg):
        arrays[name] = np.asarray(target_arrays[name])[layers]
    return arrays


def frozen_names(tc: TrainConfig) -> tuple[str, ...]:
    """Weights the optimizer leaves alone: the id map, and the embedding when copied from the target."""
    return ("vocab_map", "embed") if tc.init == "target" else ("vocab_map",)


def inverse_map(vocab_map: jax.Array | None, vocab_size: int) -> jax.Array:
    """i32[V]: the draft logit index of each target id, -1 outside the draft's vocabulary."""
    if vocab_map is None:
        return jnp.arange(vocab_size, dtype=jnp.int32)
    return jnp.full((vocab_size,), -1, jnp.int32).at[vocab_map].set(jnp.arange(vocab_map.shape[0], dtype=jnp.int32))


def top_k_ce(logits: jax.Array, vocab_map: jax.Array | None, top_ids: jax.Array, top_logp: jax.Array,
             vocab_size: int) -> tuple[jax.Array, jax.Array]:
    """``(cross-entropy f32[...], agreement f32[...])`` of drafter logits ``f32[..., Vo]`` against the
    target's top-k law (``top_ids i32[..., k]``, ``top_logp f32[..., k]``) renormalised over the
    ids the drafter can emit (same gradient as KL to that law); agreement is 1 where the
    drafter's argmax is the target's."""
    logq = jax.nn.log_softmax(logits, axis=-1)
    index = inverse_map(vocab_map, vocab_size)[top_ids]  # i32[..., k]
    p = jnp.where(index >= 0, jnp.exp(top_logp), 0.0)
    p = p / jnp.maximum(p.sum(-1, keepdims=True), 1e-9)
    ce = -jnp.sum(p * jnp.take_along_axis(logq, jnp.maximum(index, 0), axis=-1), axis=-1)
    argmax = jnp.argmax(logq, axis=-1)
    drafted = argmax if vocab_map is None else vocab_map[argmax]
    return ce, (drafted == top_ids[..., 0]).astype(jnp.float32)


def distill_loss(cfg: LlamaConfig, params: dict, batch: dict) -> tuple[jax.Array, dict]:
    """Cross-entropy of the draft against the target's top-k law (`top_k_ce`), averaged over answer
    positions.

    batch: tokens i32[B,S], top_ids i32[B,S,k], top_logp f32[B,S,k], weight f32[B,S].
    Returns (loss, {"loss", "agreement"}): agreement = share of weighted positions where the
    draft's argmax is the target's argmax (greedy acceptance of a draft given an accepted prefix).
    """
    tokens = batch["tokens"]
    logits, _ = forward(cfg, params, tokens, cfg.init_cache(tokens.shape[0], tokens.shape[1]))  # f32[B,S,Vo]
    ce, agree = top_k_ce(logits, params.get("vocab_map"), batch["top_ids"], batch["top_logp"], cfg.vocab_size)
    weight = batch["weight"]
    total = jnp.maximum(weight.sum(), 1.0)
    loss = jnp.sum(ce * weight) / total
    return loss, {"loss": loss, "agreement": jnp.sum(agree * weight) / total}
