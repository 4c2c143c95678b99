"""Write the reference of the DFlash drafters (run by hand; CI needs no torch).

    /tmp/refvenv/bin/python scripts/make_dflash_reference.py [--out FILE]

(the virtual environment of dflash 0.1.0 and speculators 0.9.0: the recipe is in the docstring of
scripts/make_published_drafter_references.py, whose ``greedy`` and ``dflash_run`` this script reuses).

Every case of ``tests/dflash_weights.py``: the target is transformers' own model of its config
(`published_head_weights.TARGETS`, float64, eager attention) with `hf_family_weights.state_dict`'s
weights; the drafter is the dflash package's ``DFlashDraftModel`` (a ``Qwen3Config`` with
``num_target_layers``, ``block_size`` and ``dflash_config``: the mask token, the case's target layer ids)
with `dflash_weights.state_dict`'s weights, run in float64. The mask token is the target's most frequent
greedy token after the prompt.

``tests/fixtures/dflash.json`` holds each target's config dict, weight checksum and prompt, and per case
its config.json (``save_pretrained``'s), the weight checksum and, at the drafter's block size and at twice
it, greedy ``dflash_generate``'s generated ids (checked equal to the target's own greedy tokens), its
per-round acceptance lengths (tokens emitted per round) and the draft logits ``[ROUNDS, block - 1, V]``
of its first rounds (rounded to 6 decimals). Per `dflash_weights.CONVERTED` case: the config.json of
speculators' ``DFlashConverter`` applied to the z-lab folder (its weights checked equal to z-lab's).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import pathlib
import sys
import tempfile

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
OUT = ROOT / "tests" / "fixtures" / "dflash.json"


sys.path.insert(0, str(ROOT / "scripts"))
import make_published_head_reference as phr  # noqa: E402 (puts tests/ on the path, loads the shared modules)

fw, phw, hf, ref = phr.fw, phr.phw, phr.hf, phr.ref
dw = phr.load("dflash_weights", ROOT / "tests" / "dflash_weights.py")


def dflash_model(case: str, target, mask: int):
    """The dflash package's ``DFlashDraftModel`` of the case with `dflash_weights.state_dict` (float32)."""
    import torch
    import transformers
    from dflash.model import DFlashDraftModel

    spec, tc = dw.CASES[case], target.config
    dflash = {"mask_token_id": mask}
    if spec["layer_ids"] is not None:
        dflash["target_layer_ids"] = spec["layer_ids"]
    layer = {k: v for k, v in dw.LAYER.items() if k != "model_type"}
    config = transformers.Qwen3Config(
        vocab_size=tc.vocab_size, hidden_size=tc.hidden_size, num_hidden_layers=spec["layers"],
        rope_theta=tc.rope_parameters["rope_theta"], rms_norm_eps=1e-6, max_position_embeddings=256,
        tie_word_embeddings=False, num_target_layers=tc.num_hidden_layers, block_size=spec["block_size"],
        dflash_config=dflash, architectures=["DFlashDraftModel"], **layer)
    model = DFlashDraftModel(config)
    weights = dw.state_dict(case)
    model.load_state_dict({k: torch.from_numpy(v) for k, v in weights.items()}, strict=True)
    assert model.target_layer_ids == dw.layer_ids(case), (case, model.target_layer_ids)
    return model, weights


def dflash_case(case: str, target, out: pathlib.Path) -> dict:
    """The case's record (module docstring)."""
    import torch

    spec = dw.CASES[case]
    prompt = phw.prompt(spec["target"])
    expected = ref.greedy(target, prompt, dw.MAX_NEW)
    mask = max(set(expected), key=expected.count)
    model, weights = dflash_model(case, target, mask)
    model.save_pretrained(out / case)
    model = model.to(torch.float64).eval()
    record = {"config_json": json.loads((out / case / "config.json").read_text()),
              "weights_sha256": fw.checksum(weights), "mask_token_id": mask, "blocks": {}}
    for block in (spec["block_size"], 2 * spec["block_size"]):
        run = ref.dflash_run(model, target, prompt, block, dw.MAX_NEW)
        assert run["output_ids"] == expected, (case, block, run["output_ids"], expected)
        logits = run.pop("draft_logits")[: dw.ROUNDS]
        record["blocks"][str(block)] = {**run, "draft_logits": np.round(logits.numpy(), 6).tolist()}
        print(case, "block", block, "acceptance", run["acceptance_lengths"])
    return record


def converted_case(case: str, source: str, out: pathlib.Path, target_folder: pathlib.Path) -> dict:
    """speculators' conversion of the z-lab folder ``source``: its config.json, weights checked equal."""
    from safetensors.numpy import load_file
    from speculators.convert.dflash.converter import DFlashConverter

    ids = [i + 1 for i in dw.layer_ids(source)]
    DFlashConverter().convert(out / source, out / case, str(target_folder), validate=False,
                              aux_hidden_state_layer_ids=ids)
    config = json.loads((out / case / "config.json").read_text())
    config["speculators_config"]["verifier"]["name_or_path"] = f"targets/{dw.CASES[source]['target']}"
    saved, weights = load_file(out / case / "model.safetensors"), dw.state_dict(source)
    assert saved.keys() == weights.keys() and all(np.array_equal(saved[k], v) for k, v in weights.items()), case
    return {"config_json": config, "source": source}


def main() -> None:
    import torch
    import transformers

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, default=OUT)
    args = parser.parse_args()
    torch.manual_seed(0)  # random inits are all overwritten by loads
    records, targets, models = {}, {}, {}
    with tempfile.TemporaryDirectory() as tmp, contextlib.chdir(tmp):
        out = pathlib.Path(tmp)
        for name in sorted({spec["target"] for spec in dw.CASES.values()}):
            kwargs = {k: v for k, v in phw.TARGETS[name].items() if k != "model_type"}
            model, config_dict, weights = hf.transformers_model(fw, phw.TARGETS[name]["model_type"], kwargs)
            model.to(torch.float32).save_pretrained(out / "targets" / name)
            models[name] = model.to(torch.float64).eval()
            targets[name] = {"config": config_dict, "weights_sha256": fw.checksum(weights), "prompt": phw.prompt(name)}
        for case, spec in dw.CASES.items():
            records[case] = dflash_case(case, models[spec["target"]], out)
        for case, source in dw.CONVERTED.items():
            records[case] = converted_case(case, source, out, out / "targets" / dw.CASES[source]["target"])
    from importlib.metadata import version
    meta = {name: version(name) for name in ("torch", "transformers", "dflash", "speculators")}
    meta.update(compute_dtype="float64", seed=dw.SEED, transformers_runtime=transformers.__version__)
    args.out.write_text(json.dumps({"meta": meta, "targets": targets, "cases": records}, separators=(",", ":")) + "\n")
    print(f"wrote {args.out} ({args.out.stat().st_size // 1024} KiB)")


if __name__ == "__main__":
    main()
