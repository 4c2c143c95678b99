"""Tiny published drafter heads (EAGLE-3 of speculators and SafeAILab, Medusa-1), weights regenerated from
a fixed seed (never committed), and the folders each format ships.

Shared by ``scripts/make_published_drafter_references.py``, which loads the weights into speculators' and
medusa-llm's own models, runs them and records ``tests/fixtures/published_heads.json``, and
``tests/test_published_heads.py``, which writes the same weights in each published format and loads them
through this project's loader. Neither imports torch here.

The targets are transformers decoders of `TARGETS` with `hf_family_weights.state_dict`'s weights. A head
case of `CASES` names its format, target and options; `head_state_dict` draws its weights with speculators'
names (float32; ``V`` the target's vocabulary, ``Vd`` the draft's, ``H`` the head's width, ``Ht`` the
target's, ``m`` target states read)::

    fc.weight [H, m*Ht]  N(0, 1 / fan_in) (every matrix)      layers.{i}.* [..]   a decoder layer, q/k/v of
    norm.weight, *norm*.weight        1 + 0.2 N(0, 1)                             layer 0 of input 2H
    lm_head.weight [Vd, H]            N(0, 4 / H): logits of std ~2
    embed_tokens.weight [V, H]        the target's (``embed: "copy"``) or N(0, 1) (``"own"``), else absent
    d2t i64[Vd], t2d bool[V]          a random draft vocabulary (Vd < V only)
    Medusa-1: {i}.0.linear.weight [H, H], {i}.0.linear.bias [H] 0.2 N(0, 1), {i}.1.weight [V, H]

``bfloat16`` cases round every floating weight to bfloat16 (the reference runs the rounded values).
`write_folder` writes a case's folder as its format ships it (safetensors, bfloat16 included).
"""

from __future__ import annotations

import json
import math
import pathlib
import zlib

import ml_dtypes
import numpy as np

SEED = 20261204
PROMPT = 8  # prompt tokens per target
CHAIN = 4  # drafts per recorded chain
TARGETS = {  # name -> transformers config kwargs (AutoConfig.for_model(model_type, **kwargs))
    "llama": dict(model_type="llama", vocab_size=160, hidden_size=32, intermediate_size=64, num_hidden_layers=8,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=8, rope_theta=1e4, rms_norm_eps=1e-5,
                  tie_word_embeddings=False, max_position_embeddings=256),
    "qwen3": dict(model_type="qwen3", vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=7,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, rope_theta=1e6, rms_norm_eps=1e-6,
                  tie_word_embeddings=True, max_position_embeddings=256),
}
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
CASES = {  # case -> format, target, the head's layer config (transformers kwargs) and options
    "speculators-llama": dict(format="speculators", target="llama", layer_ids=[1, 3, 6], draft_vocab=48,
                              embed="copy", layer=dict(model_type="llama", hidden_size=32, intermediate_size=48,
                                                       num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                                       rope_theta=5e4, rms_norm_eps=1e-5)),
    "speculators-qwen3-bf16": dict(format="speculators", target="qwen3", layer_ids=None, draft_vocab=64, embed="own",
                                   flags=dict(norm_before_residual=True, fc_norm=True, norm_output=True),
                                   dtype="bfloat16", layer=dict(model_type="qwen3", hidden_size=32,
                                                                intermediate_size=48, num_attention_heads=4,
                                                                num_key_value_heads=2, head_dim=16, rope_theta=1e6)),
    "speculators-llama-deep": dict(format="speculators", target="llama", layer_ids=[2, 5, 7], draft_vocab=None,
                                   embed="copy", flags=dict(norm_before_fc=True),
                                   layer=dict(model_type="llama", hidden_size=32, intermediate_size=48,
                                              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                                              head_dim=8, rope_parameters=LLAMA3_ROPE, rms_norm_eps=1e-5,
                                              max_position_embeddings=128)),
    "safeailab-llama": dict(format="safeailab", target="llama", draft_vocab=64, embed=None,
                            layer=dict(model_type="llama", hidden_size=32, intermediate_size=48,
                                       num_attention_heads=4, num_key_value_heads=2, rope_theta=1e4,
                                       rms_norm_eps=1e-5)),
    "safeailab-wide-qwen3": dict(format="safeailab", target="qwen3", draft_vocab=48, embed="own",
                                 layer=dict(model_type="llama", hidden_size=48, intermediate_size=64,
                                            num_attention_heads=4, num_key_value_heads=2, rope_theta=1e4,
                                            rms_norm_eps=1e-5)),
    "medusa-llama": dict(format="medusa", target="llama", heads=3),
}


