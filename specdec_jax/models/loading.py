"""Load real models: a llama or qwen2 GGUF file, a Hugging Face directory, a specdec model
folder (e.g. a trained draft, :func:`save_model_dir`), or a model fetched by name (:func:`load_fetched`).

Converted weights are cached under `cache_dir()/converted/<CACHE_FORMAT>-<sha256 of the source>`
(`specdec_jax.cache`: converted by one process while the others wait), so the second load skips
dequantization.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import sys

import numpy as np

from specdec_jax import cache, interrupts
from specdec_jax.cache import cache_dir
from specdec_jax.models.fetch import model_gguf, sha256_of
from specdec_jax.models.layouts import MODEL_LAYOUT, from_saved_layout
from specdec_jax.models.llama import Llama, LlamaConfig, check_params, param_shapes
from specdec_jax.models.loaded import LoadedModel
from specdec_jax.models.rope import HF_ROPE_TYPES, hf_rope_scaling, hf_rope_type
from specdec_jax.models.tokenizer import BPETokenizer, ByteTokenizer

TOKENIZER_KEYS = ("tokenizer.", "general.architecture")
# Version of a converted-cache entry, part of its folder name: an entry of another version is converted
# again. It changes whenever a conversion would write something else: the file layout of `_cached`, the
# array layout of `models.llama.MODEL_LAYOUT`, or what `LlamaConfig` reads from a GGUF (RoPE scaling).
CACHE_FORMAT = "v6"
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
    """A `llama` or `qwen2` GGUF file: weights (any type the gguf package dequantizes) and its tokenizer.

    A bad file is a one-line ValueError naming it (`gguf_loader`), and leaves no cache entry: an empty
    file or another format is refused before the cache is touched, anything else `convert` finds
    (a file cut short, a missing tensor, ...) raises inside it, so nothing is published."""
    from specdec_jax.models.gguf_loader import check_magic, read_gguf

    path = pathlib.Path(path)
    check_magic(path)

    def convert(announce):
        # The header, tensor names and shapes, and the tokenizer are checked before the slow dequantization.
        config, arrays, meta = read_gguf(path, check_metadata=BPETokenizer.from_gguf_metadata, checked=announce)
        return config, arrays, {k: v for k, v in meta.items() if k.startswith(TOKENIZER_KEYS)}

    config, arrays, meta = _cached(path, convert)
    return LoadedModel(Llama.from_arrays(config, arrays), config, BPETokenizer.from_gguf_metadata(meta))


def load_hf_dir(path: str | pathlib.Path) -> LoadedModel:
    """A Hugging Face style directory of a Llama, Mistral, Qwen2 or Qwen3 model: config.json,
    the safetensors weights (`hf_state`), tokenizer.json."""
    path = pathlib.Path(path)
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ValueError(f"{path} is not a Hugging Face model directory (no config.json)")
    config = hf_config(read_json(config_file), where=str(config_file))
    arrays = hf_arrays(config, hf_state(path), where=str(path))
    return LoadedModel(Llama.from_arrays(config, arrays), config, _hf_tokenizer(path))


HF_INDEX = "model.safetensors.index.json"  # a sharded checkpoint's weight name -> shard file ("weight_map")


def hf_state(path: pathlib.Path) -> dict[str, np.ndarray]:
    """The weights of a Hugging Face directory, by name. With `HF_INDEX`, exactly the shards its
    weight_map names (another *.safetensors in the folder is not part of the checkpoint and is not
    read), each weight from the shard it maps it to; without, every *.safetensors file, merged.
    A missing shard, a shard lacking a weight the index maps to it, or an unreadable file is a
    one-line ValueError naming the file."""
    index = path / HF_INDEX
    if not index.is_file():
        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise ValueError(f"{path}: no *.safetensors files")
        return {name: w for file in files for name, w in read_safetensors(file).items()}
    weight_map = _weight_map(index)
    shards = {}
    for shard in sorted(set(weight_map.values())):
        if not (path / shard).is_file():
            mapped = [name for name, file in weight_map.items() if file == shard]
            raise ValueError(f"{path / shard}: missing, but {HF_INDEX} maps {len(mapped)} weights to it "
                             f"({mapped[0]}, ...): download the shard again")
        shards[shard] = read_safetensors(path / shard)
    for name, shard in weight_map.items():
        if name not in shards[shard]:
            raise ValueError(f"{index}: maps weight {name} to {shard}, which does not hold it: the index and "
                             "the shards are of different checkpoints; download them again")
    return {name: shards[shard][name] for name, shard in weight_map.items()}


def _weight_map(index: pathlib.Path) -> dict[str, str]:
    """The "weight_map" of a safetensors index: a non-empty JSON object of weight name -> shard file name."""
    weight_map = read_json(index).get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map or not all(
            isinstance(file, str) and file.endswith(".safetensors") for file in weight_map.values()):
        raise ValueError(f"{index}: no weight_map (a JSON object of weight name -> *.safetensors shard file): "
                         "download the index again")
    return weight_map


def read_safetensors(file: pathlib.Path) -> dict[str, np.ndarray]:
    """Every tensor of a safetensors file, or a one-line ValueError naming it (cut short, corrupt).
    bfloat16 tensors (which the safetensors package's numpy reader refuses) come as float32, exactly."""
    from safetensors import SafetensorError, safe_open
    from safetensors.numpy import load_file

    try:
        with safe_open(file, framework="numpy") as opened:
            bf16 = [name for name in opened.keys() if opened.get_slice(name).get_dtype() == "BF16"]
        if not bf16:
            return load_file(file)
        return _read_with_bfloat16(file)
    except (SafetensorError, OSError) as err:
        raise ValueError(f"{file}: not a readable safetensors file ({_one_line(err)}): it is truncated or "
                         "corrupt; download it again") from None


def _read_with_bfloat16(file: pathlib.Path) -> dict[str, np.ndarray]:
    """The tensors of a safetensors file holding bfloat16 ones, read from its header and bytes (the
    format: an 8-byte little-endian header size, a JSON header of name -> dtype, shape and data offsets,
    the data); bfloat16 widened to float32. A header that does not fit the file is an OSError."""
    import ml_dtypes

    dtypes = {"BF16": ml_dtypes.bfloat16, "F16": np.float16, "F32": np.float32, "F64": np.float64, "I8": np.int8,
              "I16": np.int16, "I32": np.int32, "I64": np.int64, "U8": np.uint8, "BOOL": np.bool_}
    raw = np.memmap(file, dtype=np.uint8, mode="r")
    size = int(raw[:8].view("<u8")[0])
    header = json.loads(bytes(raw[8:8 + size]))
    out = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        if entry["dtype"] not in dtypes:
            raise OSError(f"tensor {name} has dtype {entry['dtype']}, which this reader does not know")
        begin, end = (8 + size + offset for offset in entry["data_offsets"])
        if end > raw.size:
            raise OSError(f"tensor {name} runs past the end of the file")
        array = np.frombuffer(raw[begin:end].tobytes(), dtypes[entry["dtype"]]).reshape(entry["shape"])
        out[name] = array.astype(np.float32) if entry["dtype"] == "BF16" else array
    return out


def read_json(path: pathlib.Path) -> dict:
    """The JSON object in `path`, or a one-line ValueError naming the file (and where its JSON breaks)."""
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}: not valid JSON ({err.msg} at line {err.lineno} column {err.colno}): "
                         "fix the file or download it again") from None
    except (OSError, UnicodeDecodeError) as err:
        raise ValueError(f"{path}: cannot be read ({_one_line(err)})") from None
    if not isinstance(value, dict):
        raise ValueError(f"{path}: expected a JSON object, got a JSON {type(value).__name__}")
    return value


