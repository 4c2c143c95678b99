"""Read a `llama` or `qwen2` GGUF file into a `LlamaConfig` and float32 weight arrays.

Every tensor type the `gguf` package dequantizes is read (F32, F16, BF16, Q4_0 ..
Q8_0, the K-quants Q2_K .. Q6_K, ...), checked per tensor: one it cannot is an
error naming the tensor and its type. Metadata keys carry the architecture as
prefix (`qwen2.block_count`). `qwen2` adds the q, k, v biases
(`blk.N.attn_q.bias` ...). llama.cpp's converter permutes the rows of attn_q /
attn_k for its interleaved RoPE for `llama` only; they are permuted back to the
rotate-half order used here (and by Hugging Face transformers). `qwen2` rows
are stored in that order already. RoPE scaling is read as llama.cpp applies it (`gguf_rope_scaling`):
the `rope_freqs` tensor (Llama 3.1 / 3.2), linear or yarn; anything else is refused by name.

A bad file is a one-line ValueError naming it, raised before the weights are dequantized: an empty file or
another format (no GGUF magic), a file cut short or corrupt (its header or tensor data cannot be
read), a missing metadata key, a missing tensor or one of another shape than the metadata implies.
"""

from __future__ import annotations

import dataclasses
import pathlib

import numpy as np

from specdec_jax.models.llama import LlamaConfig, param_shapes
from specdec_jax.models.rope import RopeScaling, yarn_attention_factor

GGUF_MAGIC = b"GGUF"  # the first 4 bytes of every GGUF file
ARCHITECTURES = {"llama": dict(permuted_qk=True, attention_bias=False),
                 "qwen2": dict(permuted_qk=False, attention_bias=True)}
BIAS_TENSORS = {"attn_q": "bq", "attn_k": "bk", "attn_v": "bv"}  # blk.N.{name}.bias (attention_bias)

# GGUF tensor name (per block) -> our stacked weight name (matrices stay [out, in], as GGUF stores them).
LAYER_TENSORS = {
    "attn_norm": "attn_norm",
    "attn_q": "wq",
    "attn_k": "wk",
    "attn_v": "wv",
    "attn_output": "wo",
    "ffn_norm": "mlp_norm",
    "ffn_gate": "w_gate",
    "ffn_up": "w_up",
    "ffn_down": "w_down",
}


def read_gguf(path: str | pathlib.Path, check_metadata=None, checked=None) -> tuple[LlamaConfig, dict[str, np.ndarray], dict]:
    """Returns (config, {name: f32 array} in the layout of `param_shapes`, metadata dict).

    `check_metadata(meta)`, if given, runs before the (slow) dequantization; its ValueError (or the
    KeyError of a metadata key it needs) is reported naming the file. `checked()`, if given, runs once
    every check passed, right before the dequantization (a progress line: a bad file prints nothing).
    """
    path = pathlib.Path(path)
    reader = open_gguf(path)
    meta = {name: _field_value(field) for name, field in reader.fields.items()}
    arch = meta.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise ValueError(f"{path}: architecture {arch!r} is not supported ({', '.join(ARCHITECTURES)})")
    if check_metadata is not None:
        try:
            check_metadata(meta)
        except KeyError as err:
            raise ValueError(f"{path}: metadata key {err.args[0]} is missing: {INCOMPLETE}") from None
        except ValueError as err:
            raise ValueError(f"{path}: {err}") from None
    tensors = {t.name: t for t in reader.tensors}
    config = _config(meta, arch, tied="output.weight" not in tensors, path=path)
    try:
        config = dataclasses.replace(config, rope_scaling=gguf_rope_scaling(meta, arch, _rope_freqs(tensors, path)))
    except ValueError as err:
        raise ValueError(f"{path}: {err}") from None
    check_tensors(tensors, config, path)
    if checked is not None:
        checked()
    permuted = ARCHITECTURES[arch]["permuted_qk"]
    arrays = {}
    for ours, names in tensor_names(config).items():
        layers = [_dequantize(tensors[name], path) for name in names]
        if permuted and ours in ("wq", "wk"):
            heads = config.num_heads if ours == "wq" else config.num_kv_heads
            layers = [unpermute_rope_rows(w, heads) for w in layers]
        arrays[ours] = np.stack(layers) if ours in STACKED else layers[0]
    return config, arrays, meta


