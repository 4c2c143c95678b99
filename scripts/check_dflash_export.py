"""Check a DFlash drafter trained here (`train-draft --kind dflash`) against the dflash package (run by hand).

    python scripts/check_dflash_export.py OUT/head --target tiny-random --reference-python /tmp/refvenv/bin/python

(the virtual environment of dflash 0.1.0 and speculators 0.9.0: the recipe is in the docstring of
scripts/make_published_drafter_references.py). With this project's python it loads the folder with this
project's loader, computes the logits of one block over a random context of target features, and saves them;
then it runs itself under ``--reference-python``, where dflash's ``DFlashDraftModel.from_pretrained`` loads
the same folder (no missing or unexpected weights; the block size, mask token and target layer ids of
config.json) and computes the same block in float64. It fails unless the logits agree within 1e-3.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import subprocess
import sys
import tempfile

import numpy as np

CONTEXT = 7  # context tokens of the block


def ours(folder: str, target_name: str, out: pathlib.Path) -> None:
    import jax
    import jax.numpy as jnp

    from specdec_jax.drafters.dflash import block_logits, write_context
    from specdec_jax.drafters.published import load_drafter_folder
    from specdec_jax.models import load_model

    jax.config.update("jax_default_matmul_precision", "highest")
    target = load_model(target_name)
    drafter = load_drafter_folder(folder, "dflash", target)
    cfg, params = drafter.config, drafter.params
    model, target_params = target.as_target()
    rng = np.random.default_rng(0)
    block = cfg.block_size
    features = rng.standard_normal((1, CONTEXT, len(cfg.feature_layers), cfg.target_hidden_size)).astype(np.float32)
    tokens = np.asarray([[int(rng.integers(0, cfg.layer.vocab_size))] + [cfg.mask_token] * (block - 1)], np.int32)
    cache = write_context(cfg, params, cfg.layer.init_cache(1, CONTEXT), jnp.asarray(features),
                          jnp.arange(CONTEXT)[None])
    logits = block_logits(cfg, params, model, target_params, jnp.asarray(tokens), CONTEXT + jnp.arange(block)[None],
                          cache, jnp.ones((1, block, CONTEXT), bool), jnp.ones((1, block, block), bool))
    arrays = target.model.arrays()
    head = arrays["lm_head"] if "lm_head" in arrays else arrays["embed"]
    np.savez(out, features=features, tokens=tokens, logits=np.asarray(logits), embed=arrays["embed"], lm_head=head)


def reference(folder: str, data_file: str) -> None:
    import torch
    from dflash.model import DFlashDraftModel

    data = np.load(data_file)
    model, info = DFlashDraftModel.from_pretrained(folder, output_loading_info=True, torch_dtype=torch.float64)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    config = json.loads((pathlib.Path(folder) / "config.json").read_text())
    assert model.block_size == config["block_size"], (model.block_size, config["block_size"])
    assert model.mask_token_id == config["dflash_config"]["mask_token_id"]
    assert list(model.target_layer_ids) == config["dflash_config"]["target_layer_ids"]
    model = model.to(torch.float64).eval()
    context, block = data["features"].shape[1], data["tokens"].shape[1]
    with torch.no_grad():
        hidden = model(position_ids=torch.arange(context + block)[None],
                       noise_embedding=torch.from_numpy(data["embed"][data["tokens"]]).double(),
                       target_hidden=torch.from_numpy(data["features"].reshape(1, context, -1)).double())
    logits = hidden.numpy() @ data["lm_head"].T.astype(np.float64)
    error = float(np.abs(logits - data["logits"]).max())
    print(f"dflash loads {folder} cleanly: block {model.block_size}, mask {model.mask_token_id}, layers "
          f"{list(model.target_layer_ids)}; max |logit difference| {error:.2e}")
    assert error < 1e-3, error


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder")
    parser.add_argument("--target", default="tiny-random", help="the target the drafter was trained for")
    parser.add_argument("--reference-python", default="/tmp/refvenv/bin/python")
    parser.add_argument("--reference-data", help=argparse.SUPPRESS)  # the second step, in the reference python
    args = parser.parse_args()
    if args.reference_data:
        reference(args.folder, args.reference_data)
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        data = pathlib.Path(tmp) / "ours.npz"
        ours(args.folder, args.target, data)
        return subprocess.run([args.reference_python, __file__, args.folder, "--reference-data", str(data)]).returncode


if __name__ == "__main__":
    sys.exit(main())