def _one_line(err: Exception) -> str:
    """`err` as `Class: message`, on one line and at most 200 characters of message."""
    return f"{err.__class__.__name__}: {' '.join(str(err).split())[:200]}"


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


HF_SIZES = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
HF_OPTIONAL_SIZES = ("num_key_value_heads", "head_dim", "max_position_embeddings")  # null or absent: a default


def _check_sizes(hf: dict, where: str) -> None:
    """Every size of `HF_SIZES` is present and each size given is a positive integer, else a one-line
    ValueError naming the key."""
    for key in HF_SIZES:
        if hf.get(key) is None:
            raise ValueError(f"{where}: the key {key} is missing: add it (a positive integer) from the model's "
                             "original config.json")
    for key in (*HF_SIZES, *HF_OPTIONAL_SIZES):
        value = hf.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"{where}: {key} must be a positive integer, got {value!r}")


def hf_config(hf: dict, where: str) -> LlamaConfig:
    """The `LlamaConfig` of a Hugging Face config.json (``hf``), or a one-line ValueError naming
    ``where`` and the missing or bad size (`HF_SIZES`) or rope parameter (`models.rope.hf_rope_scaling`),
    or the option this decoder does not implement (another family, a rope type not in `HF_ROPE_TYPES`,
    a sliding window, experts, another activation, MLP biases): never a silently different model."""
    family = hf.get("model_type")
    if family not in HF_FAMILIES:
        raise ValueError(f"{where}: model_type {family!r} is not supported ({', '.join(HF_FAMILIES)})")
    _check_sizes(hf, where)
    rope = _rope(hf)
    experts = next((hf[key] for key in ("num_experts", "num_local_experts", "n_routed_experts") if hf.get(key)), None)
    refused = [  # (option, its value, whether the model uses it)
        ("rope scaling", {k: v for k, v in rope.items() if k != "rope_theta"}, hf_rope_type(rope) not in HF_ROPE_TYPES),
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
    try:
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
            rope_scaling=hf_rope_scaling(rope, hf),
        )
    except (ValueError, TypeError) as err:  # LlamaConfig's and the rope parameters' checks, floats
        raise ValueError(f"{where}: {err}") from None


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


