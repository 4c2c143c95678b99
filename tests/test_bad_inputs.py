"""Input that was accepted silently or reported badly: YAML keys given twice, a sweep file's unknown key,
binary files in a datastore folder, the lock file a finished writer left. Each case failed before its fix;
the training's resume cases live in test_distill.py (its trained run), the stop during calibration in
test_reliability.py."""

import fcntl
import pathlib

import pytest

from specdec_jax import files
from specdec_jax.cli import main
from specdec_jax.datastore import folder_texts
from specdec_jax.sweep import load_sweep, sweep


def one_error_line(capsys) -> str:
    captured = capsys.readouterr()
    lines = [line for line in captured.err.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in captured.err, captured.err
    return lines[0]


# ---------------------------------------------------------------------------------- YAML keys given twice


@pytest.mark.parametrize("command, text, message", [
    ("generate", "model: tiny-random\ngamma: 2\nprompt: hi\ngamma: 4\n", "key 'gamma' is given twice (lines 2 and 4)"),
    ("sweep", "base: {model: tiny-random, seed: 1, seed: 2}\ngrid: {gamma: [1]}\n",
     "key 'seed' is given twice (line 1)"),
    ("sweep", "grid: {gamma: [1]}\nbase: {model: tiny-random}\ngrid: {gamma: [2]}\n",
     "key 'grid' is given twice (lines 1 and 3)"),
    ("train-draft", "steps: 10\nlearning_rate: 0.1\nsteps: 20\n", "key 'steps' is given twice (lines 1 and 3)"),
])
def test_a_yaml_key_given_twice_is_one_line_naming_the_key_and_file(tmp_path, capsys, monkeypatch, command, text,
                                                                      message):
    monkeypatch.setattr("specdec_jax.runner.run", lambda *a, **k: pytest.fail("the run started"))
    path = tmp_path / "file.yaml"
    path.write_text(text)
    argv = {"generate": ["generate", "--config", str(path)],
            "sweep": ["sweep", str(path), "--out", str(tmp_path / "out")],
            "train-draft": ["train-draft", "--config", str(path), "--out", str(tmp_path / "out")]}[command]
    assert main(argv) == 2
    line = one_error_line(capsys)
    assert f"{path}: {message}: keep one" in line, line
    assert not (tmp_path / "out").exists()


def test_keys_a_merge_brings_in_may_be_overridden(tmp_path):
    """YAML's merge key (``<<: {...}``) is not a key given twice."""
    path = tmp_path / "sweep.yaml"
    path.write_text("base: {<<: {model: tiny-random, gamma: 1}, gamma: 2}\ngrid: {seed: [1]}\n")
    _, [cfg] = load_sweep(path)
    assert cfg.gamma == 2 and cfg.model == "tiny-random"


# ---------------------------------------------------------------------------------- sweep file keys


def test_a_sweep_files_unknown_key_is_named_with_the_known_ones(tmp_path, capsys):
    path = tmp_path / "sweep.yaml"
    path.write_text("base: {model: tiny-random}\ngrids: {gamma: [1, 2]}\n")
    assert main(["sweep", str(path), "--out", str(tmp_path / "out")]) == 2
    assert one_error_line(capsys).endswith(f"{path}: unknown key 'grids' (known: base, grid)")
    path.write_text("base: {model: tiny-random}\n")
    with pytest.raises(ValueError, match=r"sweep.yaml: no 'grid'"):
        load_sweep(path)


# ---------------------------------------------------------------------------------- datastore folders


def test_a_file_of_nul_bytes_in_a_datastore_folder_is_not_text(tmp_path):
    """Zeros are valid UTF-8, but a NUL byte makes a file binary: skipped like any other non-text file."""
    (tmp_path / "notes.txt").write_text("def f():\n    return 1\n")
    (tmp_path / "zeros.bin").write_bytes(b"\0" * 4096)
    (tmp_path / "mixed.dat").write_bytes(b"header\0\0\0payload")
    (tmp_path / "latin1.txt").write_bytes(b"caf\xe9")
    assert folder_texts(tmp_path) == ["def f():\n    return 1\n"]


# ---------------------------------------------------------------------------------- the --out lock


def write_sweep(tmp_path) -> pathlib.Path:
    path = tmp_path / "sweep.yaml"
    path.write_text("base: {model: tiny-random, raw: true, prompt: ab, max_new_tokens: 2, drafter: draft-model, "
                    "draft_model: tiny-random-draft}\n"
                    "grid: {gamma: [1]}\n")
    return path


def test_a_finished_sweep_leaves_no_lock_file(tmp_path):
    out = tmp_path / "out"
    sweep(write_sweep(tmp_path), out, progress=False)
    assert (out / "results.jsonl").is_file() and not (out / files.LOCK_NAME).exists()


def test_the_lock_file_is_removed_when_its_holder_ends_and_a_second_writer_is_still_refused(tmp_path):
    out = tmp_path / "out"
    with files.exclusive(out, "sweep a.yaml"):
        assert (out / files.LOCK_NAME).is_file()
        with pytest.raises(ValueError, match=rf"^{out} is in use by sweep a.yaml \(pid \d+\): wait for it to end, "
                                             "or choose another --out$"):
            with files.exclusive(out, "sweep b.yaml"):
                pytest.fail("two holders")
        assert (out / files.LOCK_NAME).is_file()  # the refused writer removes nothing
    assert not (out / files.LOCK_NAME).exists()
    with pytest.raises(RuntimeError), files.exclusive(out, "failing"):
        raise RuntimeError  # an error in the block ends the holder too
    assert not (out / files.LOCK_NAME).exists()


def test_a_lock_won_on_a_file_its_holder_removed_is_not_a_lock(tmp_path, monkeypatch):
    """The race of removing a lock file: B opens .lock; the holder A removes it and ends; C creates a new
    .lock and holds it; B's flock then succeeds on A's removed file. B must see that the path names
    another file now, open it again, and be refused naming C."""
    out = tmp_path / "out"
    a = files.exclusive(out, "A")
    a.__enter__()
    real_flock, held = fcntl.flock, []

    def flock(handle, operation):
        if operation == fcntl.LOCK_EX | fcntl.LOCK_NB and not held:  # B, between its open and its flock
            held.append(files.exclusive(out, "C"))
            a.__exit__(None, None, None)
            held[0].__enter__()
        return real_flock(handle, operation)

    monkeypatch.setattr(fcntl, "flock", flock)
    with pytest.raises(ValueError, match=r"in use by C \(pid"):
        with files.exclusive(out, "B"):
            pytest.fail("B holds a lock on a removed file while C holds the folder")
    held[0].__exit__(None, None, None)
    assert not (out / files.LOCK_NAME).exists()
