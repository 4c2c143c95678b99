"""EAGLE-3 heads saved in vLLM speculators' ``eagle3`` format (read back by `drafters.published`).

A folder holds ``config.json`` (``speculators_model_type: eagle3``, ``transformer_layer_config``, the
head's decoder as a Hugging Face Llama config, ``draft_vocab_size``, ``eagle_aux_hidden_state_layer_ids``:
id k is the input of target layer k, our hidden layer k - 1, the ``speculators_config`` naming the
verifier) and ``model.safetensors`` with speculators' weight names (``[out, in]`` matrices)::

    embed_tokens.weight [V, H]   fc.weight [H, m*Ht]   layers.0.hidden_norm.weight [H]
    layers.{i}.{input_layernorm,self_attn.{q,k,v,o}_proj,post_attention_layernorm,mlp.*}.weight
    norm.weight [H]   lm_head.weight [Vd, H]   d2t i64[Vd], t2d bool[V] (Vd < V only)

``d2t`` holds offsets: draft id d is target id ``d + d2t[d]``; ``t2d`` marks the target ids kept.
The names, shapes and config keys are those speculators 0.9.0 writes
(tests/fixtures/speculators_eagle3_format.json, recorded by scripts/make_speculators_eagle3_format.py).
"""

from __future__ import annotations

import json
import pathlib

import numpy as np

from specdec_jax import interrupts
from specdec_jax.drafters.eagle3 import FLAGS, Eagle3Config
from specdec_jax.drafters.heads import HEAD_MARKER
from specdec_jax.files import write_text_atomic
from specdec_jax.models.loading import hf_layer_weights
from specdec_jax.target import FINAL_NORM

SPECULATORS_VERSION = "0.9.0"  # the format version written (speculators' own field)


def layer_ids(feature_layers: tuple[int, ...], num_layers: int) -> list[int]:
    """speculators' ``eagle_aux_hidden_state_layer_ids`` of our hidden layers (entry l: the input of layer l + 1)."""
    if any(not 0 <= layer < num_layers for layer in feature_layers) or FINAL_NORM in feature_layers:
        raise ValueError(f"speculators' format names target layer inputs: feature layers must be in [0, {num_layers}),"
                         f" got {list(feature_layers)}")
    return [layer + 1 for layer in feature_layers]


def layer_config(cfg: Eagle3Config) -> dict:
    """The head's decoder as the Hugging Face Llama config speculators nests (``transformer_layer_config``)."""
    layer = cfg.layer
    rope = {"rope_type": "default", "rope_theta": float(layer.rope_theta)}
    if layer.rope_scaling:
        rope = {**dict(layer.rope_scaling), "rope_theta": float(layer.rope_theta)}
    return {"model_type": "qwen3" if layer.qk_norm else "llama", "vocab_size": layer.vocab_size,
            "hidden_size": layer.hidden_size,
            "intermediate_size": layer.intermediate_size, "num_hidden_layers": layer.num_layers,
            "num_attention_heads": layer.num_heads, "num_key_value_heads": layer.num_kv_heads,
            "head_dim": layer.head_dim, "hidden_act": "silu", "rms_norm_eps": layer.rms_norm_eps,
            "max_position_embeddings": layer.max_positions or 2048, "attention_bias": layer.attention_bias,
            "mlp_bias": False, "tie_word_embeddings": False, "rope_parameters": rope, "attention_dropout": 0.0,
            "initializer_range": 0.02, "pretraining_tp": 1, "use_cache": True, "bos_token_id": None,
            "eos_token_id": None, "pad_token_id": None}


def speculators_config(cfg: Eagle3Config, num_target_layers: int, verifier: str, architectures: list[str],
                       speculative_tokens: int) -> dict:
    """config.json of a head (module docstring)."""
    return {"architectures": ["Eagle3DraftModel"], "speculators_model_type": "eagle3",
            "speculators_version": SPECULATORS_VERSION, "dtype": "float32",
            "transformer_layer_config": layer_config(cfg),
            "draft_vocab_size": cfg.output_vocab_size or cfg.layer.vocab_size,
            "eagle_aux_hidden_state_layer_ids": layer_ids(cfg.feature_layers, num_target_layers),
            **{flag: bool(getattr(cfg, flag)) for flag in FLAGS}, "embed_requires_grad": cfg.own_embedding,
            "target_hidden_size": None, "tie_word_embeddings": False,
            "speculators_config": {
                "algorithm": "eagle3", "default_proposal_method": "greedy",
                "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": speculative_tokens,
                                      "accept_tolerance": 0.0, "verifier_accept_k": 1}],
                "verifier": {"name_or_path": verifier, "architectures": architectures}}}


def speculators_weights(cfg: Eagle3Config, arrays: dict, embed: np.ndarray) -> dict[str, np.ndarray]:
    """speculators' state dict (module docstring) of a head's arrays (`drafters.eagle3` names) and the
    embedding ``embed f32[V, H]`` it reads (the target's unless it has its own)."""
    layer = cfg.layer
    names = hf_layer_weights(layer)
    weights = {f"layers.0.{theirs}": arrays[ours][0] for ours, theirs in names.items()}
    for i in range(1, layer.num_layers):
        weights.update({f"layers.{i}.{theirs}": arrays["rest"][ours][i - 1] for ours, theirs in names.items()})
    weights.update({"embed_tokens.weight": arrays.get("embed", embed), "fc.weight": arrays["fc"],
                    "layers.0.hidden_norm.weight": arrays["hidden_norm"], "norm.weight": arrays["norm"],
                    "lm_head.weight": arrays["lm_head"]})
    if cfg.norm_before_fc:
        weights["input_norm.weight"] = arrays["input_norm"]
    if cfg.fc_norm:
        weights.update({f"fc_norm.{i}.weight": row for i, row in enumerate(arrays["fc_norm"])})
    weights = {name: np.ascontiguousarray(np.asarray(w, np.float32)) for name, w in weights.items()}
    if cfg.output_vocab_size is not None:
        ids = np.asarray(arrays["vocab_map"], np.int64)
        weights["d2t"] = ids - np.arange(len(ids))
        t2d = np.zeros(layer.vocab_size, bool)
        t2d[ids] = True
        weights["t2d"] = t2d
    return weights


def save_eagle3(folder: str | pathlib.Path, cfg: Eagle3Config, arrays: dict, embed: np.ndarray, config: dict,
                ) -> pathlib.Path:
    """Writes a speculators folder: ``config`` (`speculators_config`) and the weights; returns its path.
    config.json is written last, so a folder cut short is not taken for a head."""
    from safetensors.numpy import save_file

    folder = pathlib.Path(folder).resolve()
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").unlink(missing_ok=True)
    (folder / HEAD_MARKER).unlink(missing_ok=True)  # an EAGLE-1 head trained into the same folder before
    with interrupts.deferred():
        save_file(speculators_weights(cfg, arrays, embed), str(folder / "model.safetensors"),
                  metadata={"format": "pt"})
    write_text_atomic(folder / "config.json", json.dumps(config, indent=2))
    return folder
