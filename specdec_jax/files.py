"""What a run writes: checked before the work starts, written whole or not at all, one writer per folder.

- `check_output_file` / `check_output_dir`: a `--json` report or an `--out` folder that
  cannot be written is a ValueError naming the flag before any model loads, not a
  traceback after the whole generation ran.
- `replacing`, `write_text_atomic`, `write_json`: a temporary file in the same folder, then a rename,
  so a kill leaves the old file or the new one, never half of one.
- `exclusive`: a lock on a sweep's or a training's `--out`; a second writer is refused
  with a line naming the folder and the holder; the lock file is removed when its holder ends
  (a kill leaves it: harmless, the kernel's lock ended with the process).
- `json_safe`: NaN (a rate over nothing) becomes null: JSON has no NaN.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import math
import os
import pathlib
import tempfile
from collections.abc import Iterator
from typing import Any

LOCK_NAME = ".lock"


def _writable_folder(folder: pathlib.Path) -> pathlib.Path | None:
    """The nearest existing folder at or above ``folder`` if it is writable (``folder`` can be made
    there), else None; a file in the way is a ValueError."""
    for parent in (folder, *folder.parents):
        if parent.exists():
            if not parent.is_dir():
                raise ValueError(f"{parent} is a file, not a folder")
            return parent if os.access(parent, os.W_OK | os.X_OK) else None
    return None


def check_output_file(path: str | pathlib.Path, flag: str) -> pathlib.Path:
    """``path`` if a file can be written there (``flag`` names it in the error)."""
    path = pathlib.Path(path)
    if path.is_dir():
        raise ValueError(f"{flag} {path} is a folder: give a file name")
    try:
        folder = _writable_folder(path.parent)
    except ValueError as err:
        raise ValueError(f"{flag} {path}: {err}") from None
    if folder is None or path.exists() and not os.access(path, os.W_OK):
        raise ValueError(f"{flag} {path}: not writable")
    return path


def check_output_dir(path: str | pathlib.Path, flag: str) -> pathlib.Path:
    """``path`` if it is (or can be made) a writable folder (``flag`` names it in the error)."""
    path = pathlib.Path(path)
    if path.exists() and not path.is_dir():
        raise ValueError(f"{flag} {path} is a file: give a folder")
    try:
        folder = _writable_folder(path)
    except ValueError as err:
        raise ValueError(f"{flag} {path}: {err}") from None
    if folder is None:
        raise ValueError(f"{flag} {path}: not writable")
    return path


@contextlib.contextmanager
def replacing(path: str | pathlib.Path) -> Iterator[pathlib.Path]:
    """A temporary path beside ``path`` to write; renamed over ``path`` when the block ends, removed if it raises."""
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        yield pathlib.Path(tmp)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def write_text_atomic(path: str | pathlib.Path, text: str) -> None:
    """Writes ``text`` to ``path`` through `replacing`."""
    with replacing(path) as tmp:
        tmp.write_text(text)


def json_safe(x: Any) -> Any:
    """``x`` with every NaN float replaced by None (recursively through dicts, lists and tuples)."""
    if isinstance(x, float) and math.isnan(x):
        return None
    if isinstance(x, dict):
        return {k: json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [json_safe(v) for v in x]
    return x


def write_json(path: str | pathlib.Path, payload: Any, indent: int | None = 1) -> None:
    """``payload`` as JSON (NaN as null), written atomically."""
    write_text_atomic(path, json.dumps(json_safe(payload), indent=indent, allow_nan=False, default=str))


@contextlib.contextmanager
def exclusive(folder: str | pathlib.Path, command: str) -> Iterator[pathlib.Path]:
    """Holds ``folder``'s lock (``folder/.lock``, created with the folder) while the block runs; another
    process holding it is a ValueError naming the holder. The kernel's lock ends with the process,
    however it ends; the file is removed when the block ends (`_unlock`)."""
    folder = pathlib.Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    handle = _lock(folder, folder / LOCK_NAME)
    try:
        handle.seek(0)
        handle.truncate()
        handle.write(f"{command} (pid {os.getpid()})")
        handle.flush()
        yield folder
    finally:
        _unlock(handle, folder / LOCK_NAME)


def _lock(folder: pathlib.Path, path: pathlib.Path):
    """An open handle of ``path`` holding its flock. Rule: the lock counts only while ``path`` still
    names the locked file; a holder that ended unlinked it (`_unlock`) after this process opened it,
    so a lock won on an unlinked file is dropped and the path opened again."""
    while True:
        handle = open(path, "a+")
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            holder = handle.read().strip() or "another process"
            handle.close()
            raise ValueError(f"{folder} is in use by {holder}: wait for it to end, or choose another --out") from None
        try:
            current = os.stat(path)
        except FileNotFoundError:
            current = None
        if current is not None and os.path.samestat(os.fstat(handle.fileno()), current):
            return handle
        handle.close()


def _unlock(handle, path: pathlib.Path) -> None:
    """Removes ``path`` while still holding its lock, then releases it (the order `_lock` relies on: a
    process that opened the old file and wins its lock sees that the path no longer names it)."""
    try:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
    finally:
        fcntl.flock(handle, fcntl.LOCK_UN)
        handle.close()
