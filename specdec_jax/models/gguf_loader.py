"""Read a llama-architecture GGUF file into a `LlamaConfig` and float32 weight arrays.

Supported tensor types: F32, F16, Q8_0, Q4_0, Q4_1 (dequantized with the `gguf`
package); any other type is an error naming the tensor and its type.
llama.cpp's converter permutes the rows of attn_q / attn_k for its interleaved
RoPE; they are permuted back to the rotate-half order used here (and by
Hugging Face transformers).
"""

from __future__ import annotations

import pathlib

import numpy as np

from specdec_jax.models.llama import LlamaConfig, param_shapes

SUPPORTED_TYPES = ("F32", "F16", "Q8_0", "Q4_0", "Q4_1")

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
    if arch != "llama":
        raise ValueError(f"{path}: architecture {arch!r} is not supported (only 'llama')")
    if check_metadata is not None:
        check_metadata(meta)
    tensors = {t.name: t for t in reader.tensors}
    config = _config(meta, tied="output.weight" not in tensors)

    def load(name: str) -> np.ndarray:
        return _dequantize(tensors[name], path)

    arrays = {"embed": load("token_embd.weight"), "final_norm": load("output_norm.weight")}
    if not config.tie_embeddings:
        arrays["lm_head"] = load("output.weight").T
    for gguf_name, ours in LAYER_TENSORS.items():
        layers = []
        for i in range(config.num_layers):
            w = load(f"blk.{i}.{gguf_name}.weight")  # [out, in] for matrices
            if gguf_name == "attn_q":
                w = unpermute_rope_rows(w, config.num_heads)
            elif gguf_name == "attn_k":
                w = unpermute_rope_rows(w, config.num_kv_heads)
            layers.append(w)
        arrays[ours] = np.stack(layers)
    for name, shape in param_shapes(config).items():
        if arrays[name].shape != shape:
            raise ValueError(f"{path}: {name} has shape {arrays[name].shape}, expected {shape}")
    return config, arrays, meta


def unpermute_rope_rows(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Inverse of llama.cpp's `permute` of q/k rows ([out, in]): interleaved -> rotate-half pairs."""
    half = w.shape[0] // num_heads // 2
    return w.reshape(num_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _config(meta: dict, tied: bool) -> LlamaConfig:
    hidden = int(meta["llama.embedding_length"])
    heads = int(meta["llama.attention.head_count"])
    vocab = meta.get("llama.vocab_size") or len(meta["tokenizer.ggml.tokens"])
    context = meta.get("llama.context_length")
    return LlamaConfig(
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(meta["llama.feed_forward_length"]),
        num_layers=int(meta["llama.block_count"]),
        num_heads=heads,
        num_kv_heads=int(meta.get("llama.attention.head_count_kv", heads)),
        head_dim=int(meta.get("llama.rope.dimension_count", hidden // heads)),
        rope_theta=float(meta.get("llama.rope.freq_base", 10000.0)),
        rms_norm_eps=float(meta.get("llama.attention.layer_norm_rms_epsilon", 1e-5)),
        tie_embeddings=tied,
        max_positions=None if context is None else int(context),
    )


def _dequantize(tensor, path) -> np.ndarray:
    from gguf import quants

    kind = tensor.tensor_type.name
    if kind not in SUPPORTED_TYPES:
        raise ValueError(
            f"{path}: tensor {tensor.name} has type {kind}; supported types: {', '.join(SUPPORTED_TYPES)}"
        )
    return np.asarray(quants.dequantize(tensor.data, tensor.tensor_type), np.float32)


def _field_value(field):
    try:
        return field.contents()
    except Exception:  # fields of unknown layout are not needed here
        return None
