"""Prompt data: Spec-Bench questions (read by path, never copied) and prompt files."""

from __future__ import annotations

import json
import os
import pathlib

DEFAULT_SPEC_BENCH = pathlib.Path(__file__).resolve().parents[2] / "shared" / "data" / "spec_bench" / "question.jsonl"


def spec_bench_path() -> pathlib.Path:
    """`$SPEC_BENCH`, else ../shared/data/spec_bench/question.jsonl next to the repository."""
    return pathlib.Path(os.environ.get("SPEC_BENCH") or DEFAULT_SPEC_BENCH)


def spec_bench_questions(path: str | os.PathLike | None = None) -> list[dict]:
    """Spec-Bench questions: dicts with question_id, category, turns (list of str)."""
    path = pathlib.Path(path) if path else spec_bench_path()
    if not path.is_file():
        raise ValueError(f"Spec-Bench questions not found at {path} (set $SPEC_BENCH)")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


# Prompts of this project's own writing for the demo: two copy-heavy ones (where
# prompt lookup shines) and two open-ended ones (where it finds little).
BUILTIN_PROMPTS = (
    {
        "id": "rewrite-notes",
        "prompt": "Rewrite these meeting notes as a clean bulleted list, keeping every item:\n"
        "- the build server runs out of disk every friday\n- the release checklist is missing the changelog step\n"
        "- two new interns start on monday and need accounts\n- the coffee machine on floor three is broken again",
    },
    {
        "id": "fix-code",
        "prompt": "Add type hints to this Python function and return the full function:\n\n"
        "def moving_average(values, window):\n    result = []\n    for i in range(len(values) - window + 1):\n"
        "        chunk = values[i:i + window]\n        result.append(sum(chunk) / window)\n    return result",
    },
    {"id": "story", "prompt": "Write a short story about a lighthouse keeper who finds a message in a bottle."},
    {"id": "explain", "prompt": "Explain why the sky is blue to a ten-year-old."},
)

# The demo of the Qwen2.5-Coder pair: two coding prompts and a general one, each under 64 tokens in the chat
# template (one prompt bucket: one KV capacity to calibrate and compile for).
PAIR_PROMPTS = (
    {
        "id": "palindrome",
        "prompt": "Write a Python function that checks whether a string is a palindrome, ignoring case, spaces and "
        "punctuation. Include a docstring and two doctest examples.",
    },
    {"id": "merge-lists", "prompt": "Write a Python function that merges two sorted lists into one sorted list, "
     "with a docstring."},
    BUILTIN_PROMPTS[3],  # explain
)


def load_prompts_file(path: str | os.PathLike) -> list[dict]:
    """Prompts from JSONL: each line has `prompt` (str) or Spec-Bench `turns` (the first turn is used);
    the id comes from `id` or `question_id` (default: line number). Returns [{"id", "prompt", ...}]."""
    path = pathlib.Path(path)
    if not path.is_file():
        raise ValueError(f"prompts file not found: {path}")
    prompts = []
    try:
        text_of_file = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        line = path.read_bytes()[: err.start].count(b"\n") + 1
        raise ValueError(f"{path}:{line}: not UTF-8 text (byte {err.start}); save the file as UTF-8") from None
    for number, line in enumerate(text_of_file.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}:{number}: not valid JSON ({err.msg})") from None
        if not isinstance(record, dict):
            raise ValueError(f"{path}:{number}: expected a JSON object")
        if isinstance(record.get("prompt"), str):
            text = record["prompt"]
        elif isinstance(record.get("turns"), list) and record["turns"] and isinstance(record["turns"][0], str):
            text = record["turns"][0]
        else:
            raise ValueError(f"{path}:{number}: needs a string 'prompt' or a non-empty list 'turns'")
        ident = record.get("id", record.get("question_id", number))
        prompts.append({"id": ident, "prompt": text, **({"category": record["category"]} if "category" in record else {})})
    if not prompts:
        raise ValueError(f"{path}: no prompts in file")
    return prompts
