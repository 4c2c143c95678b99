"""Write the reference of the published drafter heads (run by hand; CI needs no torch).

    /tmp/refvenv/bin/python scripts/make_published_head_reference.py [--out FILE]

(the virtual environment of speculators 0.9.0 and medusa-llm 0.1: the recipe is in the docstring of
scripts/make_published_drafter_references.py, whose reference functions this script reuses).

Every case of ``tests/published_head_weights.py``: the target is transformers' own model of its config
(float64, eager attention) with `hf_family_weights.state_dict`'s weights; the head's weights
(`head_state_dict`) are loaded into speculators' ``Eagle3DraftModel`` (SafeAILab cases too: the same
architecture, ``midlayer.*`` being ``layers.0.*``; a head wider than its target gets an ``fc`` of input
``m * Ht``) or into Medusa-1 heads built as medusa-llm's ``MedusaModel`` builds them (ResBlocks of
``medusa.model.medusa_model`` then a vocabulary head, applied to the target's final-norm output).

``tests/fixtures/published_heads.json`` holds the prompts, each target's config dict and weight checksum,
and per case: its config.json (speculators' and medusa-llm's own ``save_pretrained`` output; SafeAILab:
`safeailab_config`), the head's weight checksum, the target's greedy token t0 after the prompt,
``first_logits [P, Vd]`` (input j pairs prompt token j + 1, or t0 for the last, with the target states of
token j: the logits of token j + 2), the greedy chain from the last input (``chain_drafts``, target ids,
and ``chain_logits [CHAIN, Vd]``, each draft fed the head's own output); Medusa: ``logits [K, 3, V]`` of
the last three positions. Logits are rounded to 6 decimals. Checks on the way: each speculators folder
that `write_folder` writes (what the test loads) reloads through ``SpeculatorModel.from_pretrained`` with
the same outputs; the SafeAILab folder saved with ``torch.save`` converts with speculators'
``Eagle3Converter`` to the same outputs, and `drafters.published.read_torch_file` reads it back exactly.
``torch_sample`` is a small ``torch.save`` file (base64) of known tensors for the torch-free reader's test.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import importlib.util
import io
import json
import pathlib
import sys
import tempfile

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
OUT = ROOT / "tests" / "fixtures" / "published_heads.json"


def load(name: str, path: pathlib.Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


sys.path.insert(0, str(ROOT / "tests"))
fw = load("hf_family_weights", ROOT / "tests" / "hf_family_weights.py")
phw = load("published_head_weights", ROOT / "tests" / "published_head_weights.py")
hf = load("make_hf_family_reference", ROOT / "scripts" / "make_hf_family_reference.py")
ref = load("make_published_drafter_references", ROOT / "scripts" / "make_published_drafter_references.py")


def rounded(tensor) -> list:
    return np.round(np.asarray(tensor, np.float64), 6).tolist()


def eagle3_model(case: str, target, weights: dict):
    """speculators' ``Eagle3DraftModel`` of the case with ``weights`` (float64), and its config dict."""
    import torch
    import transformers
    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig

    spec, vocab = phw.CASES[case], target.config.vocab_size
    kwargs = {k: v for k, v in spec["layer"].items() if k != "model_type"}
    layer = transformers.AutoConfig.for_model(spec["layer"]["model_type"], vocab_size=vocab, tie_word_embeddings=False,
                                              **{"num_hidden_layers": 1, **kwargs})
    layer._attn_implementation = "eager"
    verifier = VerifierConfig(name_or_path=f"targets/{spec['target']}", architectures=target.config.architectures or [])
    config = Eagle3SpeculatorConfig(
        transformer_layer_config=layer, draft_vocab_size=spec["draft_vocab"] or vocab,
        eagle_aux_hidden_state_layer_ids=spec.get("layer_ids"), **spec.get("flags", {}),
        speculators_config=SpeculatorsConfig(algorithm="eagle3", default_proposal_method="greedy", verifier=verifier,
                                              proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=4)]))
    model = Eagle3DraftModel(config)
    if weights["fc.weight"].shape != tuple(model.fc.weight.shape):  # a head wider than its target
        model.fc = torch.nn.Linear(weights["fc.weight"].shape[1], layer.hidden_size, bias=False)
    if "d2t" in weights:
        model.load_vocab_mappings(torch.from_numpy(weights["t2d"]), torch.from_numpy(weights["d2t"]))
    state = {k: torch.from_numpy(np.asarray(v, np.float64) if v.dtype == np.float32 else v) for k, v in weights.items()}
    if "embed_tokens.weight" not in state:  # SafeAILab: the target's embedding
        state["embed_tokens.weight"] = target.get_input_embeddings().weight.detach().clone()
    missing, unexpected = model.to(torch.float64).load_state_dict(state, strict=False)
    if unexpected or set(missing) - {"verifier_lm_head.weight", "verifier_norm.weight"}:
        raise SystemExit(f"{case}: names differ from speculators': missing {missing}, unexpected {unexpected}")
    return model.eval()


def eagle3_case(case: str, target, weights: dict, out: pathlib.Path, target_folder: pathlib.Path) -> dict:
    """The case's record (module docstring), after the reload / conversion checks."""
    spec = phw.CASES[case]
    prompt, ids = phw.prompt(spec["target"]), phw.layer_ids(case)
    model = eagle3_model(case, target, weights)
    arrays, info = ref.eagle3_references(model, target, prompt, ids)
    if spec["format"] == "speculators":
        model.to(getattr(__import__("torch"), spec.get("dtype", "float32"))).save_pretrained(out / "saved")
        config = json.loads((out / "saved" / "config.json").read_text())
        phw.write_folder(case, config, weights, out / case)
        ref.reload_check(out / case, out, target, prompt, ids, arrays)
    else:
        config = phw.safeailab_config(case)
        if "embed_tokens.weight" not in weights:
            safeailab_checks(case, config, weights, out, target, target_folder, arrays)
    record = {"config_json": config, "weights_sha256": fw.checksum(weights), "t0": info["t0"],
              "chain_drafts": info["chain_drafts"], "first_logits": rounded(arrays["first_logits"]),
              "chain_logits": rounded(arrays["chain_logits"])}
    print(case, "first_logits", tuple(arrays["first_logits"].shape), "chain", info["chain_drafts"])
    return record


