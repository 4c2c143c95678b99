"""What grammar tables cost: states, classes, bytes and build time for a few schemas and regexes.

Makes the entry "How large are the grammar tables of real schemas and vocabularies?" of experiments/README.md
and the sizes table of docs/constraints.md. For each tokenizer (SmolLM2-135M, V = 49,152; Qwen2.5-Coder,
V = 151,936; read from the GGUF metadata, no weights loaded) and each constraint of CONSTRAINTS:
`constraints.compile_constraint` into an empty temporary cache (the build), then again (the cached load);
states S, classes C, the tables' bytes against a dense i32[S, V] table.

    python experiments/grammar_tables.py
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import tempfile
import time
from unittest import mock

from common import RESULTS, gguf_tokenizer, markdown_table, write_json

PERSON = {"type": "object", "required": ["name", "age"],
          "properties": {"name": {"type": "string"}, "age": {"type": "integer"}, "email": {"type": "string"}}}
ITEMS = {"type": "array", "items": {"type": "string"}, "maxItems": 5}
TOOL_CALL = {"type": "object", "required": ["name", "arguments"],
             "properties": {"name": {"enum": ["get_weather", "search_web", "send_email"]},
                            "arguments": {"type": "object", "required": ["city", "days"],
                                          "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}}
CONSTRAINTS = {  # name -> Constraint fields
    "person record (schema)": {"json_schema": json.dumps(PERSON)},
    "list of up to 5 strings (schema)": {"json_schema": json.dumps(ITEMS)},
    "tool call (schema)": {"json_schema": json.dumps(TOOL_CALL)},
    "ISO date `[0-9]{4}-[0-9]{2}-[0-9]{2}`": {"regex": r"[0-9]{4}-[0-9]{2}-[0-9]{2}"},
    "ISO date `\\d{4}-\\d{2}-\\d{2}`": {"regex": r"\d{4}-\d{2}-\d{2}"},
    "`(yes|no)`": {"regex": "(yes|no)"},
    "`\\w{1,8}` (a stress case)": {"regex": r"\w{1,8}"},
}
MODELS = ("smollm2-135m", "qwen2.5-coder-0.5b")


def measure(tokenizer) -> dict:
    """{constraint name: {states, classes, bytes, dense_bytes, build_s, load_s}} in a fresh temporary cache."""
    from specdec_jax.constraints import Constraint, compile_constraint

    out = {}
    with tempfile.TemporaryDirectory() as cache, mock.patch.dict(os.environ, {"SPECDEC_CACHE": cache}):
        for name, fields in CONSTRAINTS.items():
            start = time.perf_counter()
            tables = compile_constraint(Constraint(**fields), tokenizer)
            built = time.perf_counter()
            compile_constraint(Constraint(**fields), tokenizer)
            out[name] = {"states": tables.num_states, "classes": tables.num_classes, "bytes": tables.nbytes,
                         "dense_bytes": 4 * tables.num_states * tokenizer.vocab_size,
                         "build_s": built - start, "load_s": time.perf_counter() - built}
            print(name, out[name], flush=True)
    return out


def table(results: dict) -> str:
    def size(n: float) -> str:
        return f"{n / 1e9:.2f} GB" if n >= 1e9 else f"{n / 1e6:.1f} MB" if n >= 1e6 else f"{n / 1e3:.0f} kB"

    rows = []
    for name in CONSTRAINTS:
        row = [name.replace("|", "\\|")]  # a literal bar inside a table cell
        for model in results:
            r = results[model]["constraints"][name]
            row.append(f"{r['states']:,} / {r['classes']} / {size(r['bytes'])} / {size(r['dense_bytes'])} / "
                       f"{r['build_s']:.2f} s")
        rows.append(row)
    header = ["constraint"] + [f"{m} (V = {results[m]['vocab_size']:,}): S / C / tables / dense / build"
                               for m in results]
    return markdown_table(header, rows)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS))
    parser.add_argument("--out", type=pathlib.Path, default=RESULTS / "grammar_tables")
    args = parser.parse_args(argv)
    results = {}
    for model in args.models:
        tokenizer = gguf_tokenizer(model)
        results[model] = {"vocab_size": tokenizer.vocab_size, "constraints": measure(tokenizer)}
    args.out.mkdir(parents=True, exist_ok=True)
    write_json(args.out / "summary.json", results)
    (args.out / "table.md").write_text(table(results) + "\n")
    print(table(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
