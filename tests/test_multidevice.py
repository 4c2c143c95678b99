"""Multi-device and multi-host generation (specdec_jax.sharding).

The pytest process sees one CPU device, so the multi-device checks run in
subprocesses (marker `multidevice`, never skipped): `multidevice_worker.py`
with 8 CPU devices, which returns every mesh's outputs as JSON in one process
(compiles dominate: one process per mesh would pay the startup and the shared
compiles again), and `specdec-jax generate` as 2 processes on 127.0.0.1.

In the default suite: the one-device reference and the 2x4 mesh (both axes
sharded, model = 4) for the n-gram drafter (greedy), the draft model and the
EAGLE head (greedy and sampled rows), and the runner on 1x4 and 1x8 meshes, which
replicate the KV heads (a target of 2, a draft model of 1), about 60 s on a
loaded 2-core machine. With `-m slow`: every mesh (8x1, 4x2, 2x4, 1x1) and
every drafter, about 4 minutes, and the 2-process launch.
"""

from __future__ import annotations

import json
import os
import pathlib
import socket
import subprocess
import sys

import jax
import pytest
from jax.sharding import PartitionSpec as P

from specdec_jax import engine, sharding
from specdec_jax.cli import main

import engine_helpers as h

ROOT = pathlib.Path(__file__).resolve().parent.parent
WORKER = ROOT / "tests" / "multidevice_worker.py"


def cpu_env(num_devices: int) -> dict[str, str]:
    """The environment of a subprocess that sees `num_devices` CPU devices and this checkout."""
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if "device_count" not in f]  # conftest's kept
    return {**os.environ, "PYTHONPATH": path, "JAX_PLATFORMS": "cpu",
            "XLA_FLAGS": " ".join(flags + [f"--xla_force_host_platform_device_count={num_devices}"])}


