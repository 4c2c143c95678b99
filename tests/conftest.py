"""Test markers, skipping of accelerator tests where jax sees no such device, and compile settings.

`multidevice` tests start their own processes with 8 CPU devices (or 2 processes
on 127.0.0.1), so they run wherever the default suite runs, one device or not.

Compiling dominates the suite's time on CPU (tiny models run in milliseconds), so:

- the tests compile with LLVM's optimisation level 0 (XLA's own graph passes, fusion
  included, still run: the same programs with less machine-code optimisation; about
  25% less time). Setting XLA_FLAGS's optimisation level yourself overrides it.
- compiled programs are shared across test files and worker processes (pytest-xdist,
  `-n 2` in pyproject.toml) and kept across runs by JAX's persistent compilation
  cache in `$SPECDEC_TEST_COMPILE_CACHE` (default `$SPECDEC_CACHE/test-compile-cache`;
  "fresh" for a new temporary folder per run). JAX keys each entry by the program,
  compile options, flags and versions, so a kept entry is never a stale program. The
  folder grows with every changed program (45 MB after one suite); delete it to reclaim
  the space. (JAX's size bound made every cache write scan the folder: slower.)
- on a GPU, JAX does not preallocate memory, so that two worker processes fit.

Subprocesses the tests start inherit all of this through the environment.
"""

import atexit
import os
import pathlib
import shutil
import tempfile

if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0").strip()
# models.fetch.cache_dir's rule, restated: importing the package would import jax before these settings.
_cache = os.environ.get("SPECDEC_TEST_COMPILE_CACHE") or str(
    pathlib.Path(os.environ.get("SPECDEC_CACHE") or "~/.cache/specdec_jax").expanduser() / "test-compile-cache")
if _cache == "fresh":
    _cache = tempfile.mkdtemp(prefix="specdec-test-xla-")
    atexit.register(shutil.rmtree, _cache, ignore_errors=True)
os.environ["SPECDEC_TEST_COMPILE_CACHE"] = _cache  # the worker processes inherit the resolved folder
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
os.environ["JAX_COMPILATION_CACHE_DIR"] = os.environ["SPECDEC_TEST_COMPILE_CACHE"]
os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"

import jax  # noqa: E402  (after the settings above)
import pytest  # noqa: E402

MARKERS = {
    "slow": "heavier tests, run in a separate CI step (pytest -m slow)",
    "gpu": "needs a GPU (skipped when jax sees none)",
    "tpu": "needs a TPU (skipped when jax sees none)",
    "multidevice": "runs on several jax devices, in subprocesses with 8 CPU devices (never skipped)",
}


MAPPINGS_BEFORE_CLEARING = 30_000  # of the kernel's usual vm.max_map_count, 65,530


def memory_mappings() -> int:
    """This process's memory mappings (0 where /proc is not there)."""
    try:
        with open("/proc/self/maps") as maps:
            return sum(1 for _ in maps)
    except OSError:
        return 0


@pytest.fixture(autouse=True, scope="module")
def bounded_compile_caches():
    """Empties the compile caches before a test module once this process holds many memory
    mappings: XLA CPU keeps every compiled program memory-mapped, and a whole suite's programs
    exceed vm.max_map_count, which ends in "LLVM ERROR: Unable to allocate section memory" or
    a segfault while compiling. Below the bound, programs compiled by earlier modules are reused."""
    if memory_mappings() > MAPPINGS_BEFORE_CLEARING or not os.path.exists("/proc/self/maps"):
        jax.clear_caches()
    yield


def pytest_configure(config):
    for name, doc in MARKERS.items():
        config.addinivalue_line("markers", f"{name}: {doc}")


def pytest_collection_modifyitems(config, items):
    platforms = {d.platform for d in jax.devices()}
    reasons = {
        "gpu": None if "gpu" in platforms or "cuda" in platforms or "rocm" in platforms else "no GPU visible to jax",
        "tpu": None if "tpu" in platforms else "no TPU visible to jax",
    }
    for item in items:
        for marker, reason in reasons.items():
            if reason and marker in item.keywords:
                item.add_marker(pytest.mark.skip(reason=reason))
