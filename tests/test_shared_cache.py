"""The cache shared by processes (`specdec_jax.cache`), with real processes (`tests/cache_worker.py`):
processes started together on an empty cache build each entry once and agree (a compiled program,
written unlocked, is one whole entry); a build killed with
SIGKILL leaves no entry that a later process would trust, and the next process heals it in one line;
a waiter names the holder and takes over when it dies."""

from __future__ import annotations

import collections
import json
import os
import pathlib
import subprocess
import sys
import time

import pytest

from specdec_jax import cache
from specdec_jax.models.loading import CACHE_FORMAT

WORKER = pathlib.Path(__file__).with_name("cache_worker.py")
PROCESSES = 3
KINDS = ("fetch", "convert", "datastore", "grammar", "calibration", "compile")
TEXTS = {"a.txt": "the cat sat on the mat. " * 20, "b.py": "def f(x):\n    return x + 1\n" * 10,
         "sub/c.md": "# notes\nthe cat ran off the mat.\n" * 15}


@pytest.fixture
def inputs(tmp_path) -> pathlib.Path:
    """A folder with a tiny GGUF and a folder of texts (the worker's inputs)."""
    from test_loading import CFG, hf_weights, write_gguf

    folder = tmp_path / "inputs"
    folder.mkdir()
    write_gguf(folder / "model.gguf", hf_weights(CFG))
    for name, text in TEXTS.items():
        (folder / "texts" / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / "texts" / name).write_text(text)
    return folder


def start(folder: pathlib.Path, store: pathlib.Path, kinds, **env) -> subprocess.Popen:
    env = {**os.environ, "SPECDEC_CACHE": str(store), "SPECDEC_TEST_COMPILE_CACHE": str(store / "xla"), **env}
    return subprocess.Popen([sys.executable, str(WORKER), str(folder), *kinds], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def release(folder: pathlib.Path, count: int, timeout: float = 120) -> None:
    """Waits until ``count`` workers are ready, then lets them all go at once."""
    end = time.monotonic() + timeout
    while len(list(folder.glob("ready-*"))) < count:
        assert time.monotonic() < end, "the workers did not start"
        time.sleep(0.05)
    (folder / "go").touch()


def finish(proc: subprocess.Popen) -> tuple[dict, str]:
    out, err = proc.communicate(timeout=240)
    assert proc.returncode == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1]), err


def published(folder: pathlib.Path) -> collections.Counter:
    """How often each entry name was published, over all workers."""
    lines = (folder / "published").read_text().split("\n") if (folder / "published").exists() else []
    return collections.Counter(line.split(" ", 1)[1] for line in lines if line)


def complete_entries(folder: pathlib.Path) -> list[str]:
    """Names in ``folder`` a reader would take for entries (not partials, locks or holder notes)."""
    return sorted(p.name for p in folder.iterdir() if not p.name.startswith(".")) if folder.is_dir() else []


def test_processes_started_together_on_an_empty_cache_build_each_entry_once_and_agree(inputs, tmp_path):
    store = tmp_path / "cache"
    procs = [start(inputs, store, KINDS) for _ in range(PROCESSES)]
    release(inputs, PROCESSES)
    results = [finish(p)[0] for p in procs]
    assert all(r == results[0] for r in results), results
    # the calibration's costs name the process that measured: all read that one's
    assert results[0]["calibration"] in {str(p.pid) for p in procs}
    counts = published(inputs)
    assert counts and set(counts.values()) == {1}, counts
    kinds = {"split.gguf", f"{CACHE_FORMAT}-{cache_name(store / 'converted')}", cache_name(store / "datastores"),
             cache_name(store / "grammar")}
    assert kinds <= set(counts), (kinds, counts)
    for folder in (store / "converted", store / "datastores", store / "grammar", store / "split"):
        assert not list(folder.glob(".*.partial")), list(folder.iterdir())
    # compiled programs are written unlocked (an entry is a function of its key), renamed whole: every
    # program the workers compiled is one complete entry, and no temporary file is left
    programs = complete_entries(store / "xla")
    assert any(name.startswith("jit__lambda-") and name.endswith("-cache") for name in programs), programs
    assert not [p for p in (store / "xla").iterdir() if p.name.startswith(".")], list((store / "xla").iterdir())


def cache_name(folder: pathlib.Path) -> str:
    """The one entry in ``folder`` (CACHE_FORMAT + "-<sha>" -> "<sha>" for converted models)."""
    [name] = complete_entries(folder)
    return name.removeprefix(f"{CACHE_FORMAT}-")


def wait_for_line(stream, text: str) -> str:
    """Reads ``stream`` up to the first line holding ``text``; returns what it read. (Bounded: a slow
    builder publishes after 60 s, and every worker then ends.)"""
    read = ""
    while line := stream.readline():
        read += line
        if text in line:
            return read
    raise AssertionError(f"the worker ended without saying {text!r}: {read[-2000:]}")


def test_builders_killed_before_publishing_leave_no_entry_and_a_waiter_heals_both(inputs, tmp_path):
    import cache_worker

    store = tmp_path / "cache"
    killed = [start(inputs, store, [kind], SLOW_PUBLISH="1") for kind in ("convert", "datastore")]
    release(inputs, 2)
    for proc in killed:
        wait_for_line(proc.stdout, "publishing")  # its partial is whole; it holds the entry's lock
    for folder in (store / "converted", store / "datastores"):  # while the builders hold their locks
        assert [p for p in folder.iterdir() if p.name.endswith(".partial")], list(folder.iterdir())
    waiter = start(inputs, store, ["convert", "datastore"])
    said = wait_for_line(waiter.stderr, "waiting for")
    assert f"waiting for the converted model.gguf: pid {killed[0].pid} on " in said, said
    for proc in killed:
        proc.kill()
        proc.wait()
    healed, err = finish(waiter)
    assert "the converted model.gguf: removed an unfinished build" in err, err
    assert "the datastore index of " in err and err.count("removed an unfinished build") == 2, err
    for folder in (store / "converted", store / "datastores"):
        assert len(complete_entries(folder)) == 1 and not list(folder.glob(".*.partial")), list(folder.iterdir())
    os.environ["SPECDEC_CACHE"], saved = str(tmp_path / "clean"), os.environ.get("SPECDEC_CACHE")
    try:
        assert healed == {"convert": cache_worker.convert(inputs), "datastore": cache_worker.datastore(inputs)}
    finally:
        os.environ.pop("SPECDEC_CACHE") if saved is None else os.environ.__setitem__("SPECDEC_CACHE", saved)


def test_a_cache_folder_that_is_a_file_is_one_line(tmp_path, monkeypatch):
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "file"))
    with pytest.raises(ValueError, match=r"SPECDEC_CACHE=.*file is a file, not a folder: point SPECDEC_CACHE at a"):
        cache.cache_dir()


def test_an_unreadable_entry_is_replaced_whole(tmp_path, capsys):
    """A folder entry `read` refuses is replaced by a rename (the old one moved aside, then removed)."""
    path = tmp_path / "entry"
    path.mkdir()
    (path / "old").write_text("stale")

    def build(tmp):
        tmp.mkdir()
        (tmp / "new").write_text("fresh")
        return "built"

    assert cache.entry(path, "the entry", lambda p: (p / "new").read_text() if (p / "new").exists() else None,
                       build) == "built"
    assert sorted(p.name for p in path.iterdir()) == ["new"]
    assert complete_entries(tmp_path) == ["entry"] and not list(tmp_path.glob(".*.partial"))
    assert cache.entry(path, "the entry", lambda p: (p / "new").read_text(), build) == "fresh"
