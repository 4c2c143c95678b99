"""Issue 17: `--gamma auto` against every fixed shape, per Spec-Bench category and batch size.

For each batch size and each shape (plain decoding is the bench's own baseline,
measured side by side in every run), `specdec-jax bench` runs the n-gram drafter
(or `--drafter eagle --draft-model HEAD`) on the held-out Spec-Bench questions
of the heads' split (`experiments/eagle_recipe.py`; the first `--per-category`
of each category at batch 1, then all of them ragged in batches). Writes
`experiments/results/auto_shape/summary.json`, `table.md` and `auto_shape.png`
(speedup over plain per category, one bar per shape).

A shape is a chain length (``4``), ``auto`` (`--gamma auto`), a fixed token tree
of N nodes (``t16``) or ``tauto`` (`--tree-nodes auto`), the trees of
`--tree-depth` x `--tree-topk`.

    python experiments/auto_shape.py                                # batch 1, shapes 1 2 4 auto
    python experiments/auto_shape.py --batch-sizes 4 16 32 --shapes 4 auto --per-category 2
    python experiments/auto_shape.py --batch-sizes 16 32 --shapes 4 auto --per-category 3 --max-prompt-tokens 1024
    python experiments/auto_shape.py --shapes 4 auto t16 tauto --tree-depth 8 --tree-topk 2
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import tempfile

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from eagle_recipe import heldout_prompts_file  # noqa: E402

from specdec_jax.bench import bench  # noqa: E402
from specdec_jax.config import RunConfig  # noqa: E402

RESULTS = pathlib.Path(__file__).parent / "results" / "auto_shape"


def shape_of(text: str) -> int | str:
    if text in ("auto", "tauto") or text.startswith("t") and text[1:].isdigit():
        return text
    return int(text)


def shape_fields(shape: int | str, depth: int, topk: int) -> dict:
    """RunConfig fields of a shape (module docstring)."""
    if isinstance(shape, str) and shape.startswith("t"):
        nodes = "auto" if shape == "tauto" else int(shape[1:])
        return {"tree_nodes": nodes, "tree_depth": depth, "tree_topk": topk}
    return {"gamma": shape}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", type=shape_of, default=[1, 2, 4, "auto"])
    parser.add_argument("--batch-sizes", nargs="+", type=int, default=[1])
    parser.add_argument("--per-category", type=int, default=None,
                        help="prompts per category (default: 1 at batch 1, all 5 at larger batches)")
    parser.add_argument("--ngram-min", type=int, default=None, help="the n-gram drafter's shortest match (default 2)")
    parser.add_argument("--tree-depth", type=int, default=8, help="depth of the t<N> and tauto trees")
    parser.add_argument("--tree-topk", type=int, default=2, help="top-k of the t<N> and tauto trees")
    parser.add_argument("--drafter", default="ngram")
    parser.add_argument("--draft-model", default=None)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=1, help="timed runs per prompt and shape (medians)")
    parser.add_argument("--max-prompt-tokens", type=int, default=None,
                        help="only prompts of at most this many tokens (chat template included): large batches of "
                             "the 4k-token rag prompts take most of an hour each on a 2-core CPU")
    parser.add_argument("--out", type=pathlib.Path, default=RESULTS)
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    summary_path = args.out / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.is_file() else {}
    with tempfile.TemporaryDirectory() as folder:  # Spec-Bench text is read at run time, never committed
        prompts = heldout_prompts_file(pathlib.Path(folder))
        if args.max_prompt_tokens:
            prompts = shorter_prompts(prompts, args.max_prompt_tokens)
        for batch in args.batch_sizes:
            for shape in args.shapes:
                cfg = RunConfig(drafter=args.drafter, draft_model=args.draft_model, batch_size=batch,
                                max_new_tokens=args.max_new_tokens, prompts_file=str(prompts),
                                **({} if args.ngram_min is None else {"ngram_min": args.ngram_min}),
                                **shape_fields(shape, args.tree_depth, args.tree_topk))
                per_category = args.per_category if args.per_category else 1 if batch == 1 else None
                report = bench(cfg, repeats=args.repeats, per_category=per_category)
                tree = f"x{args.tree_depth}x{args.tree_topk}" if cfg.is_tree else ""
                name = f"{args.drafter}_b{batch}_g{shape}{tree}" + (f"_min{args.ngram_min}" if args.ngram_min else "")
                (args.out / f"bench_{name}.json").write_text(json.dumps(report, indent=1, default=str))
                summary[name] = {
                    "drafter": args.drafter, "batch_size": batch,
                    "gamma": shape if args.ngram_min is None else f"{shape} min{args.ngram_min}",
                    "overall": {k: report["overall"][k] for k in ("speedup", "tokens_per_round", "tie_aware_equal",
                                                                  "verify_widths", "width_rounds", "prompts")},
                    "categories": {c: {"speedup": a["speedup"], "tokens_per_round": a["tokens_per_round"]}
                                   for c, a in report["categories"].items()}}
                summary_path.write_text(json.dumps(summary, indent=1, default=str))
    (args.out / "table.md").write_text(table(summary))
    plot(summary, args.out / "auto_shape.png")
    print(table(summary))
    return 0


def shorter_prompts(path: pathlib.Path, most: int) -> pathlib.Path:
    """The prompts file at `path` less the prompts over `most` tokens (chat template included)."""
    from specdec_jax.data import load_prompts_file
    from specdec_jax.models import load_model
    from specdec_jax.runner import encode

    tok = load_model("smollm2-135m").tokenizer
    keep = {r["id"] for r in load_prompts_file(path) if len(encode(tok, r["prompt"], False)) <= most}
    lines = [line for line in path.read_text().splitlines() if json.loads(line)["question_id"] in keep]
    print(f"{len(lines)} prompts of at most {most} tokens", flush=True)
    out = path.with_name(f"prompts_under_{most}.jsonl")
    out.write_text("\n".join(lines))
    return out


def label(shape: str) -> str:
    """Column name of a shape: gamma 4, gamma auto, tree 16, tree auto."""
    return f"tree {shape[1:]}" if shape.startswith("t") else f"gamma {shape}"


def table(summary: dict) -> str:
    """Markdown: one row per (batch, category), one column per shape: speedup (tokens per round)."""
    lines = []
    for batch in sorted({s["batch_size"] for s in summary.values()}):
        runs = {str(s["gamma"]): s for s in summary.values() if s["batch_size"] == batch}
        shapes = sorted(runs, key=lambda g: (g == "auto", g))
        categories = sorted({c for s in runs.values() for c in s["categories"]})
        lines += [f"batch {batch}: speedup over plain decoding (tokens per round)", "",
                  "| category | " + " | ".join(label(g) for g in shapes) + " |",
                  "|---|" + "---|" * len(shapes)]
        for c in [*categories, "overall"]:
            cells = [runs[g]["overall"] if c == "overall" else runs[g]["categories"].get(c) for g in shapes]
            lines.append(f"| {c} | " + " | ".join("-" if x is None else f"{x['speedup']:.2f}x ({x['tokens_per_round']:.2f})"
                                                  for x in cells) + " |")
        lines.append("")
    return "\n".join(lines)


def plot(summary: dict, png: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    batches = sorted({s["batch_size"] for s in summary.values()})
    fig, axes = plt.subplots(len(batches), 1, figsize=(12, 3.5 * len(batches)), squeeze=False)
    for ax, batch in zip(axes[:, 0], batches):
        runs = {str(s["gamma"]): s for s in summary.values() if s["batch_size"] == batch}
        shapes = sorted(runs, key=lambda g: (g == "auto", g))
        categories = sorted({c for s in runs.values() for c in s["categories"]}) + ["overall"]
        x = np.arange(len(categories))
        for i, g in enumerate(shapes):
            values = [(runs[g]["overall"] if c == "overall" else runs[g]["categories"].get(c, {})).get("speedup", np.nan)
                      for c in categories]
            ax.bar(x + (i - len(shapes) / 2 + 0.5) * 0.8 / len(shapes), values, 0.8 / len(shapes), label=label(g))
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_xticks(x, categories, rotation=30, ha="right")
        ax.set(ylabel="speedup over plain", title=f"batch {batch}")
        ax.legend(ncol=len(shapes), fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    raise SystemExit(main())