def prompt(target: str) -> list[int]:
    """The prompt of ``target``'s cases: `PROMPT` ids in [3, V)."""
    vocab = TARGETS[target]["vocab_size"]
    return np.random.default_rng([SEED, zlib.crc32(target.encode())]).integers(3, vocab, PROMPT).tolist()


def layer_ids(case: str) -> list[int]:
    """The target states the case reads, as speculators numbers them (input of layer k); the default
    [2, L // 2, L - 3] when the case names none (SafeAILab: always)."""
    spec, n = CASES[case], TARGETS[CASES[case]["target"]]["num_hidden_layers"]
    return spec.get("layer_ids") or [2, n // 2, n - 3]


def safeailab_config(case: str) -> dict:
    """config.json of a SafeAILab head (its EConfig: a flat Llama config plus draft_vocab_size)."""
    spec, target = CASES[case], TARGETS[CASES[case]["target"]]
    layer = {k: v for k, v in spec["layer"].items() if k != "model_type"}
    config = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_act": "silu",
              "num_hidden_layers": 1, "vocab_size": target["vocab_size"], "draft_vocab_size": spec["draft_vocab"],
              "max_position_embeddings": 256, "torch_dtype": "float32", **layer}
    if layer["hidden_size"] != target["hidden_size"]:
        config["target_hidden_size"] = target["hidden_size"]
    return config


def _draw(rng, name: str, shape: tuple[int, ...]) -> np.ndarray:
    """One weight by its name (module docstring's scales)."""
    if name.endswith("bias"):
        return (0.2 * rng.standard_normal(shape)).astype(np.float32)
    if len(shape) == 1:
        return (1 + 0.2 * rng.standard_normal(shape)).astype(np.float32)
    scale = 2.0 if name.startswith("lm_head") or name.endswith(".1.weight") else 1.0
    return (scale / math.sqrt(shape[-1]) * rng.standard_normal(shape)).astype(np.float32)


def _layer_shapes(prefix: str, layer: dict, in_width: int) -> dict[str, tuple[int, ...]]:
    h, i, n, k = layer["hidden_size"], layer["intermediate_size"], layer["num_attention_heads"], layer[
        "num_key_value_heads"]
    d = layer.get("head_dim") or h // n
    shapes = {"input_layernorm.weight": (h,), "self_attn.q_proj.weight": (n * d, in_width),
              "self_attn.k_proj.weight": (k * d, in_width), "self_attn.v_proj.weight": (k * d, in_width),
              "self_attn.o_proj.weight": (h, n * d), "post_attention_layernorm.weight": (h,),
              "mlp.gate_proj.weight": (i, h), "mlp.up_proj.weight": (i, h), "mlp.down_proj.weight": (h, i)}
    if layer["model_type"] == "qwen3":
        shapes.update({"self_attn.q_norm.weight": (d,), "self_attn.k_norm.weight": (d,)})
    if in_width != h:
        shapes["hidden_norm.weight"] = (h,)
    return {prefix + name: shape for name, shape in shapes.items()}


