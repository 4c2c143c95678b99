"""Drafter heads as the field publishes them (docs/drafters.md "Published heads"), and this project's own.

`load_drafter_folder(folder, kind, target)` reads ``--draft-model FOLDER`` for ``--drafter eagle|medusa|dflash``:

- this project's head folders (`drafters.heads`, ``specdec_head.json``): `heads.load_head`, unchanged;
- vLLM speculators EAGLE-3 (config.json with ``speculators_model_type: eagle3``,
  ``transformer_layer_config``, ``draft_vocab_size``; safetensors, float32 or bfloat16);
- SafeAILab's EAGLE-3 layout (config.json of ``LlamaForCausalLMEagle3``; ``midlayer.*`` weights in
  ``pytorch_model.bin`` or safetensors);
- FasterDecoding's Medusa-1 heads (config.json with ``medusa_num_heads``; ``medusa_lm_head.pt`` or
  ``.safetensors``);
- DFlash drafters (`drafters.dflash`): z-lab's ``save_pretrained`` folders (config.json of a
  ``DFlashDraftModel``: a Qwen3 config with ``block_size`` and ``dflash_config``) and speculators'
  ``dflash`` format (``speculators_model_type: dflash``), safetensors.

Target layers: speculators' ``eagle_aux_hidden_state_layer_ids`` k names the input of target layer
k (transformers' ``hidden_states[k]``), this project's layer ``k - 1`` (k = L, the last layer's
output before the final norm, as speculators trains it: ``L - 1``; k = 0, the embeddings, is
refused); absent, the published default [2, L // 2, L - 3]. SafeAILab's are fixed to that default.
speculators' DFlash ``aux_hidden_state_layer_ids`` count the same way; z-lab's ``target_layer_ids`` i
name the output of target layer i (our layer i; i = L - 1 is transformers' final-normed state, our
``FINAL_NORM``), by default spread over the layers as z-lab's ``build_target_layer_ids`` does
(`zlab_layer_ids`).
Anything that does not fit (another target's sizes, a missing weight, a ``d2t`` outside the
vocabulary, a variant this project does not implement) is a one-line ValueError naming the folder.
"""

from __future__ import annotations

import collections
import dataclasses
import pathlib
import pickle
import zipfile

import numpy as np

from specdec_jax.drafters.dflash import DFlashConfig, DFlashDrafter, dflash_shapes
from specdec_jax.drafters.eagle3 import FLAGS, Eagle3Config, Eagle3Drafter, eagle3_shapes
from specdec_jax.drafters import heads
from specdec_jax.drafters.heads import HEAD_MARKER, is_head_dir, load_head
from specdec_jax.drafters.medusa import MedusaConfig, MedusaDrafter
from specdec_jax.models.llama import LlamaConfig
from specdec_jax.target import FINAL_NORM
from specdec_jax.models.loading import hf_config, hf_layer_weights, hf_state, read_json, read_safetensors

SPECULATORS, SAFEAILAB, MEDUSA1, OWN = "speculators EAGLE-3", "SafeAILab EAGLE-3", "Medusa-1", "head"
ZLAB_DFLASH, SPECULATORS_DFLASH = "z-lab DFlash", "speculators DFlash"
KIND_OF = {SPECULATORS: "eagle", SAFEAILAB: "eagle", MEDUSA1: "medusa", ZLAB_DFLASH: "dflash",
           SPECULATORS_DFLASH: "dflash"}
SPECULATORS_IDS = {SPECULATORS: "eagle_aux_hidden_state_layer_ids", SPECULATORS_DFLASH: "aux_hidden_state_layer_ids"}
LAYER_DEFAULTS = {  # transformers' class defaults: speculators writes its layer config without keys equal to them
    "llama": dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                  num_attention_heads=32, num_key_value_heads=32, head_dim=128, rms_norm_eps=1e-6,
                  max_position_embeddings=2048, rope_theta=10000.0),
    "qwen3": dict(vocab_size=151936, hidden_size=4096, intermediate_size=22016, num_hidden_layers=32,
                  num_attention_heads=32, num_key_value_heads=32, head_dim=128, rms_norm_eps=1e-6,
                  max_position_embeddings=32768, rope_theta=10000.0),
}
SAFEAILAB_DEFAULTS = dict(rms_norm_eps=1e-6, rope_theta=10000.0)  # its EConfig's; head_dim is always H / heads