def hf_arrays(config: LlamaConfig, weights: dict[str, np.ndarray], where: str | None = None) -> dict[str, np.ndarray]:
    """HF Llama state dict (numpy) -> our stacked layout (`models.llama`: matrices [out, in], as HF's).
    A missing weight, or one of another shape than ``config`` gives it, is a ValueError naming it
    (and ``where``, the directory, when given)."""
    shapes, layer_names = param_shapes(config), hf_layer_weights(config)
    prefix = f"{where}: " if where else ""

    def get(name: str, ours: str) -> np.ndarray:
        if name not in weights:
            raise ValueError(f"{prefix}missing weight {name}: the checkpoint is incomplete or not of this config")
        expected = shapes[ours][1:] if ours in layer_names else shapes[ours]  # one layer of a stacked weight
        if tuple(weights[name].shape) != expected:
            raise ValueError(f"{prefix}weight {name} has shape {tuple(weights[name].shape)}, expected {expected} "
                             "from config.json")
        return np.asarray(weights[name], np.float32)

    arrays = {"embed": get("model.embed_tokens.weight", "embed"), "final_norm": get("model.norm.weight", "final_norm")}
    if not config.tie_embeddings:
        arrays["lm_head"] = get("lm_head.weight", "lm_head")
    for ours, theirs in layer_names.items():
        arrays[ours] = np.stack([get(f"model.layers.{i}.{theirs}", ours) for i in range(config.num_layers)])
    return arrays


def _hf_tokenizer(path: pathlib.Path) -> BPETokenizer:
    """tokenizer.json, with the special tokens and chat template of tokenizer_config.json; the stop ids
    are its eos_token, then `eos_token_id` (an id or a list) of generation_config.json and config.json."""
    from tokenizers import Tokenizer

    if not (path / "tokenizer.json").is_file():
        raise ValueError(f"{path}: no tokenizer.json")
    try:
        tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    except Exception as err:  # noqa: BLE001 - the tokenizers package raises a bare Exception
        raise ValueError(f"{path / 'tokenizer.json'}: not a tokenizer the tokenizers package reads "
                         f"({_one_line(err)}): download it again") from None
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
    """`read_json(path)`, or {} when there is no such file (an optional part of a folder)."""
    return read_json(path) if path.is_file() else {}


def _cached(source: pathlib.Path, convert) -> tuple[LlamaConfig, dict[str, np.ndarray], dict]:
    """(config, arrays, tokenizer metadata) of `source`; from the cache when its sha256 was converted before,
    else converted once across processes (`cache.entry`) by ``convert(announce)``, which calls
    ``announce()`` (a progress line) once the source passed its checks.

    The entry is a folder: `params.safetensors` (float32 arrays), `tokenizer.json` (metadata) and
    `config.json`. Safetensors, not orbax: a cache entry is one process's file, and orbax saves
    synchronise every process of a multi-host run.
    """
    folder = cache_dir() / "converted" / f"{CACHE_FORMAT}-{sha256_of(source)}"

    def read(path: pathlib.Path):
        from safetensors.numpy import load_file

        try:
            config = LlamaConfig(**json.loads((path / "config.json").read_text()))
            arrays = load_file(path / "params.safetensors")
            check_params(config, arrays)
            return config, arrays, json.loads((path / "tokenizer.json").read_text())
        except Exception as err:  # noqa: BLE001 - safetensors, JSON, a missing part: any unreadable entry
            print(f"the converted cache {path} is unreadable ({err.__class__.__name__}: {str(err)[:200]}); "
                  "converting again", file=sys.stderr)
            return None

    def build(tmp: pathlib.Path):
        from safetensors.numpy import save_file

        config, arrays, meta = convert(lambda: print(f"converting {source.name} (first load; cached for next time) ...",
                                                     file=sys.stderr))
        tmp.mkdir()
        save_file(arrays, str(tmp / "params.safetensors"))
        (tmp / "tokenizer.json").write_text(json.dumps(meta, default=_jsonable))
        (tmp / "config.json").write_text(json.dumps(dataclasses.asdict(config)))
        return config, arrays, meta

    return cache.entry(folder, f"the converted {source.name}", read, build)


def _jsonable(value):
    """numpy scalars/arrays in GGUF metadata -> plain Python."""
    return value.tolist() if hasattr(value, "tolist") else str(value)
