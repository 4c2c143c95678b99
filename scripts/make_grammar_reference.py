"""Write the fixture of constrained greedy decoding by transformers (run once; CI needs no torch).

    pip install -e ".[hf]" && python scripts/make_grammar_reference.py

SmolLM2-135M-Instruct loaded by transformers from the same GGUF (float32); for each prompt and
constraint of CASES, transformers' greedy decoding with a logits processor that allows only the
tokens outlines-core's own `Index` allows in the current state (built here from transformers'
tokenizer and GPT-2's byte table, not from specdec_jax's tables), until EOS or NEW_TOKENS. Recorded:
the prompt ids, the output ids and the top-2 margin of the masked logits at each step (for the
tie-aware comparison). The constraints are ones whose whole matches never extend to a longer
match, so a greedy row under them ends at EOS where specdec_jax stops with reason "grammar".
"""

from __future__ import annotations

import argparse
import json
import pathlib

import numpy as np

from make_hf_reference import smollm2_in_transformers  # this folder's script

OUT = pathlib.Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "grammar_hf_reference.json"
NEW_TOKENS = 96
PERSON = {"type": "object", "required": ["name", "age"],
          "properties": {"name": {"type": "string"}, "age": {"type": "integer"}}}
ITEMS = {"type": "array", "items": {"type": "string"}, "minItems": 2, "maxItems": 4}
CASES = [  # (prompt, {"regex": ...} or {"json_schema": ...})
    ("On what date did Apollo 11 land on the Moon? Answer as YYYY-MM-DD.", {"regex": r"[0-9]{4}-[0-9]{2}-[0-9]{2}"}),
    ("Is the Pacific the largest ocean? Answer yes or no.", {"regex": r"(yes|no)"}),
    ("Describe a fictional person as JSON with their name and age.", {"json_schema": json.dumps(PERSON)}),
    ("List three colours as a JSON array of strings.", {"json_schema": json.dumps(ITEMS)}),
    ("Describe the sky in one short sentence.", {"regex": r"[A-Z][a-z]+( [a-z]+){2,8}\."}),
]


def outlines_index(tok, pattern: str):
    """outlines-core's Index of ``pattern`` over transformers' tokenizer: each token's bytes through
    GPT-2's byte table (special tokens left out), EOS the tokenizer's."""
    from outlines_core import Index, Vocabulary
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    byte_of = {c: b for b, c in bytes_to_unicode().items()}
    special = set(tok.all_special_ids)
    ids: dict[bytes, list[int]] = {}
    for token, index in tok.get_vocab().items():
        if index in special:
            continue
        ids.setdefault(bytes(byte_of[c] for c in token), []).append(index)
    return Index(pattern, Vocabulary(tok.eos_token_id, ids))


def main() -> None:
    import torch
    from outlines_core.json_schema import build_regex_from_schema
    from transformers import LogitsProcessor, LogitsProcessorList

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, default=OUT)
    args = parser.parse_args()
    tok, model = smollm2_in_transformers()

    class Constrained(LogitsProcessor):
        """Allows the tokens the Index allows after the text generated so far."""

        def __init__(self, index, prompt_len: int):
            self.index, self.prompt_len = index, prompt_len

        def __call__(self, input_ids, scores):
            state = self.index.get_initial_state()
            for t in input_ids[0, self.prompt_len:].tolist():
                state = self.index.get_next_state(state, t)
            allowed = torch.full_like(scores, -torch.inf)
            allowed[0, self.index.get_allowed_tokens(state)] = 0
            return scores + allowed

    records = []
    for prompt, constraint in CASES:
        pattern = constraint.get("regex") or build_regex_from_schema(constraint["json_schema"])
        ids = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True)
        ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False, output_scores=True,
                                 return_dict_in_generate=True, pad_token_id=tok.eos_token_id,
                                 logits_processor=LogitsProcessorList([Constrained(outlines_index(tok, pattern),
                                                                                   len(ids))]))
        tokens = out.sequences[0, len(ids):].tolist()
        margins = [float(np.diff(np.sort(step[0].double().numpy())[-2:])[0]) for step in out.scores]
        records.append({"prompt": prompt, "constraint": constraint, "prompt_ids": ids, "tokens": tokens,
                        "margins": margins})
        print(repr(tok.decode(tokens)))
    meta = {"model": "SmolLM2-135M-Instruct.Q4_1.gguf", "dtype": "float32", "new_tokens": NEW_TOKENS,
            "transformers": __import__("transformers").__version__, "torch": torch.__version__,
            "outlines_core": __import__("importlib.metadata").metadata.version("outlines-core")}
    args.out.write_text(json.dumps({"meta": meta, "records": records}))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
