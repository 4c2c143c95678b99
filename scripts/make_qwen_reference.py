"""Write the transformers reference fixture for the Qwen2.5-Coder pair (run once; CI needs no torch).

    pip install -e ".[hf]" && python scripts/make_qwen_reference.py

For each of qwen2.5-coder-1.5b and qwen2.5-coder-0.5b, from transformers loading the
same GGUF (float32) and its GGUF tokenizer, it records:
- the token ids of the first turn of every Spec-Bench question under the chat template
  (Qwen's default system prompt included), as a count and a sha256 per question id
  (`ids_digest`), and in full for the first `FULL_IDS` questions;
- for `GREEDY_PROMPTS` questions (coding and general), the last-position logits (top 64)
  and the greedy continuation (`NEW_TOKENS` tokens or up to EOS) with the top-2 logit margin
  at each step, for tie-aware comparison (docs/design.md section 6).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import pathlib

import numpy as np

from specdec_jax.data import spec_bench_questions
from specdec_jax.models.fetch import model_gguf

OUT = pathlib.Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "qwen_pair_hf_reference.json"
MODELS = ("qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b")
GREEDY_IDS = (121, 81, 111, 131)  # Spec-Bench question ids of the training split: coding, writing, math, extraction
FULL_IDS, NEW_TOKENS, TOP = 10, 48, 64


def ids_digest(ids: list[int]) -> str:
    """sha256 of the ids written as compact JSON: what the test recomputes from our tokenizer."""
    return hashlib.sha256(json.dumps(ids, separators=(",", ":")).encode()).hexdigest()


def main() -> None:
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, default=OUT)
    args = parser.parse_args()
    questions = spec_bench_questions()
    by_id = {q["question_id"]: q for q in questions}
    fixture = {"meta": {"new_tokens": NEW_TOKENS, "dtype": "float32", "transformers": transformers.__version__,
                        "torch": torch.__version__}, "models": {}}
    for name in MODELS:
        gguf = model_gguf(name)
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)

        def prompt_ids(text):
            ids = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
            return list(ids["input_ids"] if hasattr(ids, "keys") else ids)

        all_ids = {q["question_id"]: prompt_ids(q["turns"][0]) for q in questions}
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()
        greedy = []
        for qid in GREEDY_IDS:
            ids = all_ids[qid]
            with torch.no_grad():
                out = model.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False,
                                     output_scores=True, output_logits=True, return_dict_in_generate=True,
                                     pad_token_id=tok.eos_token_id)
            first = out.logits[0][0].double().numpy()
            top = np.argsort(-first)[:TOP]
            margins = [float(np.diff(np.sort(s[0].double().numpy())[-2:])[0]) for s in out.scores]
            tokens = out.sequences[0, len(ids):].tolist()
            greedy.append({"question_id": qid, "category": by_id[qid]["category"], "top_ids": top.tolist(),
                           "top_logits": first[top].tolist(), "tokens": tokens, "margins": margins})
            print(name, qid, len(ids), tok.decode(tokens)[:70].replace("\n", " "), flush=True)
        fixture["models"][name] = {
            "ids_digest": {str(qid): [len(ids), ids_digest(ids)] for qid, ids in all_ids.items()},
            "full_ids": {str(q["question_id"]): all_ids[q["question_id"]] for q in questions[:FULL_IDS]},
            "greedy": greedy,
        }
        del model
    args.out.write_text(json.dumps(fixture))
    print(f"wrote {args.out} ({args.out.stat().st_size // 1024} KiB)")


if __name__ == "__main__":
    main()
