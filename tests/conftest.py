"""Test markers, and skipping of accelerator tests where jax sees no such device.

`multidevice` tests start their own processes with 8 CPU devices (or 2 processes
on 127.0.0.1), so they run wherever the default suite runs, one device or not.
"""

import jax
import pytest

MARKERS = {
    "slow": "heavier tests, run in a separate CI step (pytest -m slow)",
    "gpu": "needs a GPU (skipped when jax sees none)",
    "tpu": "needs a TPU (skipped when jax sees none)",
    "multidevice": "runs on several jax devices, in subprocesses with 8 CPU devices (never skipped)",
}


@pytest.fixture(autouse=True, scope="module")
def fresh_compile_caches():
    """Each test module starts with empty compile caches: XLA CPU keeps every compiled program
    memory-mapped, and the whole suite in one process exceeds vm.max_map_count (65,530), which
    ends in "LLVM ERROR: Unable to allocate section memory" or a segfault while compiling."""
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