def run_worker(meshes: list[str], cases: str | None = None) -> dict:
    command = [sys.executable, str(WORKER), *meshes] + (["--cases", cases] if cases else [])
    done = subprocess.run(command, env=cpu_env(8), capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def assert_meshes_agree(report: dict) -> None:
    assert report["devices"] == 8
    reference = report["meshes"]["data=1"]
    for mesh, outputs in report["meshes"].items():
        for case, out in outputs.items():
            if case != "shardings":
                assert out == reference[case], f"{mesh} {case}: {out} != {reference[case]}"
        if mesh != "data=1":
            model = "'model'" if "model" in mesh else ""
            cache = f"P('data', {model})" if model else "P('data',)"
            assert outputs["shardings"] == {
                "cache_before": [cache], "cache_after": [cache],
                "tokens_before": ["P('data',)"], "tokens_after": ["P('data',)"],
                "wq": ["P('model', None)"], "wo": ["P(None, 'model')"],
            }, mesh
    assert_kv_heads_replicated(report)


def assert_kv_heads_replicated(report: dict) -> None:
    """The runner on model axes beyond the KV heads (2 of the target, 1 of the draft model) gives
    the tokens of one device (plain decoding); a model axis that no replication helps is refused,
    naming the sizes that work, and so is a target whose KV heads were not replicated."""
    runs = report["replicated_kv_heads"]
    reference = runs["data=1"]["tokens"]
    assert len(reference) == 8 and all(reference)
    for mesh, out in runs.items():
        assert out["tokens"] == reference, f"{mesh}: {out['tokens']} != {reference}"
    assert list(runs) == ["data=1", "data=1,model=4", "data=1,model=8"]
    assert runs["data=1,model=4"]["kv_heads"] == 4 and runs["data=1,model=8"]["kv_heads"] == 8
    assert runs["data=1,model=4"]["wk"] == runs["data=1,model=8"]["wk"] == ["P('model', None)"]
    assert report["errors"]["indivisible"].startswith(
        "mesh axis model=3 does not divide num_heads = 4 of the target (num_heads 4, num_kv_heads 2, "
        "intermediate_size 256): model must divide num_heads and intermediate_size (1, 2, 4)")
    assert report["errors"]["unreplicated"].startswith(
        "mesh axis model=4 does not divide num_kv_heads = 2 of the target (num_heads 4, num_kv_heads 2, "
        "intermediate_size 256): replicate its KV heads to 4 first")


@pytest.mark.multidevice
def test_two_by_four_mesh_matches_one_device():
    assert_meshes_agree(run_worker(["data=1", "data=2,model=4"], cases="eagle-mixed,draft-model-constrained-mixed"))


@pytest.mark.multidevice
@pytest.mark.slow
def test_every_mesh_and_drafter_matches_one_device():
    assert_meshes_agree(run_worker(["data=1", "data=8", "data=4,model=2", "data=2,model=4"]))


# ---------------------------------------------------------------- 2 processes on 127.0.0.1

MULTIHOST_ARGS = ["generate", "--model", "tiny-random", "--raw", "--max-new-tokens", "8", "--batch-size", "2",
                  "--drafter", "ngram", "--temperature", "0.8", "--seed", "3",
                  "--prompt", "hello hello", "--prompt", "abcabcab"]


def glog_errors(stderr: str) -> str:
    """The error and fatal lines of a process's XLA log (they name the failing task), else its tail."""
    lines = [line for line in stderr.splitlines() if line[:1] in "EF" and line[1:5].isdigit()]
    return "\n".join(lines)[:3000] or stderr[-2000:]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.multidevice
@pytest.mark.slow
def test_two_processes_match_one(tmp_path, capsys):
    """Two processes with 2 CPU devices each, mesh data=2,model=2 (data across the processes),
    started with --coordinator-address / --num-processes / --process-id: each writes the same
    tokens as one process on one device. Both start from an empty cache, so both calibrate
    gamma "auto": they must decide with process 0's costs (each process's own clock gives other
    costs, other compiled constants, and the processes once hung in mismatched collectives
    until the shutdown barrier aborted them)."""
    address = f"127.0.0.1:{free_port()}"
    env = {**cpu_env(2), "SPECDEC_CACHE": str(tmp_path / "cache")}
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "specdec_jax.cli", *MULTIHOST_ARGS, "--mesh", "data=2,model=2",
             "--coordinator-address", address, "--num-processes", "2", "--process-id", str(i),
             "--json", str(tmp_path / f"process{i}.json")],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for i in range(2)
    ]
    try:
        logs = [p.communicate(timeout=600) for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert [p.returncode for p in procs] == [0, 0], [glog_errors(err) for _, err in logs]

    assert main([*MULTIHOST_ARGS, "--json", str(tmp_path / "single.json")]) == 0
    capsys.readouterr()
    reports = [json.loads((tmp_path / f"{name}.json").read_text()) for name in ("single", "process0", "process1")]
    assert "calibrating shapes" in logs[0][0] and "calibrating shapes" in logs[1][0]
    assert reports[1]["shape_policies"] == reports[2]["shape_policies"]
    assert reports[1]["shape_policies"][0]["gammas"] == [0, 1, 2, 3, 4]
    tokens = [[r["tokens"] for r in report["results"]] for report in reports]
    assert tokens[0] == tokens[1] == tokens[2]
    assert all(len(t) == 8 or t[-1] == 257 for t in tokens[0])


# ---------------------------------------------------------------- in process: parsing, rules, errors


CLI = ["generate", "--model", "tiny-random", "--raw", "--prompt", "x"]


@pytest.mark.parametrize("text, sizes", [
    ("data=4,model=2", {"data": 4, "model": 2}),
    (" model = 2 ", {"data": 1, "model": 2}),
    ("data=8", {"data": 8, "model": 1}),
])
def test_parse_mesh(text, sizes):
    assert sharding.parse_mesh(text) == sizes


@pytest.mark.parametrize("text", ["data=4,x=2", "data=4;model=2", "data=0", "data=2,data=2", "data", "", "model=-1"])
def test_malformed_mesh_is_one_line_exit_2(capsys, text):
    assert main([*CLI, "--mesh", text]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"mesh {text!r} is not of the form 'data=N,model=M'" in err[0]


def test_mesh_that_does_not_divide_the_batch_size_is_an_error(capsys):
    assert main([*CLI, "--batch-size", "6", "--mesh", "data=4,model=2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["specdec-jax: error: flags: mesh 'data=4,model=2': the data axis (4) does not divide "
                   "batch_size 6"]


def test_mesh_in_yaml_must_be_a_string(tmp_path, capsys):
    config = tmp_path / "run.yaml"
    config.write_text("mesh: 4\n")
    assert main([*CLI, "--config", str(config)]) == 2
    assert f"{config}: mesh must be a string or null (e.g. 'data=4,model=2'), got 4" in capsys.readouterr().err


def test_mesh_larger_than_the_devices_is_an_error(capsys):
    assert main([*CLI, "--mesh", "data=1,model=16"]) == 2
    assert "mesh data=1,model=16 needs 16 devices, jax sees 1" in capsys.readouterr().err


def test_bench_and_demo_refuse_a_mesh(capsys):
    for command in ("bench", "demo"):
        assert main([command, "--model", "tiny-random", "--mesh", "data=1"]) == 2
        assert f"{command} times one device: --mesh is for generate and sweep" in capsys.readouterr().err


def test_sharding_rules():
    mesh = sharding.make_mesh("data=1")
    assert mesh.shape == {"data": 1, "model": 1}
    assert sharding.param_spec("wq", 2) == P("model", None) and sharding.param_spec("wq", 3) == P(None, "model", None)
    assert sharding.param_spec("w_down", 2) == P(None, "model") and sharding.param_spec("wo", 3) == P(None, None, "model")
    assert sharding.param_spec("embed", 2) == P() and sharding.param_spec("final_norm", 1) == P()
    target, drafter = h.target(), h.model_drafter()
    state = engine.prepare(target, h.RAGGED, drafter, gamma=h.GAMMA).state
    specs = sharding.state_shardings(state, mesh)
    assert specs.cache.k[0].spec == specs.cache.v[0].spec == P("data", "model")
    assert specs.drafter_state.k[0].spec == specs.drafter_state.v[0].spec == P("data", "model")
    assert specs.cache.lengths.spec == specs.tokens.spec == specs.sampling.temperature.spec == P("data")
    assert specs.proposal.drafts.spec == specs.counters.rounds.spec == P("data")
    assert specs.key.spec == specs.step.spec == specs.counters.width_rounds.spec == P()
    assert specs.counters.position_proposed.spec == P()


def test_one_device_mesh_is_the_single_device_path():
    run = engine.prepare(h.target(), h.RAGGED, max_new_tokens=h.MAX_NEW, mesh=sharding.make_mesh())
    assert run.spec.mesh is None
    assert run.spec == engine.prepare(h.target(), h.RAGGED, max_new_tokens=h.MAX_NEW).spec