def folder_format(folder: pathlib.Path) -> str | None:
    """Which head format ``folder`` holds (module docstring), None for anything else."""
    if is_head_dir(folder):
        return OWN
    if not (folder / "config.json").is_file():
        return None
    config = read_json(folder / "config.json")
    if "speculators_model_type" in config:
        model_type = config["speculators_model_type"]
        if model_type not in ("eagle3", "dflash"):
            raise ValueError(f"{folder}: speculators_model_type {model_type!r} is not supported (eagle3, dflash)")
        return SPECULATORS if model_type == "eagle3" else SPECULATORS_DFLASH
    if any("Eagle3" in name for name in config.get("architectures") or []):
        return SAFEAILAB
    if any("DFlash" in name for name in config.get("architectures") or []):
        return ZLAB_DFLASH
    return MEDUSA1 if "medusa_num_heads" in config else None


def head_kind(path) -> tuple[str, str] | None:
    """``(what the folder holds, its --drafter)`` for a head folder (this project's or a published one),
    None for anything else (a model folder, a file)."""
    folder = pathlib.Path(path).expanduser()
    own = heads.head_kind(folder)
    if own is not None:
        return f"trained {own}", own
    try:
        found = folder_format(folder) if folder.is_dir() else None
    except ValueError:  # a published format this project does not load
        return None
    return None if found is None else (found, KIND_OF[found])


def load_drafter_folder(path, kind: str, target):
    """The drafter of ``--drafter kind --draft-model path`` for ``target`` (a `LoadedModel`), or a
    one-line ValueError naming the folder."""
    folder = pathlib.Path(path).expanduser().resolve()
    found = folder_format(folder) if folder.is_dir() else None
    if found is None:
        raise ValueError(f"{folder} is not a drafter head folder: neither this project's ({HEAD_MARKER}; train "
                         "one with specdec-jax train-draft) nor a published one (config.json of a speculators "
                         "EAGLE-3, SafeAILab EAGLE-3, Medusa-1 head or a z-lab or speculators DFlash drafter)")
    if found == OWN:
        return load_head(folder, kind=kind, target=target)
    if KIND_OF[found] != kind:
        raise ValueError(f"{folder} holds a {found} head, not a {kind} head: use --drafter {KIND_OF[found]}")
    config = read_json(folder / "config.json")
    if found == MEDUSA1:
        return _medusa(folder, config, target.config)
    if KIND_OF[found] == "dflash":
        return _dflash(folder, config, found, target.config)
    layer = _layer_config(folder, config, found)
    return _eagle3(folder, config, _weights(folder, "pytorch_model.bin"), layer, target, found)


def _weights(folder: pathlib.Path, pickled: str) -> dict[str, np.ndarray]:
    """The folder's safetensors weights, else its torch file ``pickled`` (`read_torch_file`)."""
    if any(folder.glob("*.safetensors")):
        return hf_state(folder)
    if (folder / pickled).is_file():
        return read_torch_file(folder / pickled)
    raise ValueError(f"{folder}: no weights (*.safetensors or {pickled})")


def _layer_config(folder: pathlib.Path, config: dict, found: str) -> LlamaConfig:
    """The head's decoder as a `LlamaConfig` (its own RoPE, qk-norm, biases; omitted keys at the defaults
    of the format: `LAYER_DEFAULTS`, `SAFEAILAB_DEFAULTS`)."""
    where = f"{folder / 'config.json'}"
    if found in SPECULATORS_IDS:
        layer = config.get("transformer_layer_config")
        if not isinstance(layer, dict):
            raise ValueError(f"{where}: no transformer_layer_config: not a {found} head")
        layer = dict(layer)
        layer.setdefault("model_type", "qwen3")  # speculators' default layer class
        defaults = LAYER_DEFAULTS.get(layer["model_type"], {})
    elif found == ZLAB_DFLASH:  # always Qwen3 layers, whatever the target's family
        layer, defaults = {**config, "model_type": "qwen3"}, LAYER_DEFAULTS["qwen3"]
    else:
        layer = {"model_type": "llama", **{k: v for k, v in config.items() if k != "head_dim"}}
        defaults = SAFEAILAB_DEFAULTS
    if "rope_theta" in layer or "rope_parameters" in layer:
        defaults = {k: v for k, v in defaults.items() if k != "rope_theta"}
    layer = {**defaults, **layer, "tie_word_embeddings": False}
    return hf_config(layer, f"{where} (the head's layer)")


