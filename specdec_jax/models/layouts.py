"""The weight layouts saved folders record, and their conversion to the decoder's (`models.llama`:
every matrix ``[out, in]``). Model and head folders saved under an older layout (trained drafts
and heads on users' disks) are converted on load, so they keep loading.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from specdec_jax.models.llama import LAYER_MATRICES

LAYOUT = "out_in"  # what saved head folders record: the decoder layer's matrices are [out, in]
MODEL_LAYOUT = "out_in_head"  # what saved model folders record: every matrix [out, in], lm_head [Vo, H] too


def from_in_out_layout(arrays: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """``arrays`` with layer matrices ``[L, in, out]`` (folders that record no layout), in `MODEL_LAYOUT`'s
    ``[L, out, in]``."""
    return {name: np.ascontiguousarray(np.swapaxes(a, -1, -2)) if name in LAYER_MATRICES else a
            for name, a in arrays.items()}


def from_saved_layout(arrays: Mapping[str, np.ndarray], layout: str | None) -> dict[str, np.ndarray]:
    """Model ``arrays`` saved under ``layout`` (a folder's ``"layout"``), in `MODEL_LAYOUT`: None (layer
    matrices ``[L, in, out]``, head ``[H, V]``) and `LAYOUT` (head ``[H, V]``) are converted, so that
    folders saved under them (trained drafts on users' disks) load."""
    if layout == MODEL_LAYOUT:
        return dict(arrays)
    if layout not in (None, LAYOUT):
        raise ValueError(f"unknown weight layout {layout!r}")
    arrays = from_in_out_layout(arrays) if layout is None else dict(arrays)
    if "lm_head" in arrays:
        arrays["lm_head"] = np.ascontiguousarray(np.swapaxes(arrays["lm_head"], -1, -2))
    return arrays
