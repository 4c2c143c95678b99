"""Write the transformers reference of each decoder family and of RoPE scaling (run once; CI needs no torch).

    pip install -e ".[hf]" && python scripts/make_hf_family_reference.py          # both fixtures
    python scripts/make_hf_family_reference.py families    # or: rope

Each model is transformers' own, from a config of ``tests/hf_family_weights.py``: the config from
``AutoConfig.for_model(model_type, **kwargs)``, the model from ``AutoModelForCausalLM.from_config``
(float64, eager attention), the numpy weights of ``state_dict(config.to_dict())`` loaded with
``load_state_dict(strict=True)`` (the weights are regenerated from their seed, never stored).

``tests/fixtures/hf_families.json`` (``families``): per family of ``FAMILIES`` (llama, mistral, qwen2,
qwen3) the config dict (``config.to_dict()``, as ``save_pretrained`` writes it), the weights'
checksum and the logits of every position of ``sequences(V)`` (``[2, 12]`` tokens, one pass, no
padding; ``[2, 12, V]``, computed in float64, rounded to 6 decimals).

``tests/fixtures/hf_rope.json`` (``rope``): per Llama of ``ROPE_VARIANTS`` (llama3, linear, yarn;
tied and untied) the config dict, its ``rope_scaling`` as given, the weights' checksum, and for the
prompts ``rope_prompts(V)`` (``[2, 16]``) the greedy continuation (``ROPE_NEW_TOKENS``, each step a
pass over the whole sequence) with the top-2 logit margin of each step, the last-position logits of
the prompt (``first_logits [2, V]``) and of the last step (``last_logits``). Every margin must
exceed ``MIN_MARGIN``, so that the tokens are the reference's, not a near-tie's.
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import json
import pathlib

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures"
OUT = {"families": FIXTURES / "hf_families.json", "rope": FIXTURES / "hf_rope.json"}
MIN_MARGIN = 1e-2  # 100x the tests' logit tolerance


def load_weights_module():
    """``tests/hf_family_weights.py``, imported by path (``tests`` is not a package)."""
    spec = importlib.util.spec_from_file_location("hf_family_weights", ROOT / "tests" / "hf_family_weights.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def transformers_model(fw, model_type: str, kwargs: dict):
    """``(model, config dict, numpy weights)``: transformers' float64 eval model of ``kwargs`` with
    ``fw.state_dict``'s weights, loaded strictly (the names must be transformers' own)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(model_type, **copy.deepcopy(kwargs))  # it edits a rope_scaling dict in place
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").to(torch.float64).eval()
    config_dict = json.loads(config.to_json_string(use_diff=False))
    weights = fw.state_dict(config_dict)
    expected = set(model.state_dict())
    tied = bool(config_dict.get("tie_word_embeddings"))
    if tied:  # the tied head is in the state dict under its own name, the same tensor as the embedding
        weights_in = dict(weights, **{"lm_head.weight": weights["model.embed_tokens.weight"]})
    else:
        weights_in = weights
    if set(weights_in) != expected:
        raise SystemExit(f"{model_type}: names differ from transformers': missing {sorted(expected - set(weights_in))},"
                         f" unexpected {sorted(set(weights_in) - expected)}")
    model.load_state_dict({k: torch.from_numpy(v.astype(np.float64)) for k, v in weights_in.items()}, strict=True)
    if tied != (model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()):
        raise SystemExit(f"{model_type}: lm_head tied = {not tied}, config says {tied}")
    return model, config_dict, weights


def families(fw) -> dict:
    """The content of hf_families.json."""
    import torch

    records, tokens = {}, None
    for model_type, kwargs in fw.FAMILIES.items():
        model, config_dict, weights = transformers_model(fw, model_type, kwargs)
        ids = fw.sequences(config_dict["vocab_size"])
        tokens = ids if tokens is None else tokens
        if not np.array_equal(ids, tokens):
            raise SystemExit("the families must share the token sequences (same vocab_size)")
        with torch.no_grad():
            out = model(torch.from_numpy(ids.astype(np.int64)), use_cache=False).logits  # [2, 12, V] float64
        records[model_type] = {"config": config_dict, "weights_sha256": fw.checksum(weights),
                               "dtype": str(next(model.parameters()).dtype),
                               "logits": np.round(out.numpy(), 6).tolist()}
        print(model_type, "logits", tuple(out.shape), "std", float(out.std()), "max |logit|", float(out.abs().max()))
    return {"tokens": tokens.tolist(), "families": records}


def greedy(model, prompts: np.ndarray, steps: int) -> tuple[np.ndarray, np.ndarray, list[np.ndarray]]:
    """``(tokens i64[B, steps], top-2 margins f64[B, steps], last-position logits of each step [B, V])``:
    greedy decoding, each step one pass over the whole sequence."""
    import torch

    sequence, logits = torch.from_numpy(prompts.astype(np.int64)), []
    with torch.no_grad():
        for _ in range(steps):
            logits.append(model(sequence, use_cache=False).logits[:, -1].numpy())
            sequence = torch.cat([sequence, torch.from_numpy(logits[-1].argmax(-1))[:, None]], dim=1)
    top2 = np.sort(np.stack(logits, axis=1), axis=-1)[..., -2:]  # [B, steps, 2]
    return sequence[:, prompts.shape[1]:].numpy(), top2[..., 1] - top2[..., 0], logits


def rope(fw) -> dict:
    """The content of hf_rope.json."""
    records, prompts = {}, None
    for name, kwargs in fw.ROPE_VARIANTS.items():
        model, config_dict, weights = transformers_model(fw, "llama", kwargs)
        prompts = fw.rope_prompts(config_dict["vocab_size"])
        tokens, margins, logits = greedy(model, prompts, fw.ROPE_NEW_TOKENS)
        if margins.min() < MIN_MARGIN:
            raise SystemExit(f"{name}: a greedy step's top-2 margin is {margins.min():.2e} < {MIN_MARGIN}: "
                             "choose other prompts")
        records[name] = {"config": config_dict, "rope_scaling": kwargs["rope_scaling"],
                         "weights_sha256": fw.checksum(weights), "greedy": tokens.tolist(),
                         "greedy_margins": np.round(margins, 6).tolist(),
                         "first_logits": np.round(logits[0], 6).tolist(), "last_logits": np.round(logits[-1], 6).tolist()}
        print(name, "greedy", tokens.shape, "min margin", float(margins.min()))
    return {"prompts": prompts.tolist(), "new_tokens": fw.ROPE_NEW_TOKENS, "variants": records}


def main() -> None:
    import torch
    import transformers

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("which", nargs="?", choices=[*OUT, "all"], default="all", help="the fixture to write")
    parser.add_argument("--out", type=pathlib.Path, help="where to write it (one fixture only)")
    args = parser.parse_args()
    if args.out and args.which == "all":
        parser.error("--out needs families or rope")
    fw = load_weights_module()
    torch.manual_seed(0)  # from_config's random init is overwritten by the strict load
    meta = {"transformers": transformers.__version__, "torch": torch.__version__, "attn_implementation": "eager",
            "compute_dtype": "float64", "stored_dtype": "float32, rounded to 6 decimals in JSON", "seed": fw.SEED}
    for which, make in (("families", families), ("rope", rope)):
        if args.which in (which, "all"):
            out = args.out or OUT[which]
            out.write_text(json.dumps({"meta": meta, **make(fw)}, separators=(",", ":")) + "\n")
            print(f"wrote {out} ({out.stat().st_size // 1024} KiB)")


if __name__ == "__main__":
    main()
