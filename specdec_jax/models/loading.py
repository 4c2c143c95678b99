"""Load real models: a llama or qwen2 GGUF file, a Hugging Face directory, a specdec model
folder (e.g. a trained draft, :func:`save_model_dir`), or a model fetched by name (:func:`load_fetched`).

Converted weights are cached with orbax under `cache_dir()/converted/<CACHE_FORMAT>-<sha256
of the source>`, so the second load skips dequantization.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import shutil
import sys

import numpy as np

from specdec_jax import interrupts
from specdec_jax.files import write_text_atomic
from specdec_jax.models.fetch import cache_dir, model_gguf, sha256_of
from specdec_jax.models.llama import MODEL_LAYOUT, Llama, LlamaConfig, check_params, from_saved_layout
from specdec_jax.models.loaded import LoadedModel
from specdec_jax.models.tokenizer import BPETokenizer, ByteTokenizer

TOKENIZER_KEYS = ("tokenizer.", "general.architecture")
# Version of a converted-cache entry, part of its folder name: an entry of another version is
# converted again. v2: config.json has max_positions (v1 folders, a bare sha256, lack it).
CACHE_FORMAT = "v4"  # v3: layer matrices [out, in] (models.llama); v4: lm_head [V, H] too
MODEL_DIR_MARKER = "specdec_model.json"  # config + tokenizer kind + free-form info; written last
HF_LAYER_WEIGHTS = {  # our name -> HF name inside model.layers.{i}. of every family (matrices as they are: [out, in])
    "attn_norm": "input_layernorm.weight",
    "wq": "self_attn.q_proj.weight",
    "wk": "self_attn.k_proj.weight",
    "wv": "self_attn.v_proj.weight",
    "wo": "self_attn.o_proj.weight",
    "mlp_norm": "post_attention_layernorm.weight",
    "w_gate": "mlp.gate_proj.weight",
    "w_up": "mlp.up_proj.weight",
    "w_down": "mlp.down_proj.weight",
}


def load_fetched(name: str) -> LoadedModel:
    """A model that `models.fetch.MODEL_FILES` names (e.g. "qwen2.5-coder-1.5b"): its GGUF fetched on first
    use, dequantized to float32."""
    return load_gguf(model_gguf(name))


def load_gguf(path: str | pathlib.Path) -> LoadedModel:
    """A `llama` or `qwen2` GGUF file: weights (any type the gguf package dequantizes) and its tokenizer."""
    from specdec_jax.models.gguf_loader import read_gguf

    path = pathlib.Path(path)
    if not path.is_file():
        raise ValueError(f"no such GGUF file: {path}")

    def convert():
        # The tokenizer is checked before the slow dequantization.
        config, arrays, meta = read_gguf(path, check_metadata=BPETokenizer.from_gguf_metadata)
        return config, arrays, {k: v for k, v in meta.items() if k.startswith(TOKENIZER_KEYS)}

    config, arrays, meta = _cached(path, convert)
    return LoadedModel(Llama.from_arrays(config, arrays), config, BPETokenizer.from_gguf_metadata(meta))


def load_hf_dir(path: str | pathlib.Path) -> LoadedModel:
    """A Hugging Face style directory of a Llama, Mistral, Qwen2 or Qwen3 model: config.json,
    *.safetensors, tokenizer.json."""
    path = pathlib.Path(path)
    if not (path / "config.json").is_file():
        raise ValueError(f"{path} is not a Hugging Face model directory (no config.json)")
    config = hf_config(json.loads((path / "config.json").read_text()), where=str(path))
    weights = {}
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{path}: no *.safetensors files")
    from safetensors.numpy import load_file

    for f in files:
        weights.update(load_file(f))
    arrays = hf_arrays(config, weights)
    return LoadedModel(Llama.from_arrays(config, arrays), config, _hf_tokenizer(path))


def save_model_dir(folder: str | pathlib.Path, loaded: LoadedModel, info: dict | None = None) -> pathlib.Path:
    """Writes `loaded` as a folder that `load_model(folder)` reads: `params/` (orbax), the
    tokenizer (`tokenizer.json` + `tokenizer_config.json`, or none for the byte tokenizer)
    and `specdec_model.json` (config, tokenizer kind, `info`), written last."""
    import orbax.checkpoint as ocp

    folder = pathlib.Path(folder).resolve()
    folder.mkdir(parents=True, exist_ok=True)
    (folder / MODEL_DIR_MARKER).unlink(missing_ok=True)
    checkpointer = ocp.StandardCheckpointer()
    with interrupts.deferred():
        checkpointer.save(folder / "params", loaded.model.arrays(), force=True)
        checkpointer.wait_until_finished()
    if isinstance(loaded.tokenizer, ByteTokenizer):
        kind = "byte"
    else:
        kind = "hf"
        loaded.tokenizer.save(folder)
    marker = {"config": dataclasses.asdict(loaded.config), "tokenizer": kind, "layout": MODEL_LAYOUT, "info": info or {}}
    (folder / MODEL_DIR_MARKER).write_text(json.dumps(marker, indent=1, default=_jsonable))
    return folder


def is_model_dir(path: pathlib.Path) -> bool:
    return (path / MODEL_DIR_MARKER).is_file()


def load_model_dir(folder: str | pathlib.Path) -> LoadedModel:
    """A folder written by :func:`save_model_dir`; a missing or unreadable part is a ValueError."""
    import orbax.checkpoint as ocp

    folder = pathlib.Path(folder).resolve()
    if not is_model_dir(folder):
        raise ValueError(f"{folder} is not a specdec model folder (no {MODEL_DIR_MARKER})")
    try:
        marker = json.loads((folder / MODEL_DIR_MARKER).read_text())
        config = LlamaConfig(**marker["config"])
        arrays = {k: np.asarray(v) for k, v in ocp.StandardCheckpointer().restore(folder / "params").items()}
    except Exception as err:  # orbax raises many kinds; name the folder
        raise ValueError(f"{folder}: cannot read the model ({err.__class__.__name__}: {err})") from None
    arrays = from_saved_layout(arrays, marker.get("layout"))
    check_vocab_map(config, arrays, folder)
    tokenizer = ByteTokenizer() if marker["tokenizer"] == "byte" else _hf_tokenizer(folder)
    return LoadedModel(Llama.from_arrays(config, arrays), config, tokenizer)


def check_vocab_map(config: LlamaConfig, arrays: dict[str, np.ndarray], where) -> None:
    """ValueError naming `where` unless `arrays["vocab_map"]` (i32[Vo], if present: the token id of
    each output logit) holds distinct ids in [0, vocab_size)."""
    if "vocab_map" not in arrays:
        return
    ids = np.asarray(arrays["vocab_map"])
    bad = ids[(ids < 0) | (ids >= config.vocab_size)]
    if bad.size:
        raise ValueError(f"{where}: vocab_map has ids outside [0, {config.vocab_size}): {bad[:5].tolist()}")
    values, counts = np.unique(ids, return_counts=True)
    if (counts > 1).any():
        raise ValueError(f"{where}: vocab_map repeats ids {values[counts > 1][:5].tolist()}")


HF_FAMILIES = {  # model_type -> (attention_bias by default, qk_norm)
    "llama": (False, False),
    "mistral": (False, False),
    "qwen2": (True, False),  # q, k, v biases are part of the architecture
    "qwen3": (False, True),
}


def hf_config(hf: dict, where: str) -> LlamaConfig:
    """The `LlamaConfig` of a Hugging Face config.json (``hf``), or a one-line ValueError naming the
    option this decoder does not implement (another family, rope scaling, a sliding window, experts,
    another activation, MLP biases): never a silently different model."""
    family = hf.get("model_type")
    if family not in HF_FAMILIES:
        raise ValueError(f"{where}: model_type {family!r} is not supported ({', '.join(HF_FAMILIES)})")
    rope = _rope(hf)
    experts = next((hf[key] for key in ("num_experts", "num_local_experts", "n_routed_experts") if hf.get(key)), None)
    refused = [  # (option, its value, whether the model uses it)
        ("rope scaling", rope, (rope.get("rope_type") or rope.get("type")) not in (None, "default")),
        ("sliding_window", hf.get("sliding_window"), _sliding_window(hf)),
        ("mixture of experts", experts, experts is not None),
        ("hidden_act", hf.get("hidden_act"), hf.get("hidden_act", "silu") != "silu"),
        ("mlp_bias", hf.get("mlp_bias"), bool(hf.get("mlp_bias"))),
    ]
    for option, value, used in refused:
        if used:
            raise ValueError(f"{where}: {option} = {value!r} is not supported by this decoder (model_type {family!r})")
    bias, qk_norm = HF_FAMILIES[family]
    heads = hf["num_attention_heads"]
    return LlamaConfig(
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        intermediate_size=hf["intermediate_size"],
        num_layers=hf["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=hf.get("num_key_value_heads") or heads,
        head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
        rope_theta=float(rope.get("rope_theta", 10000.0)),
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6 if family.startswith("qwen") else 1e-5)),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        max_positions=hf.get("max_position_embeddings"),
        attention_bias=bias or bool(hf.get("attention_bias", False)),
        qk_norm=qk_norm,
    )


def _rope(hf: dict) -> dict:
    """RoPE settings of a config.json: transformers 5 nests them in ``rope_parameters`` (``rope_theta``,
    ``rope_type``, scaling factors); earlier files have a top-level ``rope_theta`` and ``rope_scaling``."""
    rope = dict(hf.get("rope_parameters") or {})
    rope.update(hf.get("rope_scaling") or {})
    if "rope_theta" in hf:
        rope.setdefault("rope_theta", hf["rope_theta"])
    return rope


def _sliding_window(hf: dict) -> bool:
    """Whether attention is windowed for some layer: Qwen's ``use_sliding_window`` (its
    ``sliding_window`` value is unused without it), or Mistral's ``sliding_window`` below the
    context length (a window as long as the context changes nothing)."""
    if hf.get("model_type", "").startswith("qwen"):
        return bool(hf.get("use_sliding_window"))
    window = hf.get("sliding_window")
    return window is not None and window < (hf.get("max_position_embeddings") or window + 1)


def hf_layer_weights(config: LlamaConfig) -> dict[str, str]:
    """Our per-layer weight name -> its HF name inside ``model.layers.{i}.``, for ``config``'s family."""
    names = dict(HF_LAYER_WEIGHTS)
    if config.attention_bias:
        names.update(bq="self_attn.q_proj.bias", bk="self_attn.k_proj.bias", bv="self_attn.v_proj.bias")
    if config.qk_norm:
        names.update(q_norm="self_attn.q_norm.weight", k_norm="self_attn.k_norm.weight")
    return names


