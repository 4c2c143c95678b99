"""Trained drafter heads on disk (EAGLE, Medusa): `--drafter eagle|medusa --draft-model FOLDER`.

A head folder holds `params/` (orbax) and `specdec_head.json`, written last:
`{"kind", "config", "target", "info"}`, where `target` names the model it was
trained on (`hidden_size`, `vocab_size`, `num_layers`, and `fingerprint`:
`target_fingerprint`, a hash of its weight shapes and tokenizer). Loading checks
the weights' names and shapes and the `vocab_map` (distinct ids inside the
vocabulary), and, given the target it will run against, its fingerprint (a head
of a different target of the same width is refused); the drafter's `check`
compares the sizes.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import pathlib

import numpy as np

from specdec_jax import interrupts
from specdec_jax.drafters.eagle import EagleConfig, EagleDrafter, eagle_shapes
from specdec_jax.drafters.medusa import MedusaConfig, MedusaDrafter, medusa_shapes
from specdec_jax.files import write_text_atomic
from specdec_jax.models.layouts import LAYOUT, from_in_out_layout

HEAD_MARKER = "specdec_head.json"
KINDS = {  # kind -> (config class, drafter class, shapes of the weights)
    "eagle": (EagleConfig, EagleDrafter, eagle_shapes),
    "medusa": (MedusaConfig, MedusaDrafter, medusa_shapes),
}


def save_head(folder: str | pathlib.Path, kind: str, config, arrays: dict, target: dict,
              info: dict | None = None) -> pathlib.Path:
    """Writes a head folder (module docstring); returns its resolved path."""
    import orbax.checkpoint as ocp

    folder = pathlib.Path(folder).resolve()
    folder.mkdir(parents=True, exist_ok=True)
    (folder / HEAD_MARKER).unlink(missing_ok=True)
    checkpointer = ocp.StandardCheckpointer()
    with interrupts.deferred():
        checkpointer.save(folder / "params", {k: np.asarray(v) for k, v in arrays.items()}, force=True)
        checkpointer.wait_until_finished()
    marker = {"kind": kind, "config": dataclasses.asdict(config), "target": target, "layout": LAYOUT,
              "info": info or {}}
    write_text_atomic(folder / HEAD_MARKER, json.dumps(marker, indent=1, default=lambda x: x.tolist()))
    return folder


def is_head_dir(path: str | pathlib.Path) -> bool:
    return (pathlib.Path(path) / HEAD_MARKER).is_file()


def head_kind(path: str | pathlib.Path) -> str | None:
    """"eagle" or "medusa" for a head folder, None for anything else."""
    if not is_head_dir(path):
        return None
    try:
        return json.loads((pathlib.Path(path) / HEAD_MARKER).read_text()).get("kind")
    except (OSError, ValueError):
        return "unreadable"


def target_fingerprint(target) -> str:
    """What a head records of the model it was trained on (a `LoadedModel`): a hash of the weights'
    names and shapes and of the tokenizer, so a head is refused on a different target of the same width."""
    shapes = sorted((name, tuple(np.shape(array))) for name, array in target.model.params().items())
    text = json.dumps([shapes, target.tokenizer.identity])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def load_head(path: str | pathlib.Path, kind: str | None = None, target=None):
    """The drafter (`EagleDrafter` / `MedusaDrafter`) of a head folder; ValueError naming the folder
    when it is missing, unreadable, of another kind than `kind`, inconsistent, or trained on another
    model than `target` (a `LoadedModel`; heads saved without a fingerprint are not checked)."""
    import orbax.checkpoint as ocp

    folder = pathlib.Path(path).expanduser().resolve()
    if not is_head_dir(folder):
        raise ValueError(f"{folder} is not a drafter head folder (no {HEAD_MARKER}); train one with "
                         "specdec-jax train-draft --kind eagle|medusa")
    try:
        marker = json.loads((folder / HEAD_MARKER).read_text())
        config_cls, drafter_cls, shapes = KINDS[marker["kind"]]
        config = config_cls(**marker["config"])
        arrays = {k: np.asarray(v) for k, v in ocp.StandardCheckpointer().restore(folder / "params").items()}
    except Exception as err:  # orbax and json raise many kinds; name the folder
        raise ValueError(f"{folder}: cannot read the head ({err.__class__.__name__}: {err})") from None
    if marker.get("layout") != LAYOUT:  # saved before the [out, in] layout of the decoder layer's matrices
        arrays = from_in_out_layout(arrays)
    if kind is not None and marker["kind"] != kind:
        raise ValueError(f"{folder} holds a {marker['kind']} head, not a {kind} head: use --drafter {marker['kind']}")
    recorded = (marker.get("target") or {}).get("fingerprint")
    if target is not None and recorded is not None and recorded != target_fingerprint(target):
        trained_on = (marker.get("info") or {}).get("target", "another model")
        raise ValueError(f"{folder} was trained on {trained_on} (fingerprint {recorded}), not on this target "
                         f"(fingerprint {target_fingerprint(target)}): train a head for it with specdec-jax train-draft")
    expected = shapes(config)
    got = {k: tuple(v.shape) for k, v in arrays.items()}
    if got != expected:
        raise ValueError(f"{folder}: weights {got} do not match the config's {expected}")
    if "vocab_map" in arrays:
        ids = arrays["vocab_map"]
        if len(np.unique(ids)) != len(ids) or ids.min() < 0 or ids.max() >= config.vocab_size:
            raise ValueError(f"{folder}: vocab_map must hold distinct ids in [0, {config.vocab_size})")
    return drafter_cls(config, arrays)