def safeailab_checks(case, config, weights, out, target, target_folder, arrays) -> None:
    """torch.save the SafeAILab folder; our torch-free reader reads it exactly, and speculators' converter
    turns it into a head with the same outputs."""
    import torch
    from speculators.convert.eagle.eagle3_converter import Eagle3Converter

    from specdec_jax.drafters.published import read_torch_file

    folder = out / f"{case}-bin"
    folder.mkdir()
    names = phw.safeailab_names(weights)
    torch.save({k: torch.from_numpy(v) for k, v in names.items()}, folder / "pytorch_model.bin")
    (folder / "config.json").write_text(json.dumps(config))
    back = read_torch_file(folder / "pytorch_model.bin")
    assert back.keys() == names.keys() and all(np.array_equal(back[k], v) for k, v in names.items()), case
    Eagle3Converter().convert(folder, out / f"{case}-converted", str(target_folder), validate=False)
    ref.reload_check(out / f"{case}-converted", out, target, phw.prompt(phw.CASES[case]["target"]),
                     phw.layer_ids(case), arrays)


def medusa_case(case: str, target, weights: dict, out: pathlib.Path) -> dict:
    """Medusa-1 heads as ``MedusaModel`` builds them, run as its forward runs them."""
    import torch
    from medusa.model.medusa_model import MedusaConfig, ResBlock

    spec, hidden, vocab = phw.CASES[case], target.config.hidden_size, target.config.vocab_size
    heads = torch.nn.ModuleList([torch.nn.Sequential(ResBlock(hidden), torch.nn.Linear(hidden, vocab, bias=False))
                                 for _ in range(spec["heads"])])
    heads.load_state_dict({k: torch.from_numpy(v.astype(np.float64)) for k, v in weights.items()}, strict=True)
    with torch.no_grad():
        final = target.model(input_ids=torch.tensor([phw.prompt(spec["target"])]))[0]  # final-norm states
        logits = torch.stack([head(final) for head in heads.to(torch.float64)])[:, 0, -3:]  # [K, 3, V]
    MedusaConfig(medusa_num_heads=spec["heads"], medusa_num_layers=1,
                 base_model_name_or_path=f"targets/{spec['target']}").save_pretrained(out / "medusa")
    config = json.loads((out / "medusa" / "config.json").read_text())
    return {"config_json": config, "weights_sha256": fw.checksum(weights), "logits": rounded(logits)}


def torch_sample() -> str:
    """base64 of ``torch.save`` of tensors the reader's test rebuilds with numpy (strided, offset, shared
    storage, bfloat16, int64, bool, a Parameter)."""
    import torch

    base = torch.arange(10, dtype=torch.float32)
    tensors = {"strided": torch.arange(6, dtype=torch.float32).reshape(2, 3).t(), "offset": base[3:7],
               "whole": base, "bf16": torch.tensor([1.5, -2.0, 0.25], dtype=torch.bfloat16),
               "long": torch.tensor([[1, -2]], dtype=torch.int64), "mask": torch.tensor([True, False, True]),
               "param": torch.nn.Parameter(torch.full((2,), 0.5))}
    buffer = io.BytesIO()
    torch.save(tensors, buffer)
    return base64.b64encode(buffer.getvalue()).decode()


def main() -> None:
    import torch
    import transformers

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, default=OUT)
    args = parser.parse_args()
    torch.manual_seed(0)  # random inits are all overwritten by loads
    records, targets = {}, {}
    with tempfile.TemporaryDirectory() as tmp, contextlib.chdir(tmp):
        out = pathlib.Path(tmp)
        models = {}
        for name, kwargs in phw.TARGETS.items():
            kwargs = {k: v for k, v in kwargs.items() if k != "model_type"}
            model, config_dict, weights = hf.transformers_model(fw, phw.TARGETS[name]["model_type"], kwargs)
            model.to(torch.float32).save_pretrained(out / "targets" / name)
            ref.write_tokenizer(out / "targets" / name, config_dict["vocab_size"])
            models[name] = (model.to(torch.float64).eval(), weights)
            targets[name] = {"config": config_dict, "weights_sha256": fw.checksum(weights),
                             "prompt": phw.prompt(name)}
        for case, spec in phw.CASES.items():
            target, target_weights = models[spec["target"]]
            weights = phw.head_state_dict(case, target_weights)
            if spec["format"] == "medusa":
                records[case] = medusa_case(case, target, weights, out)
            else:
                records[case] = eagle3_case(case, target, weights, out, out / "targets" / spec["target"])
    from importlib.metadata import version
    meta = {name: version(name) for name in ("torch", "transformers", "speculators", "medusa-llm")}
    meta.update(compute_dtype="float64", seed=phw.SEED, transformers_runtime=transformers.__version__)
    args.out.write_text(json.dumps({"meta": meta, "chain": phw.CHAIN, "targets": targets, "cases": records,
                                    "torch_sample": torch_sample()}, separators=(",", ":")) + "\n")
    print(f"wrote {args.out} ({args.out.stat().st_size // 1024} KiB)")


if __name__ == "__main__":
    main()
