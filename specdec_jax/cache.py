"""The cache folder (`$SPECDEC_CACHE`, default ``~/.cache/specdec_jax``), shared by every process that
uses it: a test suite's workers, a sweep's jobs, two terminals, the hosts of a multi-host run on one
home folder, a cluster's job array.

Every entry (a fetched file, a converted model, a datastore index, a calibration, grammar tables) is
made by `entry`, which keeps three rules:

- **One builder.** A lock per entry (``.<name>.lock`` beside it, a `filelock.FileLock`: an OS lock
  the kernel releases when its holder ends, SIGKILL included, so a dead holder never blocks anyone).
  The others wait; after `SAY_AFTER_S` seconds they say once whom they wait for (pid, host, command,
  since when: ``.<name>.holder``), then read what the builder made.
- **Published whole.** The builder writes under a temporary name in the same folder
  (``.<name>.<host>.<pid>.partial``, a file or a folder) and publishes it with one atomic rename, so
  an entry that exists is complete: readers need no lock.
- **Healed.** What a killed builder left is only such a partial; the next builder (holding the lock,
  so no one else is writing) removes it and says so in one line naming the entry it rebuilds.

A cached entry the reader finds unusable (another format, a corrupt file) is rebuilt the same way:
the reader returns None and the entry is replaced under the lock.
"""

from __future__ import annotations

import contextlib
import glob
import os
import pathlib
import shutil
import socket
import sys
import time
from collections.abc import Callable, Iterator
from typing import TypeVar

import filelock

T = TypeVar("T")
SAY_AFTER_S = 3.0  # a waiter names the holder after this long


def cache_dir() -> pathlib.Path:
    """`$SPECDEC_CACHE`, or ``~/.cache/specdec_jax``; created if missing. ValueError (one line) when the
    path is a file or cannot be made."""
    env = os.environ.get("SPECDEC_CACHE")
    path = pathlib.Path(env).expanduser() if env else pathlib.Path.home() / ".cache" / "specdec_jax"
    where = f"SPECDEC_CACHE={env}" if env else f"the cache folder {path}"
    if path.exists() and not path.is_dir():
        raise ValueError(f"{where} is a file, not a folder: point SPECDEC_CACHE at a folder")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ValueError(f"{where} cannot be made ({err.strerror}): point SPECDEC_CACHE at a writable folder") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise ValueError(f"{where} is not writable: point SPECDEC_CACHE at a writable folder")
    return path


def entry(path: pathlib.Path, what: str, read: Callable[[pathlib.Path], T | None],
          build: Callable[[pathlib.Path], T]) -> T:
    """The cache entry at ``path`` (a file or a folder), made once across processes.

    ``read(path)`` returns the value of a complete entry, or None when it is unusable (it may say why).
    ``build(tmp)`` writes the whole entry at ``tmp`` (a path beside ``path`` that does not exist yet)
    and returns its value; ``tmp`` is then published by renaming it to ``path``. ``what`` names the entry in messages
    ("the converted SmolLM2-135M-Instruct.Q4_1.gguf")."""
    seen = _identity(path)
    if seen is not None and (value := read(path)) is not None:
        return value
    with locked(path, what):
        now = _identity(path)
        # built (or replaced) while this process waited; an entry already refused is not read twice
        if now is not None and now != seen and (value := read(path)) is not None:
            return value
        heal(path, what)
        tmp = path.with_name(f".{path.name}.{socket.gethostname()}.{os.getpid()}.partial")
        try:
            value = build(tmp)
            publish(tmp, path)
        finally:
            remove(tmp)
    return value


@contextlib.contextmanager
def locked(path: pathlib.Path, what: str) -> Iterator[None]:
    """Holds ``path``'s entry lock while the block runs; waits for another holder, naming it after
    `SAY_AFTER_S` seconds."""
    path.parent.mkdir(parents=True, exist_ok=True)
    lock = filelock.FileLock(path.with_name(f".{path.name}.lock"), thread_local=False)
    holder = path.with_name(f".{path.name}.holder")
    try:
        lock.acquire(timeout=SAY_AFTER_S)
    except filelock.Timeout:
        print(f"waiting for {what}: {_read_holder(holder)} is making it", file=sys.stderr, flush=True)
        lock.acquire()
    try:
        holder.write_text(f"pid {os.getpid()} on {socket.gethostname()} ({_command()}, since "
                          f"{time.strftime('%H:%M:%S')})")
        yield
    finally:
        lock.release()


def heal(path: pathlib.Path, what: str) -> None:
    """Removes what killed builders left beside ``path`` (their partials), saying so in one line.
    Call it only while holding ``path``'s lock: then no partial belongs to a live builder."""
    for left in sorted(path.parent.glob(f".{glob.escape(path.name)}.*.partial")):
        remove(left)
        print(f"{what}: removed an unfinished build ({left.name}) left by a process that ended; building it "
              "again", file=sys.stderr, flush=True)


def publish(tmp: pathlib.Path, path: pathlib.Path) -> None:
    """Renames ``tmp`` to ``path``, replacing an unusable entry there (a folder is moved aside first:
    a rename cannot replace a non-empty folder)."""
    if path.is_dir() and not path.is_symlink():
        aside = path.with_name(f".{path.name}.{os.getpid()}.old.partial")
        os.rename(path, aside)
        os.rename(tmp, path)
        remove(aside)
    else:
        os.replace(tmp, path)


def remove(path: pathlib.Path) -> None:
    """Deletes a file or a folder tree; nothing if absent."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


def _identity(path: pathlib.Path) -> tuple[int, int] | None:
    """(inode, modification time) of ``path``, None if absent: a published entry is a new inode."""
    try:
        stat = path.stat()
    except FileNotFoundError:
        return None
    return stat.st_ino, stat.st_mtime_ns


def _read_holder(holder: pathlib.Path) -> str:
    try:
        return holder.read_text().strip() or "another process"
    except OSError:
        return "another process"


def _command() -> str:
    return " ".join([pathlib.Path(sys.argv[0]).name, *sys.argv[1:]])[:120] if sys.argv and sys.argv[0] else "python"
