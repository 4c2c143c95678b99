"""Read a `llama` or `qwen2` GGUF file into a `LlamaConfig` and float32 weight arrays.

Every tensor type the `gguf` package dequantizes is read (F32, F16, BF16, Q4_0 ..
Q8_0, the K-quants Q2_K .. Q6_K, ...), checked per tensor: one it cannot is an
error naming the tensor and its type. Metadata keys carry the architecture as
prefix (`qwen2.block_count`). `qwen2` adds the q, k, v biases
(`blk.N.attn_q.bias` ...). llama.cpp's converter permutes the rows of attn_q /
attn_k for its interleaved RoPE for `llama` only; they are permuted back to the
rotate-half order used here (and by Hugging Face transformers). `qwen2` rows
are stored in that order already.
"""

from __future__ import annotations

import pathlib

import numpy as np

from specdec_jax.models.llama import LlamaConfig, param_shapes

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


def read_gguf(path: str | pathlib.Path, check_metadata=None) -> tuple[LlamaConfig, dict[str, np.ndarray], dict]:
    """Returns (config, {name: f32 array} in the layout of `param_shapes`, metadata dict).

    `check_metadata(meta)`, if given, runs before the (slow) dequantization.
    """
    from gguf import GGUFReader

    path = pathlib.Path(path)
    if not path.is_file():
        raise ValueError(f"no such GGUF file: {path}")
    reader = GGUFReader(path)
    meta = {name: _field_value(field) for name, field in reader.fields.items()}
    arch = meta.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise ValueError(f"{path}: architecture {arch!r} is not supported ({', '.join(ARCHITECTURES)})")
    if check_metadata is not None:
        check_metadata(meta)
    tensors = {t.name: t for t in reader.tensors}
    config = _config(meta, arch, tied="output.weight" not in tensors)
    permuted = ARCHITECTURES[arch]["permuted_qk"]

    def load(name: str) -> np.ndarray:
        return _dequantize(tensors[name], path)

    arrays = {"embed": load("token_embd.weight"), "final_norm": load("output_norm.weight")}
    if not config.tie_embeddings:
        arrays["lm_head"] = load("output.weight")  # [V, H]
    for gguf_name, ours in LAYER_TENSORS.items():
        layers = []
        for i in range(config.num_layers):
            w = load(f"blk.{i}.{gguf_name}.weight")  # [out, in] for matrices
            if permuted and gguf_name == "attn_q":
                w = unpermute_rope_rows(w, config.num_heads)
            elif permuted and gguf_name == "attn_k":
                w = unpermute_rope_rows(w, config.num_kv_heads)
            layers.append(w)
        arrays[ours] = np.stack(layers)
    if config.attention_bias:
        for gguf_name, ours in BIAS_TENSORS.items():
            arrays[ours] = np.stack([load(f"blk.{i}.{gguf_name}.bias") for i in range(config.num_layers)])
    for name, shape in param_shapes(config).items():
        if arrays[name].shape != shape:
            raise ValueError(f"{path}: {name} has shape {arrays[name].shape}, expected {shape}")
    return config, arrays, meta


def unpermute_rope_rows(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Inverse of llama.cpp's `permute` of q/k rows ([out, in]): interleaved -> rotate-half pairs."""
    half = w.shape[0] // num_heads // 2
    return w.reshape(num_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _config(meta: dict, arch: str, tied: bool) -> LlamaConfig:
    key = lambda name: f"{arch}.{name}"  # noqa: E731  (metadata keys carry the architecture)
    hidden = int(meta[key("embedding_length")])
    heads = int(meta[key("attention.head_count")])
    vocab = meta.get(key("vocab_size")) or len(meta["tokenizer.ggml.tokens"])
    context = meta.get(key("context_length"))
    return LlamaConfig(
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(meta[key("feed_forward_length")]),
        num_layers=int(meta[key("block_count")]),
        num_heads=heads,
        num_kv_heads=int(meta.get(key("attention.head_count_kv"), heads)),
        head_dim=int(meta.get(key("rope.dimension_count"), hidden // heads)),
        rope_theta=float(meta.get(key("rope.freq_base"), 10000.0)),
        rms_norm_eps=float(meta.get(key("attention.layer_norm_rms_epsilon"), 1e-5)),
        tie_embeddings=tied,
        max_positions=None if context is None else int(context),
        attention_bias=ARCHITECTURES[arch]["attention_bias"],
    )


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
