"""The EAGLE-3 head `train-draft --kind eagle --eagle-version 3` trains (`drafters.eagle3`), and its export
in speculators' format (`drafters.speculators_format`), which vLLM serves and `--drafter eagle` loads.

The head reads m target hidden states (by default the published three: the inputs of target layers
2, L // 2 and L - 3, i.e. our hidden layers 1, L // 2 - 1, L - 4, duplicates of a shallow target
dropped), projects their concatenation with ``fc``, and has one decoder layer attending over
``concat(input_layernorm(embed), hidden_norm(x))``, a final norm and an LM head over the draft
vocabulary (``vocab_map``, saved as ``d2t``) or the whole vocabulary. Its loss and training-time
test are `distill.kinds.EagleKind`'s, through the head's `HeadFunctions`.
"""

from __future__ import annotations

import numpy as np

from specdec_jax.distill.draft import random_weights
from specdec_jax.drafters.eagle3 import Eagle3Config, eagle3_shapes
from specdec_jax.drafters.speculators_format import save_eagle3, speculators_config
from specdec_jax.models.llama import LlamaConfig
from specdec_jax.target import FINAL_NORM


def eagle3_layers(feature_layers: tuple[int, ...], num_layers: int) -> tuple[int, ...]:
    """Our hidden layers of the head's features: ``feature_layers`` as given, or for the default
    ``(-1,)`` the published ``[2, L // 2, L - 3]`` (inputs of those layers, speculators' ids) as ours."""
    if tuple(feature_layers) != (FINAL_NORM,):
        return tuple(feature_layers)
    ids = (2, num_layers // 2, num_layers - 3)
    return tuple(dict.fromkeys(min(max(k - 1, 0), num_layers - 1) for k in ids))


def eagle3_config(target_config: LlamaConfig, feature_layers: tuple[int, ...], widths: dict,
                  output_vocab_size: int | None) -> Eagle3Config:
    """A one-layer head at the target's width, RoPE and norm epsilon; ``widths``: intermediate_size,
    num_heads, num_kv_heads, head_dim."""
    cfg = target_config
    layer = LlamaConfig(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, num_layers=1,
                        rope_theta=cfg.rope_theta, rms_norm_eps=cfg.rms_norm_eps, rope_scaling=cfg.rope_scaling,
                        max_positions=cfg.max_positions, **widths)
    return Eagle3Config(layer, eagle3_layers(feature_layers, cfg.num_layers), cfg.hidden_size, output_vocab_size)


def init_eagle3(cfg: Eagle3Config, seed: int, head_rows: np.ndarray, vocab_map: np.ndarray | None) -> dict:
    """Random weights (norms 1, matrices ~ N(0, 1/fan_in)); ``lm_head [Vo, H]`` copies the target's LM head
    ``head_rows f32[H, V]`` at ``vocab_map`` (all rows without one)."""
    arrays = random_weights(eagle3_shapes(cfg), seed, skip=("vocab_map", "lm_head"))
    rows = np.asarray(head_rows, np.float32).T
    if cfg.output_vocab_size is not None:
        if vocab_map is None:
            raise ValueError("a reduced output vocabulary needs the vocab_map")
        arrays["vocab_map"] = np.asarray(vocab_map, np.int32)
        rows = rows[arrays["vocab_map"]]
    arrays["lm_head"] = np.ascontiguousarray(rows)
    return arrays


def export_eagle3(folder, cfg: Eagle3Config, params: dict, target_info: dict, info: dict, drafts: int):
    """Saves the trained head in speculators' format (`drafters.speculators_format`); returns the folder.
    ``params``: the head's arrays and ``target`` (the target's embedding, saved as ``embed_tokens``)."""
    arrays = {k: np.asarray(v) if not isinstance(v, dict) else {n: np.asarray(a) for n, a in v.items()}
              for k, v in params.items() if k != "target"}
    config = speculators_config(cfg, target_info["num_layers"], str(info.get("target", "")), ["LlamaForCausalLM"],
                                drafts)
    return save_eagle3(folder, cfg, arrays, np.asarray(params["target"]["embed"]), config)
