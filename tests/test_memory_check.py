"""The memory check before a generation (engine.batching, docs/cli.md "Bounds"): a shape that cannot fit
is one line on stderr and exit 2 before the decoding loop runs, and the check counts the loop's own
memory (its state and one round's working memory), not only prefill's.

Each test pretends a fixed amount of device memory is free (`batching.free_device_bytes`), except the
one that runs the reported command in a child process on this machine's real free memory.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time

import jax
import pytest

from specdec_jax.cli import main
from specdec_jax.drafters import NgramDrafter
from specdec_jax.engine import batching, generate, generation
from specdec_jax.models import load_model
from specdec_jax.token_tree import MAX_TREE_NODES, TreeShape, default_choices

TINY = ["generate", "--model", "tiny-random", "--raw"]
GiB = 2**30


@pytest.fixture
def free_memory(monkeypatch):
    """Sets the bytes `prepare` sees free on the device (8 GiB until set)."""
    def set_free(nbytes: int):
        monkeypatch.setattr(batching, "free_device_bytes", lambda device=None: nbytes)

    set_free(8 * GiB)
    return set_free


@pytest.fixture
def compiled(caplog):
    """The names of the jitted programs compiled so far in the test (`jax.log_compiles`)."""
    with jax.log_compiles(), caplog.at_level("WARNING"):
        yield lambda: [m.split()[1] for m in (r.getMessage() for r in caplog.records) if m.startswith("Compiling ")]


@pytest.fixture
def prefill_runs(monkeypatch):
    """A list that gets one entry each time a compiled prefill runs."""
    runs, original = [], batching.compiled_prefill

    def counted(*args, **kwargs):
        program = original(*args, **kwargs)
        return lambda *inputs: runs.append(1) or program(*inputs)

    monkeypatch.setattr(batching, "compiled_prefill", counted)
    return runs


def one_error_line(capsys) -> str:
    captured = capsys.readouterr()
    lines = [line for line in captured.err.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in captured.err, captured.err
    return lines[0]


def test_the_reported_gamma_is_refused_in_seconds_as_one_line():
    """`--gamma 100000` used to pass the check and die in the loop allocating 961 GB (exit 1, a traceback);
    here on this machine's real free memory."""
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "specdec_jax.cli", *TINY, "--prompt", "hi", "--gamma", "100000"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("specdec-jax: error: "), done.stderr
    assert "gamma 100000, verify passes of up to 100001 tokens" in lines[0] and "free" in lines[0]
    assert time.perf_counter() - start < 60


def _prompts_file(tmp_path, rows: int) -> str:
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt": "hi"}\n' * rows)
    return str(path)


@pytest.mark.parametrize("case, flags, free, words", [
    ("gamma", ["--gamma", "100000"], 8 * GiB,
     ["the widest verify pass at least", "GiB", "batch 1,", "gamma 100000, verify passes of up to 100001 tokens"]),
    ("tree", ["--drafter", "ngram", "--tree-nodes", "4096", "--tree-depth", "64", "--tree-topk", "64"], 8 * GiB,
     [f"a tree of 4096 nodes is too wide: at most {MAX_TREE_NODES}"]),
    ("batch", ["--batch-size", "1024"], 256 * 2**20,
     ["the decoding state needs 384.0 MiB", "batch 1024,", "but the device has 256.0 MiB free", "or the batch size"]),
])
def test_shapes_that_cannot_fit_are_one_line_before_anything_compiles(case, flags, free, words, free_memory,
                                                                         compiled, capsys, tmp_path):
    free_memory(free)
    if case == "batch":  # 1024 prompts in one batch: 384 MiB of KV cache
        path = tmp_path / "prompts.jsonl"
        path.write_text('{"prompt": "hi"}\n' * 1024)
        flags = ["--prompts-file", str(path), *flags]
    else:
        flags = ["--prompt", "hi", *flags]
    start = time.perf_counter()
    assert main([*TINY, *flags]) == 2
    took = time.perf_counter() - start
    line = one_error_line(capsys)
    assert line.startswith("specdec-jax: error: ") and all(w in line for w in words), line
    assert not {"jit(prefill)", "jit(run_loop)", "jit(draft_step)", "jit(verify_step)"} & set(compiled())
    assert took < 30, took  # loading the model and prompts included; the check itself is arithmetic


def test_the_check_counts_the_decoding_loop(free_memory, compiled, prefill_runs):
    """32 MiB free: enough for prefill and the state (about 2 MiB) and for the shapes' floor (about 10 MiB),
    not for a round verifying 1025 tokens (one layer's attention scores alone are 33 MiB): refused from
    the loop's compiled program, before prefill runs."""
    free_memory(32 * 2**20)
    with pytest.raises(ValueError, match=r"^the decoding loop needs .* gamma 1024, verify passes of up to 1025 "
                                         r"tokens\) but the device has 32\.0 MiB free") as refused:
        generate(load_model("tiny-random"), [[1, 2, 3, 4]], NgramDrafter(), gamma=1024, max_new_tokens=8)
    need = float(re.search(r"needs ([\d.]+) MiB", str(refused.value)).group(1))
    assert need > 32
    assert compiled().count("jit(run_loop)") == 1 and prefill_runs == []


def test_the_checked_loop_program_is_the_one_that_runs(free_memory, compiled, monkeypatch):
    """`generate` compiles `run_loop` for the check before prefill runs; the loop calls then find that
    executable, in chunks or in one call (`CHUNK_S = None`): one compile for both calls."""
    target = load_model("tiny-random")
    first = generate(target, [[5, 6, 7, 5, 6]], NgramDrafter(), gamma=2, max_new_tokens=6, capacity=96)
    monkeypatch.setattr(generation, "CHUNK_S", None)
    second = generate(target, [[5, 6, 7, 5, 6]], NgramDrafter(), gamma=2, max_new_tokens=6, capacity=96)
    assert first.tokens == second.tokens and len(first.tokens[0]) == 6
    names = compiled()
    assert names.count("jit(run_loop)") == 1 and names.count("jit(prefill)") == 1, names


def test_a_deep_wide_default_tree_is_built_best_first():
    """Medusa's default tree of depth 64 and top-64 ranks (64^64 paths) is built without listing them,
    and equals the sorted listing where that is small."""
    import itertools

    for depth, topk in [(1, 3), (3, 2), (4, 3), (2, 5)]:
        paths = sorted((p for d in range(1, depth + 1) for p in itertools.product(range(topk), repeat=d)),
                       key=lambda p: (sum(p), len(p), p))
        for nodes in (1, len(paths) // 2, len(paths)):
            assert default_choices(nodes, depth, topk) == tuple(paths[:nodes])
    start = time.perf_counter()
    tree = default_choices(MAX_TREE_NODES, 64, 64)
    assert time.perf_counter() - start < 1
    assert len(tree) == MAX_TREE_NODES and tree[63] == (0,) * 64  # the all-best chain comes first
    with pytest.raises(ValueError, match="at most 84 nodes, not 85"):
        default_choices(85, 3, 4)
    with pytest.raises(ValueError, match=f"a tree of {MAX_TREE_NODES + 1} nodes is too wide"):
        TreeShape(nodes=MAX_TREE_NODES + 1, depth=4, topk=2)
