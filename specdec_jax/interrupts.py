"""A clean stop on Ctrl-C (SIGINT) and SIGTERM for the command line.

`install` gives both signals a Python handler that raises KeyboardInterrupt in
the main thread (once: later signals are left to the watcher below), which
Python runs at the main thread's next bytecode: the decoding loop returns to
the host about once a second (`engine.generation.run_chunks`), training after
each step, a sweep between points. The command then prints one line
(`message`: what stopped, what was kept) and exits 130 (SIGINT) or 143
(SIGTERM), without a traceback.

Python's C-level handler also writes the signal's number to a wakeup pipe at
once, whatever the main thread is doing; a watcher thread reads it. If the main
thread has not printed its line within GRACE_S (it is inside one long native
call: an XLA compile takes minutes for the Qwen pair), or a second signal comes,
the watcher prints the line itself and ends the process at once (`os._exit`):
every report, log line, cache and checkpoint is written to a temporary name and
renamed, so nothing half-written is left under a name a later run trusts.

A KeyboardInterrupt raised while Python runs a garbage-collector callback, a
`__del__` or a weakref callback (jax registers one, `_xla_gc_callback`) cannot
propagate: Python prints "Exception ignored in ..." and goes on. `install`
replaces `sys.unraisablehook` so that such an interrupt is dropped silently and
delivered again (`_thread.interrupt_main`, from a timer thread REDELIVERY_DELAY_S
later, once the hook and the callback have returned); the watcher does not count the wakeup byte of that second delivery as a second
signal.

Inside `deferred()` a first signal is recorded but its KeyboardInterrupt waits
for the end of the block: orbax logs an interrupt raised inside its checkpoint
finalize as a failure of its own, traceback and all.

A stopped command ends through `exit_now`, never through Python's
finalization. Rule: once a signal stopped the run, the interpreter must not
tear jax down. jaxlib runs Python's signal handlers while the main thread waits
for an XLA compile, so the KeyboardInterrupt can unwind the main thread while
the compile goes on in XLA's thread pool; finalization's garbage collection
then frees the jax client whose devices that compile still uses, and the
process segfaults (exit 139) after printing the right line. The same holds for
a computation dispatched and still running.
"""

from __future__ import annotations

import _thread
import contextlib
import os
import select
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import NoReturn

GRACE_S = 5.0
REDELIVERY_DELAY_S = 0.05
SIGNALS = (signal.SIGINT, signal.SIGTERM)

_received: list[int] = []  # the signal that stopped the run
_finished = threading.Event()  # the main thread has printed the line: the waiter must not
_kept: list[Callable[[], str]] = [lambda: "nothing"]  # what a stop leaves behind, for the one line
_deferring: list[bool] = []  # one entry per open `deferred()` block
_redelivering: list[bool] = []  # one entry per swallowed interrupt sent again, until its handler runs
_redelivery_bytes: list[bool] = []  # one entry per swallowed interrupt sent again, until the watcher reads its byte


def keep(describe: Callable[[], str]) -> None:
    """Say what a stop now would leave behind (e.g. "3 finished sweep points in OUT/results.jsonl")."""
    _kept[0] = describe


def exit_code() -> int:
    """128 + the signal's number: 130 for SIGINT, 143 for SIGTERM."""
    return 128 + (_received[0] if _received else signal.SIGINT)


def message(command: str) -> str:
    """The one line a stop prints."""
    name = signal.Signals(_received[0] if _received else signal.SIGINT).name
    try:
        kept = _kept[0]()
    except Exception as err:  # noqa: BLE001 - the line must still be printed
        kept = f"(could not tell: {err})"
    return f"specdec-jax: {command} stopped by {name}; kept: {kept}"


def stopped(command: str) -> int:
    """Prints the stop's line (once) and returns the exit code: the main thread's handler of KeyboardInterrupt."""
    if not _finished.is_set():
        _finished.set()
        print(message(command), file=sys.stderr, flush=True)
    return exit_code()


def was_stopped() -> bool:
    """Whether a signal has come (the command is stopping, or stopped)."""
    return bool(_received)


def exit_now(code: int) -> NoReturn:
    """Ends the process with ``code`` at once: stdout and stderr flushed, no finalization, no atexit
    (module docstring). Nothing is lost: every file a run writes is written whole and renamed."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):  # a closed or broken stream must not stop the exit
            stream.flush()
    os._exit(code)


@contextlib.contextmanager
def deferred():
    """A block a stop does not cut: a first signal inside it raises KeyboardInterrupt at its end (module docstring)."""
    _deferring.append(True)
    try:
        yield
    finally:
        _deferring.pop()
    if _received and not _deferring:
        raise KeyboardInterrupt


def install(command: str) -> None:
    """Route SIGINT and SIGTERM of this process to a clean stop of ``command`` (module docstring)."""
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)

    def handler(signum, frame):
        if not _received:  # the first signal stops the main thread; the watcher handles any later one
            _received.append(signum)
        elif _redelivering:
            _redelivering.pop()
        else:
            return
        if not _deferring:
            raise KeyboardInterrupt

    for signum in SIGNALS:
        signal.signal(signum, handler)

    default_hook = sys.unraisablehook

    def unraisable(info) -> None:
        if isinstance(info.exc_value, KeyboardInterrupt) and _received and not _finished.is_set():
            _redelivery_bytes.append(True)
            _redelivering.append(True)
            # from another thread, a moment later: sent from here, it would land in this hook and be ignored too
            resend = threading.Timer(REDELIVERY_DELAY_S, _thread.interrupt_main, (_received[0],))
            resend.daemon = True
            resend.start()
        else:
            default_hook(info)

    sys.unraisablehook = unraisable

    def watch() -> None:
        first = os.read(read_fd, 1)[0]
        deadline = time.monotonic() + GRACE_S
        while True:
            grace_over = time.monotonic() >= deadline
            # past the grace, a main thread that printed its line is stopping: only a second signal ends it now
            timeout = None if grace_over and _finished.is_set() else max(0.0, deadline - time.monotonic())
            if not select.select([read_fd], [], [], timeout)[0]:
                if _finished.is_set():
                    continue
                break
            os.read(read_fd, 1)
            if _redelivery_bytes:  # the wakeup byte of a redelivery, not a second signal
                _redelivery_bytes.pop()
                continue
            break
        if not _received:
            _received.append(first)
        if not _finished.is_set():
            _finished.set()
            print(message(command), file=sys.stderr, flush=True)
        os._exit(exit_code())  # not exit_now: the main thread may hold stdout's buffer, stuck in a write

    threading.Thread(target=watch, name="specdec-stop", daemon=True).start()