def _layer_ids(folder: pathlib.Path, config: dict, found: str, num_layers: int) -> tuple[int, ...]:
    """This project's target layers of the head's features (module docstring)."""
    ids = config.get(SPECULATORS_IDS[found]) if found in SPECULATORS_IDS else None
    ids = list(ids) if ids else [2, num_layers // 2, num_layers - 3]
    if any(not isinstance(k, int) or not 1 <= k <= num_layers for k in ids) or len(set(ids)) != len(ids):
        raise ValueError(f"{folder}: the head reads target layers {ids} (inputs of those layers); the target has "
                         f"{num_layers} layers, so distinct ids in 1..{num_layers} (0, the embeddings, is not "
                         "supported): a head for another target")
    return tuple(min(k - 1, num_layers - 1) for k in ids)


def _take(weights: dict, name: str, folder: pathlib.Path) -> np.ndarray:
    if name not in weights:
        raise ValueError(f"{folder}: missing weight {name}: the checkpoint is incomplete or not of this format")
    return np.asarray(weights[name])


def _layer_arrays(weights: dict, layer: LlamaConfig, prefixes: list[str], folder) -> dict[str, np.ndarray]:
    """Our stacked per-layer arrays (`models.llama`) of the layers under ``prefixes`` (float32)."""
    return {ours: np.stack([_take(weights, p + theirs, folder).astype(np.float32) for p in prefixes])
            for ours, theirs in hf_layer_weights(layer).items()}


def _vocab_map(folder: pathlib.Path, weights: dict, draft_vocab: int, vocab: int) -> np.ndarray | None:
    """i32[Vd] target id of each draft id (``d + d2t[d]``), None when the draft vocabulary is the target's
    in order."""
    if "d2t" not in weights:
        if draft_vocab != vocab:
            raise ValueError(f"{folder}: a draft vocabulary of {draft_vocab} ids needs d2t; the folder has none")
        return None
    d2t = np.asarray(weights["d2t"]).astype(np.int64)
    ids = np.arange(len(d2t)) + d2t
    if len(d2t) != draft_vocab or (ids < 0).any() or (ids >= vocab).any() or len(np.unique(ids)) != len(ids):
        raise ValueError(f"{folder}: d2t ({len(d2t)} offsets) does not map the {draft_vocab} draft ids to distinct "
                         f"ids of the target's vocabulary of {vocab}: a head for another target")
    if "t2d" in weights and (len(weights["t2d"]) != vocab or not np.asarray(weights["t2d"])[ids].all()):
        raise ValueError(f"{folder}: t2d does not mark the ids d2t maps to in a vocabulary of {vocab}")
    return None if len(ids) == vocab and (ids == np.arange(vocab)).all() else ids.astype(np.int32)


def _eagle3(folder: pathlib.Path, config: dict, weights: dict, layer: LlamaConfig, target, found: str):
    """An `Eagle3Drafter` from a speculators or SafeAILab folder's config and weights (module docstring)."""
    tcfg = target.config
    if layer.vocab_size != tcfg.vocab_size:
        raise ValueError(f"{folder}: a head for a vocabulary of {layer.vocab_size}; the target has {tcfg.vocab_size}")
    if any(kind != "full_attention" for kind in config.get("transformer_layer_config", {}).get("layer_types") or []):
        raise ValueError(f"{folder}: sliding-window draft layers are not supported")
    features = _layer_ids(folder, config, found, tcfg.num_layers)
    fc = _take(weights, "fc.weight", folder)
    if fc.shape[1] != len(features) * tcfg.hidden_size or config.get("target_hidden_size") not in (
            None, tcfg.hidden_size):
        raise ValueError(f"{folder}: fc.weight {fc.shape} reads {len(features)} target states of width "
                         f"{fc.shape[1] / len(features):g}; the target's width is {tcfg.hidden_size}: a head for "
                         "another target")
    lm_head = _take(weights, "lm_head.weight", folder)
    vocab_map = _vocab_map(folder, weights, int(config.get("draft_vocab_size") or lm_head.shape[0]), tcfg.vocab_size)
    embed = _own_embedding(folder, weights, target, layer.hidden_size)
    flags = {flag: bool(config.get(flag, False)) for flag in FLAGS} if found == SPECULATORS else {}
    cfg = Eagle3Config(layer, features, tcfg.hidden_size, None if vocab_map is None else len(vocab_map),
                       embed is not None, **flags)
    first = "layers.0." if found == SPECULATORS else "midlayer."
    arrays = _layer_arrays(weights, dataclasses.replace(layer, num_layers=1), [first], folder)
    arrays.update(fc=fc, lm_head=lm_head, norm=_take(weights, "norm.weight", folder),
                  hidden_norm=_take(weights, first + "hidden_norm.weight", folder))
    if cfg.norm_before_fc:
        arrays["input_norm"] = _take(weights, "input_norm.weight", folder)
    if cfg.fc_norm:
        arrays["fc_norm"] = np.stack([_take(weights, f"fc_norm.{i}.weight", folder) for i in range(len(features))])
    if cfg.rest is not None:
        arrays["rest"] = _layer_arrays(weights, cfg.rest, [f"layers.{i}." for i in range(1, layer.num_layers)], folder)
    if vocab_map is not None:
        arrays["vocab_map"] = vocab_map
    if embed is not None:
        arrays["embed"] = embed
    _check_shapes(folder, arrays, eagle3_shapes(cfg))
    return Eagle3Drafter(cfg, _float32(arrays))


def _own_embedding(folder: pathlib.Path, weights: dict, target, width: int) -> np.ndarray | None:
    """The head's saved embedding when it differs from the target's (trained, rounded, or of another
    width); None: the target's is used, not copied."""
    shared = target.model.params()["embed"]
    saved = weights.get("embed_tokens.weight")
    if saved is None:
        if width != shared.shape[1]:
            raise ValueError(f"{folder}: a head of width {width} needs its own embed_tokens.weight (the target's "
                             f"width is {shared.shape[1]}); the folder has none")
        return None
    same = saved.shape == shared.shape and np.array_equal(np.asarray(saved, np.float32), np.asarray(shared, np.float32))
    return None if same else saved


def _check_shapes(folder: pathlib.Path, arrays: dict, shapes: dict, where: str = "") -> None:
    """ValueError naming the first weight whose shape is not the config's."""
    for name, shape in shapes.items():
        if isinstance(shape, dict):
            _check_shapes(folder, arrays[name], shape, f"{name}.")
        elif tuple(np.shape(arrays[name])) != shape:
            raise ValueError(f"{folder}: weight {where}{name} has shape {tuple(np.shape(arrays[name]))}; the config "
                             f"gives {shape}")


def _float32(arrays: dict) -> dict:
    """Floating arrays as float32 (bfloat16 and float16 checkpoints), integer ones kept; nested dicts too."""
    return {k: _float32(v) if isinstance(v, dict) else
            (np.asarray(v, np.float32) if np.issubdtype(np.asarray(v).dtype, np.floating) else np.asarray(v))
            for k, v in arrays.items()}


def _medusa(folder: pathlib.Path, config: dict, tcfg: LlamaConfig) -> MedusaDrafter:
    """A `MedusaDrafter` of FasterDecoding's Medusa-1 heads: head i (0-based) is our head i + 1,
    ``w = linear.weight.T``, ``b = linear.bias``, its own full-vocabulary LM head."""
    heads, blocks = int(config["medusa_num_heads"]), int(config.get("medusa_num_layers", 1))
    if blocks != 1:
        raise ValueError(f"{folder}: medusa_num_layers {blocks} is not supported (one ResBlock per head)")
    file = folder / "medusa_lm_head.safetensors"
    weights = read_safetensors(file) if file.is_file() else _weights(folder, "medusa_lm_head.pt")
    w = np.stack([_take(weights, f"{i}.0.linear.weight", folder).T for i in range(heads)])
    b = np.stack([_take(weights, f"{i}.0.linear.bias", folder) for i in range(heads)])
    lm_head = np.stack([_take(weights, f"{i}.1.weight", folder).T for i in range(heads)])
    if (w.shape[1], lm_head.shape[2]) != (tcfg.hidden_size, tcfg.vocab_size):
        raise ValueError(f"{folder}: Medusa heads of hidden size {w.shape[1]} and vocabulary {lm_head.shape[2]}; "
                         f"the target has {tcfg.hidden_size} and {tcfg.vocab_size}: heads for another target")
    arrays = {"w": w, "b": b, "lm_head": np.ascontiguousarray(lm_head),
              "vocab_map": np.arange(tcfg.vocab_size, dtype=np.int32)}
    cfg = MedusaConfig(tcfg.hidden_size, tcfg.vocab_size, heads, output_vocab_size=tcfg.vocab_size)
    return MedusaDrafter(cfg, _float32(arrays))


def zlab_layer_ids(num_target: int, num_draft: int) -> list[int]:
    """z-lab's default target layers (``build_target_layer_ids``): the middle one for one draft layer,
    else ``num_draft`` spread over 1 .. L - 3."""
    if num_draft == 1:
        return [num_target // 2]
    return [round(1 + i * (num_target - 4) / (num_draft - 1)) for i in range(num_draft)]


def _dflash_value(config: dict, name: str, default=None):
    """z-lab's lookup of a DFlash setting: ``dflash_config`` first, then the top level."""
    return (config.get("dflash_config") or {}).get(name, config.get(name, default))


def _dflash_refusals(folder: pathlib.Path, config: dict, found: str, tcfg: LlamaConfig) -> None:
    """ValueError for a DFlash variant this project does not implement, or one for another target."""
    body = (config.get("transformer_layer_config") or {}) if found == SPECULATORS_DFLASH else config
    sliding = any(kind != "full_attention" for kind in body.get("layer_types") or [])
    refused = [  # (what, whether the folder has it)
        ("DFlash2's proposal rule", any("DFlash2" in a for a in config.get("architectures") or [])),
        ("causal or sliding-window draft layers",
         sliding or bool(_dflash_value(config, "is_causal")) or bool(config.get("sliding_window_non_causal"))),
        ("drafting from the anchor (sample_from_anchor)", bool(config.get("sample_from_anchor"))),
        ("attention biases", bool(body.get("attention_bias"))),
        ("a reduced draft vocabulary", config.get("draft_vocab_size") not in (None, body.get("vocab_size"))),
    ]
    for what, present in refused:
        if present:
            raise ValueError(f"{folder}: {what} is not supported for DFlash drafters")
    layers = config.get("num_target_layers") if found == ZLAB_DFLASH else None
    if layers not in (None, tcfg.num_layers):
        raise ValueError(f"{folder}: a DFlash drafter for a target of {layers} layers; the target has "
                         f"{tcfg.num_layers}: a drafter for another target")


def _zlab_ids(folder: pathlib.Path, config: dict, num_draft: int, num_layers: int) -> tuple[int, ...]:
    """Our target layers of z-lab's ``target_layer_ids`` (module docstring)."""
    ids = _dflash_value(config, "target_layer_ids") or zlab_layer_ids(num_layers, num_draft)
    if any(not isinstance(i, int) or not 0 <= i < num_layers for i in ids) or len(set(ids)) != len(ids):
        raise ValueError(f"{folder}: the DFlash drafter reads target layers {list(ids)}; the target has {num_layers} "
                         f"layers, so distinct ids in 0..{num_layers - 1}: a drafter for another target")
    return tuple(FINAL_NORM if i == num_layers - 1 else i for i in ids)


def _dflash(folder: pathlib.Path, config: dict, found: str, tcfg: LlamaConfig) -> DFlashDrafter:
    """A `DFlashDrafter` from a z-lab or speculators DFlash folder (module docstring)."""
    _dflash_refusals(folder, config, found, tcfg)
    layer = dataclasses.replace(_layer_config(folder, config, found), qk_norm=True)
    if (layer.vocab_size, layer.hidden_size) != (tcfg.vocab_size, tcfg.hidden_size):
        raise ValueError(f"{folder}: a DFlash drafter for a vocabulary of {layer.vocab_size} and hidden size "
                         f"{layer.hidden_size}; the target has {tcfg.vocab_size} and {tcfg.hidden_size}")
    if found == ZLAB_DFLASH:
        features = _zlab_ids(folder, config, layer.num_layers, tcfg.num_layers)
        block = _dflash_value(config, "block_size", 16)
        softcap = _dflash_value(config, "final_logit_softcapping")
        scales = dict(embedding_scale=float(_dflash_value(config, "input_embedding_scale", 1.0)),
                      logit_scale=float(_dflash_value(config, "output_multiplier", 1.0)),
                      softcap=float(softcap) if softcap is not None and float(softcap) > 0 else None)
    else:
        features, block, scales = _layer_ids(folder, config, found, tcfg.num_layers), config.get("block_size", 8), {}
    mask = _dflash_value(config, "mask_token_id")
    if not isinstance(mask, int):
        raise ValueError(f"{folder}: no mask_token_id in config.json: not a DFlash drafter folder")
    weights = _weights(folder, "pytorch_model.bin")
    fc = _take(weights, "fc.weight", folder)
    if fc.shape[1] != len(features) * tcfg.hidden_size:
        raise ValueError(f"{folder}: fc.weight {fc.shape} reads {len(features)} target states of width "
                         f"{fc.shape[1] / len(features):g}; the target's width is {tcfg.hidden_size}")
    try:
        cfg = DFlashConfig(layer, features, tcfg.hidden_size, int(block), mask, **scales)
    except ValueError as err:
        raise ValueError(f"{folder}: {err}") from None
    arrays = _layer_arrays(weights, layer, [f"layers.{i}." for i in range(layer.num_layers)], folder)
    arrays.update(fc=fc, hidden_norm=_take(weights, "hidden_norm.weight", folder),
                  norm=_take(weights, "norm.weight", folder))
    _check_shapes(folder, arrays, dflash_shapes(cfg))
    return DFlashDrafter(cfg, _float32(arrays))


TORCH_STORAGES = {"FloatStorage": np.float32, "DoubleStorage": np.float64, "HalfStorage": np.float16,
                  "BFloat16Storage": "bfloat16", "LongStorage": np.int64, "IntStorage": np.int32,
                  "ShortStorage": np.int16, "CharStorage": np.int8, "ByteStorage": np.uint8, "BoolStorage": np.bool_}


def read_torch_file(file: pathlib.Path) -> dict[str, np.ndarray]:
    """The tensors of a ``torch.save`` file (a zip: ``<name>/data.pkl`` + one file per storage) without
    torch: the pickle may only rebuild tensors from storages (`_TensorUnpickler`); bfloat16 widened to
    float32. Anything else (an old non-zip file, other objects) is a one-line ValueError: convert the
    checkpoint to safetensors."""
    try:
        with zipfile.ZipFile(file) as archive:
            pickles = [name for name in archive.namelist() if name.endswith("/data.pkl")]
            if len(pickles) != 1:
                raise pickle.UnpicklingError("no data.pkl")
            root = pickles[0][: -len("data.pkl")]
            if archive.read(root + "byteorder").decode().strip() != "little":
                raise pickle.UnpicklingError("big-endian storages")
            with archive.open(pickles[0]) as data:
                state = _TensorUnpickler(data, archive, root).load()
    except (zipfile.BadZipFile, KeyError, pickle.UnpicklingError, ValueError, TypeError, EOFError) as err:
        raise ValueError(f"{file}: not a torch.save file of tensors this reader accepts ({err.__class__.__name__}: "
                         f"{str(err)[:120]}): convert it to safetensors") from None
    if not isinstance(state, dict):
        raise ValueError(f"{file}: holds a {type(state).__name__}, not a state dict: convert it to safetensors")
    return {name: np.asarray(value, np.float32) if value.dtype.name == "bfloat16" else value
            for name, value in state.items()}


class _TensorUnpickler(pickle.Unpickler):
    """Rebuilds ``torch._utils._rebuild_tensor_v2`` calls as numpy arrays over the archive's storages;
    refuses every other global (a pickle can run code: only these names are resolved)."""

    def __init__(self, data, archive: zipfile.ZipFile, root: str):
        super().__init__(data)
        self.archive, self.root, self.storages = archive, root, {}

    def find_class(self, module: str, name: str):
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return _rebuild_tensor
        if (module, name) == ("torch._utils", "_rebuild_parameter"):
            return lambda data, requires_grad, hooks: data
        if (module, name) == ("collections", "OrderedDict"):
            return collections.OrderedDict
        if module == "torch" and name in TORCH_STORAGES:
            return name
        raise pickle.UnpicklingError(f"{module}.{name} is not a tensor storage")

    def persistent_load(self, pid):
        kind, storage, key, _, _ = pid
        if kind != "storage" or storage not in TORCH_STORAGES:
            raise pickle.UnpicklingError(f"persistent id {pid!r}")
        if key not in self.storages:
            import ml_dtypes

            dtype = ml_dtypes.bfloat16 if storage == "BFloat16Storage" else TORCH_STORAGES[storage]
            self.storages[key] = np.frombuffer(self.archive.read(f"{self.root}data/{key}"), dtype)
        return self.storages[key]


def _rebuild_tensor(storage: np.ndarray, offset: int, size, stride, requires_grad=False, hooks=None, metadata=None):
    """``storage[offset:]`` viewed with ``size`` and ``stride`` (in elements), copied."""
    end = offset + sum((n - 1) * s for n, s in zip(size, stride)) + 1 if all(size) else offset
    if end > storage.size:
        raise ValueError(f"a tensor of size {tuple(size)} runs past its storage of {storage.size} elements")
    view = np.lib.stride_tricks.as_strided(storage[offset:], tuple(size), tuple(s * storage.itemsize for s in stride))
    return np.array(view)
