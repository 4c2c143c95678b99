"""Bad model files: each load fails with one line naming the file (and the key, tensor or shard) and
the fix, through the Python API and the CLI (exit 2, no traceback), and leaves no converted-cache entry.

The files are test_loading.py's tiny models (its GGUF and Hugging Face directory writers), then broken.
"""

from __future__ import annotations

import json
import pathlib
import re

import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import save_file

from specdec_jax.cli import main
from specdec_jax.models import gguf_loader, load_model
from specdec_jax.models.loading import HF_INDEX, HF_SIZES
from test_loading import (cache_entries, params_np, weights,  # noqa: F401 (weights: a fixture)
                          write_gguf, write_hf_dir)

SHARD_1, SHARD_2 = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"  # write_hf_dir's shards


def load_error(path: pathlib.Path) -> str:
    """The message of the ValueError `load_model(path)` raises; it is one line."""
    with pytest.raises(ValueError) as err:
        load_model(str(path))
    message = str(err.value)
    assert "\n" not in message, message
    return message


def cli_error(path: pathlib.Path, capsys) -> str:
    """The one stderr line of `specdec-jax generate --model PATH`, which exits 2 without a traceback."""
    assert main(["generate", "--model", str(path), "--prompt", "hi", "--max-new-tokens", "2"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    [line] = err.splitlines()
    assert line.startswith("specdec-jax: error: "), line
    return line


# ---------------------------------------------------------------- GGUF files


@pytest.fixture(scope="module")
def gguf_bytes(weights, tmp_path_factory) -> bytes:
    return write_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf", weights).read_bytes()


def without(weights: dict, name: str) -> dict:
    return {k: w for k, w in weights.items() if k != name}


BAD_GGUF = {  # name -> (the file's bytes, or weights to write, from the good file's; what the error says)
    "cut in half": (lambda good, w: good[: len(good) // 2],
                    r"cannot be read as GGUF \(ValueError: cannot reshape .*\): the file is truncated or corrupt"),
    "cut in the header": (lambda good, w: good[:200], r"cannot be read as GGUF \(IndexError: .*truncated or corrupt"),
    "cut by one byte": (lambda good, w: good[:-1], r"cannot be read as GGUF .*truncated or corrupt"),
    "empty": (lambda good, w: b"", r"empty file, not a GGUF model: download or convert it again"),
    "random bytes": (lambda good, w: np.random.default_rng(0).bytes(4096),
                     r"not a GGUF file \(it starts with b'.*', not b'GGUF'\): pass a \.gguf model written by llama\.cpp"),
    "a missing tensor": (lambda good, w: without(w, "blk.1.ffn_up.weight"),
                         r"tensor blk\.1\.ffn_up\.weight is missing: the file is incomplete"),
    "missing tensors": (lambda good, w: without(without(w, "blk.0.attn_q.weight"), "output_norm.weight"),
                        r"tensor output_norm\.weight is missing \(and 1 more\)"),
    "a transposed tensor": (lambda good, w: {**w, "blk.0.ffn_down.weight": np.ascontiguousarray(w["blk.0.ffn_down.weight"].T)},
                            r"tensor blk\.0\.ffn_down\.weight has shape \(64, 32\), expected \(32, 64\) from the metadata"),
}


def bad_gguf(path: pathlib.Path, case: str, good: bytes, weights: dict) -> pathlib.Path:
    made = BAD_GGUF[case][0](good, weights)
    if isinstance(made, bytes):
        path.write_bytes(made)
        return path
    return write_gguf(path, made)


@pytest.mark.parametrize("case", BAD_GGUF)
def test_bad_gguf_is_one_line_naming_the_file_and_caches_nothing(tmp_path, cache, gguf_bytes, weights, case):
    path = bad_gguf(tmp_path / "bad.gguf", case, gguf_bytes, weights)
    message = load_error(path)
    assert message.startswith(f"{path}: ") and re.search(BAD_GGUF[case][1], message), message
    assert cache_entries(cache) == []  # no entry, no .partial: the conversion raised before publishing


@pytest.mark.parametrize("case", ["empty", "random bytes"])
def test_bad_gguf_through_the_cli(tmp_path, cache, gguf_bytes, weights, capsys, case):
    """Refused before the converted cache is touched: no progress line, not even a lock file."""
    path = bad_gguf(tmp_path / "bad.gguf", case, gguf_bytes, weights)
    line = cli_error(path, capsys)
    assert line.startswith(f"specdec-jax: error: {path}: ") and re.search(BAD_GGUF[case][1], line), line
    assert not (cache / "converted").exists()


BAD_ROPE = {  # name -> (llama.rope.scaling.* keys, rope_freqs tensor or None, what the error says)
    "another type": ({"type": "longrope", "factor": 4.0}, None,
                     r"llama\.rope\.scaling\.type = 'longrope' is not supported by this decoder \(none, linear, yarn\)$"),
    "another key": ({"type": "yarn", "factor": 4.0, "original_context_length": 512, "yarn_ext_factor": 0.5}, None,
                    r"llama\.rope\.scaling\.yarn_ext_factor is not supported by this decoder \(rope scaling 'yarn'\)$"),
    "no factor": ({"type": "linear"}, None,
                  r"metadata key llama\.rope\.scaling\.factor is missing: rope scaling 'linear' needs it$"),
    "rope_freqs and a type": ({"type": "linear", "factor": 2.0}, [1.0, 1.0, 2.0, 8.0],
                              r"tensor rope_freqs\.weight together with llama\.rope\.scaling\.type = 'linear' is "
                              r"not supported by this decoder$"),
    "rope_freqs of another size": ({}, [1.0, 2.0, 8.0], r"rope_freqs has 3 factors, head_dim 8 needs 4$"),
}


@pytest.mark.parametrize("case", BAD_ROPE)
def test_gguf_rope_scaling_it_cannot_compute_is_refused_by_name(tmp_path, cache, weights, case):
    rope, freqs, pattern = BAD_ROPE[case]
    made = weights if freqs is None else {**weights, "rope_freqs.weight": np.asarray(freqs, np.float32)}
    path = write_gguf(tmp_path / "rope.gguf", made, rope=rope)
    message = load_error(path)
    assert message.startswith(f"{path}: ") and re.search(pattern, message), message
    assert cache_entries(cache) == []


def test_gguf_rope_scaling_refused_through_the_cli(tmp_path, cache, weights, capsys):
    path = write_gguf(tmp_path / "rope.gguf", weights, rope=BAD_ROPE["another type"][0])
    line = cli_error(path, capsys)
    assert line.startswith(f"specdec-jax: error: {path}: ") and re.search(BAD_ROPE["another type"][2], line), line


def test_gguf_missing_metadata_key_names_it(tmp_path):
    meta = {"llama.embedding_length": 32, "llama.attention.head_count": 4, "llama.vocab_size": 263,
            "llama.block_count": 2}  # no llama.feed_forward_length
    with pytest.raises(ValueError, match=r"^\S+x\.gguf: metadata key llama\.feed_forward_length is missing: the "
                                         r"file is incomplete"):
        gguf_loader._config(meta, "llama", tied=True, path=tmp_path / "x.gguf")


# ---------------------------------------------------------------- Hugging Face directories


@pytest.fixture(scope="module")
def draft():
    return load_model("tiny-random-draft")


@pytest.fixture
def hf_dir(tmp_path, draft) -> pathlib.Path:
    return write_hf_dir(tmp_path / "hf", draft)


def write_index(path: pathlib.Path, moved: dict[str, str] | None = None) -> dict[str, str]:
    """`HF_INDEX` mapping each weight to the shard holding it (`moved`: weight -> another shard), as
    transformers writes it; returns the weight map."""
    weight_map = {}
    for shard in (SHARD_1, SHARD_2):
        with safe_open(path / shard, "np") as f:
            weight_map.update({name: shard for name in f.keys()})
    weight_map.update(moved or {})
    (path / HF_INDEX).write_text(json.dumps({"metadata": {"total_size": 0}, "weight_map": weight_map}))
    return weight_map


def edit_config(path: pathlib.Path, **change) -> None:
    """config.json with `change` applied; a value of None removes the key."""
    config = {**json.loads((path / "config.json").read_text()), **change}
    (path / "config.json").write_text(json.dumps({k: v for k, v in config.items() if v is not None}))


def truncate(file: pathlib.Path) -> None:
    data = file.read_bytes()
    file.write_bytes(data[: len(data) // 2])


def missing_shard(path: pathlib.Path) -> str:
    weight_map = write_index(path)
    (path / SHARD_2).unlink()
    first = next(name for name, shard in weight_map.items() if shard == SHARD_2)
    return (rf"^{re.escape(str(path / SHARD_2))}: missing, but {re.escape(HF_INDEX)} maps \d+ weights to it "
            rf"\({re.escape(first)}, \.\.\.\): download the shard again$")


def weight_in_another_shard(path: pathlib.Path) -> str:
    with safe_open(path / SHARD_2, "np") as f:
        name = sorted(f.keys())[0]
    write_index(path, moved={name: SHARD_1})
    return (rf"^{re.escape(str(path / HF_INDEX))}: maps weight {re.escape(name)} to {re.escape(SHARD_1)}, "
            r"which does not hold it: the index and the shards are of different checkpoints")


def config_not_json(path: pathlib.Path) -> str:
    (path / "config.json").write_text('{"model_type": "llama",\n "vocab_size": }')
    return (rf"^{re.escape(str(path / 'config.json'))}: not valid JSON \(Expecting value at line 2 column 16\): "
            r"fix the file or download it again$")


def truncated_safetensors(path: pathlib.Path) -> str:
    truncate(path / SHARD_1)
    return (rf"^{re.escape(str(path / SHARD_1))}: not a readable safetensors file \(SafetensorError: .*\): it is "
            r"truncated or corrupt; download it again$")


def truncated_indexed_shard(path: pathlib.Path) -> str:
    write_index(path)
    return truncated_safetensors(path)


def index_without_weight_map(path: pathlib.Path) -> str:
    (path / HF_INDEX).write_text(json.dumps({"metadata": {}}))
    return rf"^{re.escape(str(path / HF_INDEX))}: no weight_map \(a JSON object of weight name -> \*\.safetensors"


def size_not_an_int(path: pathlib.Path) -> str:
    edit_config(path, num_hidden_layers="2")
    return rf"^{re.escape(str(path / 'config.json'))}: num_hidden_layers must be a positive integer, got '2'$"


def kv_heads_not_dividing(path: pathlib.Path) -> str:
    edit_config(path, num_key_value_heads=3)
    return rf"^{re.escape(str(path / 'config.json'))}: num_heads \(4\) must be a multiple of num_kv_heads \(3\)$"


def weight_of_another_shape(path: pathlib.Path) -> str:
    edit_config(path, intermediate_size=96)
    return (rf"^{re.escape(str(path))}: weight model\.layers\.0\.mlp\.gate_proj\.weight has shape \(128, 64\), "
            r"expected \(96, 64\) from config\.json$")


def rope_scaling_dynamic(path: pathlib.Path) -> str:
    edit_config(path, rope_scaling={"type": "dynamic", "factor": 2.0})
    return (rf"^{re.escape(str(path / 'config.json'))}: rope scaling = \{{'type': 'dynamic', 'factor': 2\.0\}} is not "
            r"supported by this decoder \(model_type 'llama'\)$")


def rope_scaling_unknown(path: pathlib.Path) -> str:
    edit_config(path, rope_scaling=None, rope_parameters={"rope_type": "su", "factor": 2.0, "rope_theta": 1e4})
    return (rf"^{re.escape(str(path / 'config.json'))}: rope scaling = \{{'rope_type': 'su', 'factor': 2\.0\}} is not "
            r"supported by this decoder \(model_type 'llama'\)$")


def rope_parameter_missing(path: pathlib.Path) -> str:
    edit_config(path, rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                    "original_max_position_embeddings": 16})
    return (rf"^{re.escape(str(path / 'config.json'))}: rope scaling 'llama3' needs high_freq_factor \(a number\): "
            r"add it to rope_scaling$")


def tokenizer_not_readable(path: pathlib.Path) -> str:
    (path / "tokenizer.json").write_text("{}")
    return rf"^{re.escape(str(path / 'tokenizer.json'))}: not a tokenizer the tokenizers package reads \(.*\): download"


BAD_HF = {f.__name__.replace("_", " "): f for f in (
    missing_shard, weight_in_another_shard, config_not_json, truncated_safetensors, truncated_indexed_shard,
    index_without_weight_map, size_not_an_int, kv_heads_not_dividing, weight_of_another_shape,
    rope_scaling_dynamic, rope_scaling_unknown, rope_parameter_missing, tokenizer_not_readable)}


@pytest.mark.parametrize("case", BAD_HF)
def test_bad_hf_directory_is_one_line_naming_the_file(hf_dir, case):
    pattern = BAD_HF[case](hf_dir)
    assert re.search(pattern, load_error(hf_dir)), (pattern, load_error(hf_dir))


@pytest.mark.parametrize("key", HF_SIZES)
def test_config_without_a_required_key_names_the_file_and_the_key(hf_dir, key):
    edit_config(hf_dir, **{key: None})
    assert load_error(hf_dir) == (f"{hf_dir / 'config.json'}: the key {key} is missing: add it (a positive "
                                  "integer) from the model's original config.json")


@pytest.mark.parametrize("case", ["missing shard", "config not json", "truncated safetensors", "rope scaling dynamic",
                                  "rope scaling unknown"])
def test_bad_hf_directory_through_the_cli(hf_dir, capsys, case):
    pattern = BAD_HF[case](hf_dir).replace("^", "^specdec-jax: error: ", 1)
    line = cli_error(hf_dir, capsys)
    assert re.search(pattern, line), (pattern, line)


def test_config_without_a_required_key_through_the_cli(hf_dir, capsys):
    edit_config(hf_dir, num_attention_heads=None)
    line = cli_error(hf_dir, capsys)
    assert line.startswith(f"specdec-jax: error: {hf_dir / 'config.json'}: the key num_attention_heads is missing")


def test_index_reads_exactly_its_shards(hf_dir, draft):
    """With an index, a stray *.safetensors beside the shards is not part of the checkpoint: not read,
    not merged in. Without one, every *.safetensors file is (a stray there overrides the shards)."""
    save_file({"model.norm.weight": np.zeros(draft.config.hidden_size, np.float32)},
              str(hf_dir / "zz-stray.safetensors"))
    assert not params_np(load_model(str(hf_dir)))["final_norm"].any()  # no index: merged in
    write_index(hf_dir)
    (hf_dir / "garbage.safetensors").write_bytes(b"not safetensors")
    got, want = params_np(load_model(str(hf_dir))), params_np(draft)
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)
