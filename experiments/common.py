"""What every experiment script shares: Spec-Bench prompt subsets, and writing JSON + markdown table + PNG."""

from __future__ import annotations

import contextlib
import json
import pathlib
import tempfile

from specdec_jax.data import spec_bench_questions

RESULTS = pathlib.Path(__file__).resolve().parent / "results"


def markdown_table(header: list[str], rows: list[list]) -> str:
    cell = lambda x: f"{x:.3f}" if isinstance(x, float) else str(x)  # noqa: E731
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(cell(x) for x in row) + " |" for row in rows]) + "\n"


def save(out: pathlib.Path, payload: dict, table: str, figure=None, png: str = "plot.png") -> None:
    """Writes out/results.json, out/table.md and (if given) the matplotlib figure as out/<png>; prints the table."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(payload, indent=1, default=str))
    (out / "table.md").write_text(table)
    if figure is not None:
        figure.tight_layout()
        figure.savefig(out / png, dpi=120)
    print(table, end="")
    print(f"wrote {out}")


def pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


@contextlib.contextmanager
def spec_bench_subset(per_category: int, categories: list[str] | None = None):
    """Path of a temporary JSONL with the first `per_category` Spec-Bench questions of each category
    (read from the shared data at run time, never copied into the repository)."""
    seen: dict[str, int] = {}
    chosen = []
    for q in spec_bench_questions():
        cat = q["category"]
        if (categories is None or cat in categories) and seen.get(cat, 0) < per_category:
            seen[cat] = seen.get(cat, 0) + 1
            chosen.append({"question_id": q["question_id"], "category": cat, "turns": q["turns"][:1]})
    with tempfile.TemporaryDirectory() as folder:
        path = pathlib.Path(folder) / "prompts.jsonl"
        path.write_text("\n".join(json.dumps(q) for q in chosen))
        yield path