def head_state_dict(case: str, target_weights: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The case's weights with speculators' (Medusa: medusa-llm's) names (module docstring)."""
    spec, target = CASES[case], TARGETS[CASES[case]["target"]]
    rng = np.random.default_rng([SEED, zlib.crc32(case.encode())])
    vocab, width = target["vocab_size"], target["hidden_size"]
    if spec["format"] == "medusa":
        return {f"{i}.{j}": _draw(rng, f"{i}.{j}", shape) for i in range(spec["heads"])
                for j, shape in (("0.linear.weight", (width, width)), ("0.linear.bias", (width,)),
                                 ("1.weight", (vocab, width)))}
    layer, m = spec["layer"], len(layer_ids(case))
    h, flags = layer["hidden_size"], spec.get("flags", {})
    shapes = {"fc.weight": (h, m * width)}
    for index in range(layer.get("num_hidden_layers", 1)):
        shapes.update(_layer_shapes(f"layers.{index}.", layer, 2 * h if index == 0 else h))
    shapes.update({"norm.weight": (h,), "lm_head.weight": (spec["draft_vocab"] or vocab, h)})
    if flags.get("norm_before_fc"):
        shapes["input_norm.weight"] = (m * width,)
    if flags.get("fc_norm"):
        shapes.update({f"fc_norm.{i}.weight": (width,) for i in range(m)})
    weights = {name: _draw(rng, name, shape) for name, shape in shapes.items()}
    if spec["embed"] == "copy":
        weights["embed_tokens.weight"] = target_weights["model.embed_tokens.weight"].copy()
    elif spec["embed"] == "own":
        weights["embed_tokens.weight"] = rng.standard_normal((vocab, h)).astype(np.float32)
    if spec["draft_vocab"]:
        ids = np.sort(rng.choice(vocab, spec["draft_vocab"], replace=False))
        weights["d2t"] = (ids - np.arange(len(ids))).astype(np.int64)
        weights["t2d"] = np.isin(np.arange(vocab), ids)
    if spec.get("dtype") == "bfloat16":
        weights = {k: v.astype(ml_dtypes.bfloat16).astype(np.float32) if v.dtype == np.float32 else v
                   for k, v in weights.items()}
    return weights


def safeailab_names(weights: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """speculators' names -> SafeAILab's (``layers.0.`` is ``midlayer.``)."""
    return {name.replace("layers.0.", "midlayer.", 1): value for name, value in weights.items()}


def write_safetensors(path: pathlib.Path, arrays: dict[str, np.ndarray], bfloat16: bool = False) -> None:
    """A safetensors file of ``arrays`` (floating ones as bfloat16 when asked), by the format: an
    8-byte little-endian header size, the JSON header, the data."""
    codes = {"float32": "F32", "bfloat16": "BF16", "int64": "I64", "bool": "BOOL"}
    header, chunks, offset = {}, [], 0
    for name in sorted(arrays):
        array = np.ascontiguousarray(arrays[name])
        if bfloat16 and array.dtype == np.float32:
            array = array.astype(ml_dtypes.bfloat16)
        data = array.tobytes()
        header[name] = {"dtype": codes[array.dtype.name], "shape": list(array.shape),
                        "data_offsets": [offset, offset + len(data)]}
        chunks.append(data)
        offset += len(data)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(len(text).to_bytes(8, "little") + text + b"".join(chunks))


def write_folder(case: str, config: dict, weights: dict[str, np.ndarray], folder: pathlib.Path) -> pathlib.Path:
    """``folder`` as the case's format ships it: config.json (``config``, as the reference package wrote
    it) and the weights (speculators: model.safetensors; SafeAILab: ``midlayer.*`` in model.safetensors;
    Medusa-1: medusa_lm_head.safetensors)."""
    spec = CASES[case]
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    if spec["format"] == "medusa":
        write_safetensors(folder / "medusa_lm_head.safetensors", weights)
    elif spec["format"] == "safeailab":
        write_safetensors(folder / "model.safetensors", safeailab_names(weights))
    else:
        write_safetensors(folder / "model.safetensors", weights, bfloat16=spec.get("dtype") == "bfloat16")
    return folder
