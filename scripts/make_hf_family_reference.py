"""Write the transformers reference of each decoder family (run once; CI needs no torch).

    pip install -e ".[hf]" && python scripts/make_hf_family_reference.py

For each family of ``tests/hf_family_weights.py`` (llama, mistral, qwen2, qwen3) it builds
transformers' config from ``FAMILIES``, the model with ``AutoModelForCausalLM.from_config``
(float64, eager attention), loads the numpy weights of ``state_dict(config.to_dict())`` with
``load_state_dict(strict=True)`` (the weights are regenerated from their seed, never stored),
and records the logits of every position of ``sequences(V)`` (``[2, 12]`` tokens, one pass,
no padding). Writes:

``tests/fixtures/hf_families.json``: versions, the token ids, and per family the config dict
(``config.to_dict()``, as ``save_pretrained`` writes it), the weights' checksum and the ``[2, 12, V]``
logits (computed in float64, rounded to 6 decimals).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import pathlib

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
OUT = ROOT / "tests" / "fixtures" / "hf_families.json"


def load_weights_module():
    """``tests/hf_family_weights.py``, imported by path (``tests`` is not a package)."""
    spec = importlib.util.spec_from_file_location("hf_family_weights", ROOT / "tests" / "hf_family_weights.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> None:
    import torch
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, default=OUT, help="the JSON fixture to write")
    args = parser.parse_args()
    fw = load_weights_module()
    torch.manual_seed(0)  # from_config's random init is overwritten by the strict load below
    families = {}
    tokens = None
    for model_type, kwargs in fw.FAMILIES.items():
        config = AutoConfig.for_model(model_type, **kwargs)
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
        ids = fw.sequences(config_dict["vocab_size"])
        tokens = ids if tokens is None else tokens
        if not np.array_equal(ids, tokens):
            raise SystemExit("the families must share the token sequences (same vocab_size)")
        with torch.no_grad():
            out = model(torch.from_numpy(ids.astype(np.int64)), use_cache=False).logits  # [2, 12, V] float64
        families[model_type] = {"config": config_dict, "weights_sha256": fw.checksum(weights),
                                "dtype": str(next(model.parameters()).dtype),
                                "logits": np.round(out.numpy(), 6).tolist()}
        print(model_type, "logits", tuple(out.shape), "std", float(out.std()), "max |logit|", float(out.abs().max()))
    meta = {"transformers": transformers.__version__, "torch": torch.__version__, "attn_implementation": "eager",
            "compute_dtype": "float64", "stored_dtype": "float32, rounded to 6 decimals in JSON", "seed": fw.SEED}
    args.out.write_text(json.dumps({"meta": meta, "tokens": tokens.tolist(), "families": families},
                                   separators=(",", ":")) + "\n")
    print(f"wrote {args.out} ({args.out.stat().st_size // 1024} KiB)")


if __name__ == "__main__":
    main()