INCOMPLETE = "the file is incomplete or not a llama.cpp conversion; convert or download it again"
STACKED = {*LAYER_TENSORS.values(), *BIAS_TENSORS.values()}  # our names stacked over the layers


def open_gguf(path: pathlib.Path):
    """A `gguf.GGUFReader` of `path`, or a one-line ValueError naming the file: no such file, empty,
    not a GGUF file (no magic), or a header or tensor data that cannot be read (cut short, corrupt)."""
    from gguf import GGUFReader

    check_magic(path)
    try:
        return GGUFReader(path)
    except Exception as err:  # noqa: BLE001 - numpy errors of a short or corrupt file (reshape, index, ...)
        reason = " ".join(str(err).split())[:200]
        raise ValueError(f"{path}: cannot be read as GGUF ({err.__class__.__name__}: {reason}): the file is "
                         "truncated or corrupt; download or convert it again") from None


def check_magic(path: pathlib.Path) -> None:
    """ValueError unless `path` is a file starting with the 4 bytes `GGUF`: cheap (no header parse),
    so an empty file or another format named .gguf is refused before any conversion starts."""
    if not path.is_file():
        raise ValueError(f"no such GGUF file: {path}")
    with open(path, "rb") as f:
        head = f.read(len(GGUF_MAGIC))
    if not head:
        raise ValueError(f"{path}: empty file, not a GGUF model: download or convert it again")
    if head != GGUF_MAGIC:
        raise ValueError(f"{path}: not a GGUF file (it starts with {head!r}, not {GGUF_MAGIC!r}): "
                         "pass a .gguf model written by llama.cpp")


def tensor_names(config: LlamaConfig) -> dict[str, list[str]]:
    """Our weight name -> the GGUF tensors it is read from (one per layer for stacked weights), for `config`."""
    names = {"embed": ["token_embd.weight"], "final_norm": ["output_norm.weight"]}
    if not config.tie_embeddings:
        names["lm_head"] = ["output.weight"]
    for gguf_name, ours in LAYER_TENSORS.items():
        names[ours] = [f"blk.{i}.{gguf_name}.weight" for i in range(config.num_layers)]
    if config.attention_bias:
        for gguf_name, ours in BIAS_TENSORS.items():
            names[ours] = [f"blk.{i}.{gguf_name}.bias" for i in range(config.num_layers)]
    return names


def check_tensors(tensors: dict, config: LlamaConfig, path: pathlib.Path) -> None:
    """ValueError naming the file and the first missing tensor, or one whose shape (`[out, in]`) is
    not the one `config` (from the metadata) implies, before anything is dequantized."""
    wanted = tensor_names(config)
    names = [name for group in wanted.values() for name in group]
    missing = [name for name in names if name not in tensors]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise ValueError(f"{path}: tensor {missing[0]} is missing{more}: {INCOMPLETE}")
    shapes = param_shapes(config)
    for ours, group in wanted.items():
        expected = shapes[ours][1:] if ours in STACKED else shapes[ours]  # one layer of a stacked weight
        for name in group:
            shape = tuple(int(n) for n in reversed(tensors[name].shape))  # GGUF lists dimensions innermost first
            if shape != expected:
                raise ValueError(f"{path}: tensor {name} has shape {shape}, expected {expected} from the "
                                 f"metadata: {INCOMPLETE}")


