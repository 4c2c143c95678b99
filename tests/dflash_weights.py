"""Tiny DFlash drafters (z-lab's ``DFlashDraftModel``), weights regenerated from a fixed seed (never
committed), on the targets of `published_head_weights.TARGETS`.

Shared by ``scripts/make_dflash_reference.py``, which loads the weights into the dflash package's own
model, runs ``dflash_generate`` and records ``tests/fixtures/dflash.json``, and ``tests/test_dflash.py``,
which writes the same weights as z-lab's ``save_pretrained`` folder (and as speculators' conversion of it)
and loads them through this project's loader. Neither imports torch here.

A case of `CASES` names its target, draft layers, z-lab ``target_layer_ids`` (None: the package's
default) and block size; `state_dict` draws its weights with z-lab's names (float32; ``H`` the target's
width, ``m`` target states read)::

    fc.weight [H, m*H]   N(0, 1 / fan_in) (every matrix)      layers.{i}.*   Qwen3 decoder layers
    *norm*.weight        1 + 0.2 N(0, 1)                        (q_norm, k_norm included)

The layers' ``o_proj`` and ``down_proj`` are scaled by 0.1 (weak layers: a mask position's output stays
near its embedding, so with a mask token the target often emits, drafts are accepted and rounds accept
several tokens).
"""

from __future__ import annotations

import zlib

import numpy as np

import published_head_weights as phw

SEED = 20261205
MAX_NEW = 24  # tokens generated per recorded run
ROUNDS = 2  # rounds of draft logits recorded per block size
LAYER = dict(model_type="qwen3", intermediate_size=48, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
CASES = {  # case -> target, draft layers, z-lab target_layer_ids (None: default), block size
    "zlab-qwen3": dict(target="qwen3", layers=2, layer_ids=[0, 3, 6], block_size=4),  # 6 = L - 1: final-normed
    "zlab-llama": dict(target="llama", layers=2, layer_ids=None, block_size=3),
}
CONVERTED = {"speculators-llama": "zlab-llama"}  # speculators' DFlashConverter output of a z-lab case


def default_layer_ids(num_target: int, num_draft: int) -> list[int]:
    """The dflash package's ``build_target_layer_ids``."""
    if num_draft == 1:
        return [num_target // 2]
    return [round(1 + i * (num_target - 4) / (num_draft - 1)) for i in range(num_draft)]


def layer_ids(case: str) -> list[int]:
    """The case's z-lab target layer ids (output of layer i)."""
    spec = CASES[case]
    return spec["layer_ids"] or default_layer_ids(phw.TARGETS[spec["target"]]["num_hidden_layers"], spec["layers"])


def state_dict(case: str) -> dict[str, np.ndarray]:
    """The case's weights with z-lab's names (module docstring)."""
    spec, width = CASES[case], phw.TARGETS[CASES[case]["target"]]["hidden_size"]
    rng = np.random.default_rng([SEED, zlib.crc32(case.encode())])
    layer = dict(LAYER, hidden_size=width)
    shapes = {"fc.weight": (width, len(layer_ids(case)) * width), "hidden_norm.weight": (width,)}
    for index in range(spec["layers"]):
        shapes.update(phw._layer_shapes(f"layers.{index}.", layer, width))
    shapes["norm.weight"] = (width,)
    weights = {name: phw._draw(rng, name, shape) for name, shape in shapes.items()}
    for name in weights:
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            weights[name] = weights[name] * np.float32(0.1)
    return weights
