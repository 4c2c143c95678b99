"""Test markers, and skipping of accelerator tests where jax sees no such device."""

import jax
import pytest

MARKERS = {
    "slow": "heavier tests, run in a separate CI step (pytest -m slow)",
    "gpu": "needs a GPU (skipped when jax sees none)",
    "tpu": "needs a TPU (skipped when jax sees none)",
    "multidevice": "needs more than one jax device",
}


def pytest_configure(config):
    for name, doc in MARKERS.items():
        config.addinivalue_line("markers", f"{name}: {doc}")


def pytest_collection_modifyitems(config, items):
    platforms = {d.platform for d in jax.devices()}
    reasons = {
        "gpu": None if "gpu" in platforms or "cuda" in platforms or "rocm" in platforms else "no GPU visible to jax",
        "tpu": None if "tpu" in platforms else "no TPU visible to jax",
        "multidevice": None if len(jax.devices()) > 1 else "only one jax device",
    }
    for item in items:
        for marker, reason in reasons.items():
            if reason and marker in item.keywords:
                item.add_marker(pytest.mark.skip(reason=reason))