def unpermute_rope_rows(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Inverse of llama.cpp's `permute` of q/k rows ([out, in]): interleaved -> rotate-half pairs."""
    half = w.shape[0] // num_heads // 2
    return w.reshape(num_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _config(meta: dict, arch: str, tied: bool, path: pathlib.Path) -> LlamaConfig:
    """The `LlamaConfig` of the `ARCH.*` metadata; a missing key or an impossible config is a ValueError
    naming the file."""

    def get(name: str, default=None):
        key = f"{arch}.{name}"  # metadata keys carry the architecture
        if meta.get(key) is not None:
            return meta[key]
        if default is None:
            raise ValueError(f"{path}: metadata key {key} is missing: {INCOMPLETE}")
        return default

    hidden, heads = int(get("embedding_length")), int(get("attention.head_count"))
    tokens = meta.get("tokenizer.ggml.tokens")
    context = meta.get(f"{arch}.context_length")
    sizes = dict(  # read first: a missing key is its own message
        vocab_size=int(get("vocab_size", len(tokens) if tokens else None)),
        hidden_size=hidden,
        intermediate_size=int(get("feed_forward_length")),
        num_layers=int(get("block_count")),
        num_heads=heads,
        num_kv_heads=int(get("attention.head_count_kv", heads)),
        head_dim=int(get("rope.dimension_count", hidden // max(heads, 1))),
        rope_theta=float(get("rope.freq_base", 10000.0)),
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-5)),
        max_positions=None if context is None else int(context),
    )
    try:
        return LlamaConfig(**sizes, tie_embeddings=tied, attention_bias=ARCHITECTURES[arch]["attention_bias"])
    except ValueError as err:  # LlamaConfig's checks (positive sizes, heads a multiple of kv heads, ...)
        raise ValueError(f"{path}: the metadata describes no valid model ({err})") from None


ROPE_FREQS = "rope_freqs.weight"  # llama.cpp: f32[D/2] divisors of the inverse frequencies (llama3 scaling)
# `ARCH.rope.scaling.*` keys read: the type, and per type the keys it needs (-> `RopeScaling` field) or may have.
ROPE_SCALING_KEYS = {"linear": ({"factor": "factor"}, {}),
                     "yarn": ({"factor": "factor", "original_context_length": "original_max_positions"},
                              {"yarn_beta_fast": "beta_fast", "yarn_beta_slow": "beta_slow"})}
ROPE_SCALING_IGNORED = ("type", "finetuned")  # finetuned: a note, no part of the computation


def gguf_rope_scaling(meta: dict, arch: str, freq_factors: np.ndarray | None) -> RopeScaling | None:
    """The RoPE scaling of a GGUF file as llama.cpp applies it: the `ROPE_FREQS` tensor (``freq_factors``,
    f32[D/2]) with scaling type none, or ``ARCH.rope.scaling.type`` linear (its factor) or yarn (its
    factor, original context length and optional betas; the attention factor yarn's default, which
    llama.cpp applies too). A ValueError names what is not: another type, another
    ``rope.scaling`` key (attn_factor, yarn_ext_factor, ...), or rope_freqs with a scaling type."""
    prefix = f"{arch}.rope.scaling."
    kind = meta.get(prefix + "type") or "none"
    if kind == "none":
        if freq_factors is None:
            return None
        return RopeScaling("rope_freqs", freq_factors=tuple(float(f) for f in freq_factors))
    if kind not in ROPE_SCALING_KEYS:
        raise ValueError(f"{prefix}type = {kind!r} is not supported by this decoder (none, "
                         f"{', '.join(ROPE_SCALING_KEYS)})")
    if freq_factors is not None:
        raise ValueError(f"tensor {ROPE_FREQS} together with {prefix}type = {kind!r} is not supported by this decoder")
    needed, optional = ROPE_SCALING_KEYS[kind]
    present = {key[len(prefix):] for key in meta if key.startswith(prefix)}
    other = sorted(present - set(needed) - set(optional) - set(ROPE_SCALING_IGNORED))
    if other:
        raise ValueError(f"{prefix}{other[0]} is not supported by this decoder (rope scaling {kind!r})")
    fields = {}
    for key, field in {**needed, **optional}.items():
        if meta.get(prefix + key) is None:
            if key in needed:
                raise ValueError(f"metadata key {prefix}{key} is missing: rope scaling {kind!r} needs it")
            continue
        fields[field] = int(meta[prefix + key]) if field == "original_max_positions" else float(meta[prefix + key])
    if kind == "yarn":
        fields["attention_factor"] = yarn_attention_factor(fields["factor"], None, None)
    return RopeScaling(kind, **fields)


def _rope_freqs(tensors: dict, path: pathlib.Path) -> np.ndarray | None:
    """f32[n] of the `ROPE_FREQS` tensor, or None when the file has none."""
    return _dequantize(tensors[ROPE_FREQS], path).reshape(-1) if ROPE_FREQS in tensors else None


def _dequantize(tensor, path) -> np.ndarray:
    from gguf import quants

    try:
        data = np.array(tensor.data)  # off the memmap: slicing a memmap per row group costs ~3x the dequantization
        return np.asarray(quants.dequantize(data, tensor.tensor_type), np.float32)
    except NotImplementedError:
        raise ValueError(f"{path}: tensor {tensor.name} has type {tensor.tensor_type.name}, which the gguf "
                         f"package cannot dequantize") from None


def _field_value(field):
    try:
        return field.contents()
    except Exception:  # fields of unknown layout are not needed here
        return None
