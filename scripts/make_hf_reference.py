"""Write the transformers reference fixture for SmolLM2-135M-Instruct (run once; CI needs no torch).

    pip install -e ".[hf]" && python scripts/make_hf_reference.py

For the first 10 Spec-Bench questions (first turn, chat template applied) it
records, from transformers loading the same GGUF in float32: the prompt token
ids, the last-position logits (top 64 and every 97th id), and the greedy
continuation (64 tokens or up to EOS) with the top-2 logit margin at each step.
For the first 4 it also records (`penalty_records`) the greedy continuation
with repetition_penalty 1.3 (transformers' rule: every prompt and generated
token) and the top-2 margin of the penalized logits at each step.
"""

from __future__ import annotations

import argparse
import json
import pathlib

import numpy as np

from specdec_jax.data import spec_bench_questions
from specdec_jax.models.fetch import smollm2_gguf

OUT = pathlib.Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "smollm2_hf_reference.json"
NUM_PROMPTS, NEW_TOKENS, TOP, STRIDE = 10, 64, 64, 97
PENALTY_PROMPTS, REPETITION_PENALTY = 4, 1.3


def smollm2_in_transformers():
    """(tokenizer, model): transformers' SmolLM2-135M-Instruct from the registry's GGUF, float32, eval mode."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = smollm2_gguf()
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    return tok, AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()


def main() -> None:
    import torch

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, default=OUT)
    args = parser.parse_args()
    tok, model = smollm2_in_transformers()
    records, penalty_records = [], []
    for q in spec_bench_questions()[:NUM_PROMPTS]:
        ids = tok.apply_chat_template([{"role": "user", "content": q["turns"][0]}], add_generation_prompt=True)
        ids = list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, -1].double().numpy()
        greedy, margins = greedy_decode(model, tok, ids)
        top = np.argsort(-logits)[:TOP]
        records.append({
            "question_id": q["question_id"],
            "category": q["category"],
            "prompt_ids": ids,
            "top_ids": top.tolist(),
            "top_logits": logits[top].tolist(),
            "strided_logits": logits[::STRIDE].tolist(),
            "greedy": greedy,
            "greedy_margins": margins,
        })
        print(q["question_id"], len(ids), tok.decode(greedy)[:60].replace("\n", " "))
        if len(penalty_records) < PENALTY_PROMPTS:
            tokens, margins = greedy_decode(model, tok, ids, REPETITION_PENALTY)
            penalty_records.append({"question_id": q["question_id"], "prompt_ids": ids, "tokens": tokens,
                                    "margins": margins})
            print("  repetition_penalty:", tok.decode(tokens)[:60].replace("\n", " "))
    meta = {"model": "SmolLM2-135M-Instruct.Q4_1.gguf", "dtype": "float32", "stride": STRIDE,
            "new_tokens": NEW_TOKENS, "repetition_penalty": REPETITION_PENALTY,
            "transformers": __import__("transformers").__version__, "torch": torch.__version__}
    args.out.write_text(json.dumps({"meta": meta, "records": records, "penalty_records": penalty_records}))
    print(f"wrote {args.out} ({args.out.stat().st_size // 1024} KiB)")


def greedy_decode(model, tok, ids: list[int], repetition_penalty: float = 1.0) -> tuple[list[int], list[float]]:
    """(tokens, margins): transformers' greedy continuation of `ids` (NEW_TOKENS or up to EOS) and the
    top-2 margin of the processed logits (after the penalty) at each step."""
    import torch

    with torch.no_grad():
        out = model.generate(
            torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False, output_scores=True,
            return_dict_in_generate=True, pad_token_id=tok.eos_token_id, repetition_penalty=repetition_penalty,
        )  # stops at EOS. (transformers 5.24 with eos_token_id=None returned other logits here.)
    margins = [float(np.diff(np.sort(step[0].double().numpy())[-2:])[0]) for step in out.scores]
    return out.sequences[0, len(ids):].tolist(), margins


if __name__ == "__main__":
    main()
