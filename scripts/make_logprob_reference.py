"""Write transformers' log-probabilities of greedy continuations (run once; CI needs no torch).

    pip install -e ".[hf]" && python scripts/make_logprob_reference.py

``tests/fixtures/logprob_reference.json`` holds, per model, prompts and transformers' greedy
continuation (``generate(..., output_scores=True)``) with, per generated token, its log-probability
from ``compute_transition_scores(..., normalize_logits=True)`` (the raw law's ``log_softmax``, what
``--logprobs`` reports by default), the ``TOP`` most likely ids with their log-probabilities, and the
top-2 logit margin (a step whose margin is tiny would make the tokens a near-tie's):

- ``qwen2``: the tiny Qwen2 of ``tests/hf_family_weights.py`` (weights regenerated from their seed,
  float64), its two ``sequences`` cut to ``PROMPT`` tokens, ``NEW_TOKENS`` tokens each;
- ``smollm2``: SmolLM2-135M-Instruct from the registry's GGUF (float32, `make_hf_reference.py`), the
  first ``SMOLLM2_PROMPTS`` Spec-Bench questions with the chat template, ``NEW_TOKENS`` tokens each.
"""

from __future__ import annotations

import importlib.util
import json
import pathlib

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
OUT = ROOT / "tests" / "fixtures" / "logprob_reference.json"
PROMPT, NEW_TOKENS, TOP, SMOLLM2_PROMPTS = 8, 16, 5, 2


def script(name: str):
    """A sibling script imported by path (``scripts`` is not a package)."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def continuation(model, ids: list[int]) -> dict:
    """transformers' greedy continuation of ``ids`` with the log-probabilities described above."""
    import torch

    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False,
                             output_scores=True, return_dict_in_generate=True, pad_token_id=0)
        chosen = model.compute_transition_scores(out.sequences, out.scores, normalize_logits=True)[0]
    scores = torch.stack(out.scores, dim=1)[0].double()  # [NEW, V] raw logits of each step
    logp = torch.log_softmax(scores, dim=-1)
    top = torch.topk(logp, TOP, dim=-1)
    two = torch.topk(scores, 2, dim=-1).values
    return {"prompt": ids, "tokens": out.sequences[0, len(ids):].tolist(), "logprobs": chosen.double().tolist(),
            "top_ids": top.indices.tolist(), "top_logprobs": top.values.tolist(),
            "margins": (two[:, 0] - two[:, 1]).tolist()}


def main() -> None:
    fw = script("make_hf_family_reference").load_weights_module()
    families = script("make_hf_family_reference")
    model, config_dict, weights = families.transformers_model(fw, "qwen2", fw.FAMILIES["qwen2"])
    prompts = fw.sequences(config_dict["vocab_size"])[:, :PROMPT].tolist()
    record = {"qwen2": {"config": config_dict, "checksum": fw.checksum(weights),
                        "rows": [continuation(model, p) for p in prompts]}}
    tok, smollm2 = script("make_hf_reference").smollm2_in_transformers()
    from specdec_jax.data import spec_bench_questions

    rows = []
    for q in spec_bench_questions()[:SMOLLM2_PROMPTS]:
        ids = tok.apply_chat_template([{"role": "user", "content": q["turns"][0]}], add_generation_prompt=True)
        rows.append(continuation(smollm2, list(ids["input_ids"] if hasattr(ids, "keys") else ids)))
    record["smollm2"] = {"rows": rows}
    OUT.write_text(json.dumps(record, separators=(",", ":")))
    margins = [m for r in record["qwen2"]["rows"] + rows for m in r["margins"]]
    print(f"wrote {OUT} ({OUT.stat().st_size // 1024} KiB); smallest top-2 margin {np.min(margins):.3g}")


if __name__ == "__main__":
    main()
