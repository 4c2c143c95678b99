"""The suite's compile settings (`configure`, before jax is imported) and JAX's persistent compilation
cache made safe for many processes (`atomic_puts`, after). `tests/conftest.py` applies both; so do
the subprocesses that import this module.

Compiling dominates the suite's time on CPU (tiny models run in milliseconds), so:

- the tests compile with LLVM's optimisation level 0 and XLA CPU's classic fusion emitters
  instead of its MLIR ones (`COMPILE_FLAGS`): XLA's own graph passes, fusion included,
  still run, so these are the same programs with cheaper machine code generation
  (docs/testing.md gives the measured effect). A flag set in XLA_FLAGS yourself wins.
- compiled programs are shared across test files and worker processes (pytest-xdist,
  `-n 2` in pyproject.toml) and kept across runs by JAX's persistent compilation
  cache in `$SPECDEC_TEST_COMPILE_CACHE` (default `$SPECDEC_CACHE/test-compile-cache`;
  "fresh" for a new temporary folder per run). JAX keys each entry by the program,
  compile options, flags and versions, so a kept entry is never a stale program. The
  folder grows with every changed program; delete it to reclaim the space. (JAX's size
  bound made every cache write scan the folder: slower.)
- JAX writes an entry in place, so a reader in another process could read half of one and a
  writer killed mid-write would leave a truncated entry that is never rewritten: each entry is
  written to a temporary name and renamed (`specdec_jax.files.replacing`). No lock: an entry is a
  function of its key, so two processes that compiled the same program write the same bytes, and
  the compile is already paid when the write starts (a lock per entry cost 5 ms a write, a fifth of
  a small program's compile, and left two more files per entry).
- on a GPU, JAX does not preallocate memory, so that two worker processes fit.

Subprocesses the tests start inherit all of this through the environment.
"""

import atexit
import os
import pathlib
import shutil
import tempfile


# XLA flags the suite compiles with, each unless XLA_FLAGS sets it already (module docstring)
COMPILE_FLAGS = {"xla_backend_optimization_level": 0, "xla_cpu_use_fusion_emitters": "false"}


def configure() -> None:
    """Sets the environment above; call it before importing jax."""
    for flag, value in COMPILE_FLAGS.items():
        if flag not in os.environ.get("XLA_FLAGS", ""):
            os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + f" --{flag}={value}").strip()
    # specdec_jax.cache.cache_dir's rule, restated: importing the package would import jax before these settings.
    folder = os.environ.get("SPECDEC_TEST_COMPILE_CACHE") or str(
        pathlib.Path(os.environ.get("SPECDEC_CACHE") or "~/.cache/specdec_jax").expanduser() / "test-compile-cache")
    if folder == "fresh":
        folder = tempfile.mkdtemp(prefix="specdec-test-xla-")
        atexit.register(shutil.rmtree, folder, ignore_errors=True)
    os.environ["SPECDEC_TEST_COMPILE_CACHE"] = folder  # the worker processes inherit the resolved folder
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = folder
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"


def atomic_puts() -> None:
    """Routes JAX's cache writes through `specdec_jax.files.replacing` (JAX's own path when a size bound
    is set: JAX then locks the folder itself)."""
    from jax._src import lru_cache

    from specdec_jax.files import replacing

    jax_put = lru_cache.LRUCache.put

    def put(self, key: str, value: bytes) -> None:
        if self.eviction_enabled:
            return jax_put(self, key, value)
        with replacing(pathlib.Path(str(self.path)) / f"{key}{lru_cache._CACHE_SUFFIX}") as tmp:
            tmp.write_bytes(value)

    lru_cache.LRUCache.put = put