def hf_arrays(config: LlamaConfig, weights: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """HF Llama state dict (numpy) -> our stacked layout (`models.llama`: matrices [out, in], as HF's)."""

    def get(name):
        if name not in weights:
            raise ValueError(f"missing weight {name}")
        return np.asarray(weights[name], np.float32)

    arrays = {"embed": get("model.embed_tokens.weight"), "final_norm": get("model.norm.weight")}
    if not config.tie_embeddings:
        arrays["lm_head"] = get("lm_head.weight")
    for ours, theirs in hf_layer_weights(config).items():
        layers = [get(f"model.layers.{i}.{theirs}") for i in range(config.num_layers)]
        arrays[ours] = np.stack(layers)
    return arrays


def _hf_tokenizer(path: pathlib.Path) -> BPETokenizer:
    """tokenizer.json, with the special tokens and chat template of tokenizer_config.json; the stop ids
    are its eos_token, then `eos_token_id` (an id or a list) of generation_config.json and config.json."""
    from tokenizers import Tokenizer

    if not (path / "tokenizer.json").is_file():
        raise ValueError(f"{path}: no tokenizer.json")
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    cfg = _json_or_empty(path / "tokenizer_config.json")

    def token_id(key):
        value = cfg.get(key)
        value = value.get("content") if isinstance(value, dict) else value
        return tok.token_to_id(value) if value else None

    eos = token_id("eos_token")
    if eos is None:
        raise ValueError(f"{path}: tokenizer_config.json names no eos_token")
    stops = [eos]
    for name in ("generation_config.json", "config.json"):
        ids = _json_or_empty(path / name).get("eos_token_id")
        ids = [] if ids is None else ids if isinstance(ids, list) else [ids]
        if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
            raise ValueError(f"{path / name}: eos_token_id must be a token id or a list of them, got {ids!r}")
        stops += ids
    return BPETokenizer(tok, bos_id=token_id("bos_token"), stop_ids=tuple(stops), chat_template=cfg.get("chat_template"))


def _json_or_empty(path: pathlib.Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}


def _cached(source: pathlib.Path, convert) -> tuple[LlamaConfig, dict[str, np.ndarray], dict]:
    """(config, arrays, tokenizer metadata) of `source`; from the cache when its sha256 was converted before.

    The cache folder holds `params/` (orbax), `tokenizer.json` (metadata) and
    `config.json`, written last: it marks the entry complete.
    """
    import orbax.checkpoint as ocp

    folder = cache_dir() / "converted" / f"{CACHE_FORMAT}-{sha256_of(source)}"
    config_file, meta_file = folder / "config.json", folder / "tokenizer.json"
    checkpointer = ocp.StandardCheckpointer()
    if config_file.is_file() and meta_file.is_file() and (folder / "params").is_dir():
        try:
            config = LlamaConfig(**json.loads(config_file.read_text()))
            arrays = {k: np.asarray(v) for k, v in checkpointer.restore((folder / "params").resolve()).items()}
            check_params(config, arrays)
            return config, arrays, json.loads(meta_file.read_text())
        except Exception as err:  # noqa: BLE001 - orbax, tensorstore, JSON: any unreadable part
            print(f"the converted cache {folder} is unreadable ({err.__class__.__name__}: {str(err)[:200]}); "
                  "converting again", file=sys.stderr)
    print(f"converting {source.name} (first load; cached for next time) ...", file=sys.stderr)
    config, arrays, meta = convert()
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True, exist_ok=True)
    with interrupts.deferred():
        checkpointer.save((folder / "params").resolve(), arrays, force=True)
        checkpointer.wait_until_finished()
    write_text_atomic(meta_file, json.dumps(meta, default=_jsonable))
    write_text_atomic(config_file, json.dumps(dataclasses.asdict(config)))  # last: the entry is complete
    return config, arrays, meta


def _jsonable(value):
    """numpy scalars/arrays in GGUF metadata -> plain Python."""
    return value.tolist() if hasattr(value, "tolist") else str(value)
