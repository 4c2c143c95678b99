"""Test markers, skipping of accelerator tests where jax sees no such device, and compile settings
(`tests/compile_cache.py`: optimisation level, JAX's persistent compilation cache shared by the
worker processes and across runs).

`multidevice` tests start their own processes with 8 CPU devices (or 2 processes
on 127.0.0.1), so they run wherever the default suite runs, one device or not.
"""

import os

import compile_cache

compile_cache.configure()

import jax  # noqa: E402  (after the settings above)
import pytest  # noqa: E402

compile_cache.atomic_puts()

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


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """`$SPECDEC_CACHE` in a fresh temporary folder (converted models, datastores, rankings land there);
    returns the folder, not made yet."""
    folder = tmp_path / "cache"
    monkeypatch.setenv("SPECDEC_CACHE", str(folder))
    return folder


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
