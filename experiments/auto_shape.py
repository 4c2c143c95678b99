"""`--gamma auto` against fixed shapes, per Spec-Bench category (batch 1) or per batch (batch > 1).

Makes the entries of experiments/README.md "Does `--gamma auto` ever lose to plain decoding at
batch 1?" (`--out experiments/results/auto_shape/batch1`), "Does `--gamma auto` keep batches of 4
at or above plain decoding?" (`.../batch4`), "Does `--gamma auto` hold up at batch 16 and 32?"
(`.../batch16_32`) and "Does choosing the tree size per round beat the chain?" (`.../trees`).

For each batch size and each shape, `specdec-jax bench` runs the n-gram drafter (or `--drafter
eagle` etc.: `--draft-model` defaults to what the recipes left in the cache) beside plain decoding,
measured side by side in every run, on the held-out Spec-Bench questions of the recipes' split (the
first `--per-category` of each category; by default 1 at batch 1, all five at larger batches),
ragged batches in file order. Writes to `--out` (default experiments/results/auto_shape): one
bench report per run (bench_<drafter>_b<batch>_g<shape>.json), summary.json (every run in --out
so far: runs with other settings are merged in), table.md (batch 1: speedup over plain decoding
and tokens per round per category, one column per shape; batch > 1: the same per batch, with
auto's verify widths and its own predicted speedup) and auto_shape.png.

A shape is a chain length (``4``), ``auto`` (`--gamma auto`), a fixed token tree of N nodes
(``t16``) or ``tauto`` (`--tree-nodes auto`), the trees of `--tree-depth` x `--tree-topk`.

    python experiments/auto_shape.py --shapes 1 2 4 auto --repeats 3 --out experiments/results/auto_shape/batch1
    python experiments/auto_shape.py --batch-sizes 4 --shapes auto 4 --per-category 2 --max-prompt-tokens 1024 \\
        --repeats 5 --out experiments/results/auto_shape/batch4
    python experiments/auto_shape.py --batch-sizes 16 32 --shapes auto --per-category 3 --max-prompt-tokens 1024 \\
        --repeats 2 --out experiments/results/auto_shape/batch16_32
    python experiments/auto_shape.py --shapes auto tauto --tree-depth 8 --tree-topk 2 \\
        --out experiments/results/auto_shape/trees
    python experiments/auto_shape.py --tables-only --out experiments/results/auto_shape/batch4
"""

from __future__ import annotations

import argparse
import json
import pathlib

from common import RESULTS, cached_draft_model, category_bars, prompts_file, pyplot, recipe_questions, write_json

from specdec_jax.bench import bench
from specdec_jax.config import DrafterSettings, run_config


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


def run_name(config: dict) -> tuple[str, str]:
    """(file name stem, column name) of a bench report's run, from its config."""
    if config.get("tree_nodes") is not None:
        nodes = config["tree_nodes"]
        shape = "tauto" if nodes == "auto" else f"t{nodes}"
        tree = f"x{config['tree_depth']}x{config['tree_topk']}"
    else:
        shape, tree = str(config["gamma"]), ""
    suffix = "" if config.get("ngram_min", DrafterSettings.ngram_min) == DrafterSettings.ngram_min else f"_min{config['ngram_min']}"
    column = shape + (f" min{config['ngram_min']}" if suffix else "")
    return f"{config['drafter']}_b{config['batch_size']}_g{shape}{tree}{suffix}", column


def summary_entry(report: dict) -> dict:
    """What the tables and the plot read of a bench report."""
    config, overall = report["config"], report["overall"]
    return {
        "drafter": config["drafter"], "batch_size": config["batch_size"], "gamma": run_name(config)[1],
        "overall": {k: overall[k] for k in ("speedup", "tokens_per_round", "tie_aware_equal", "verify_widths",
                                            "width_rounds", "prompts")},
        "categories": {c: {"speedup": a["speedup"], "tokens_per_round": a["tokens_per_round"]}
                       for c, a in report["categories"].items()},
        "batches": [{"categories": list(dict.fromkeys(b["categories"])), "rows": len(b["categories"]),
                     "speedup": b["speedup"], "tokens_per_round": b["tokens_per_round"],
                     "width_rounds": b["width_rounds"], "predicted_speedup": b["predicted_speedup"]}
                    for b in report["batches"]]}


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
    parser.add_argument("--draft-model", default=None, help="default: the recipe's head or draft in the cache")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=1, help="timed runs per prompt and shape (medians)")
    parser.add_argument("--max-prompt-tokens", type=int, default=None,
                        help="only prompts of at most this many tokens (chat template included): large batches of "
                             "the 4k-token rag prompts take most of an hour each on a 2-core CPU")
    parser.add_argument("--out", type=pathlib.Path, default=RESULTS / "auto_shape")
    parser.add_argument("--tables-only", action="store_true",
                        help="bench nothing: summary.json, table.md and the plot again from the reports in --out")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    summary_path = args.out / "summary.json"
    if args.tables_only:
        summary = {run_name(r["config"])[0]: summary_entry(r)
                   for r in (json.loads(p.read_text()) for p in sorted(args.out.glob("bench_*.json")))}
        return write_tables(summary, args.out)
    summary = json.loads(summary_path.read_text()) if summary_path.is_file() else {}
    draft_model = args.draft_model or cached_draft_model(args.drafter)
    # Spec-Bench text is read at run time, never committed
    with prompts_file(recipe_questions("heldout", max_prompt_tokens=args.max_prompt_tokens)) as prompts:
        for batch in args.batch_sizes:
            for shape in args.shapes:
                cfg = run_config(drafter=args.drafter, draft_model=draft_model, batch_size=batch,
                                max_new_tokens=args.max_new_tokens, prompts_file=str(prompts),
                                **({} if args.ngram_min is None else {"ngram_min": args.ngram_min}),
                                **shape_fields(shape, args.tree_depth, args.tree_topk))
                per_category = args.per_category if args.per_category else 1 if batch == 1 else None
                report = bench(cfg, repeats=args.repeats, per_category=per_category)
                name = run_name(report["config"])[0]
                write_json(args.out / f"bench_{name}.json", report)
                summary[name] = summary_entry(report)
                write_json(summary_path, summary)
    return write_tables(summary, args.out)


def write_tables(summary: dict, out: pathlib.Path) -> int:
    write_json(out / "summary.json", summary)
    (out / "table.md").write_text(table(summary))
    plot(summary, out / "auto_shape.png")
    print(table(summary))
    return 0


def label(shape: str) -> str:
    """Column name of a shape: gamma 4, gamma auto, tree 16, tree auto."""
    return f"tree {shape[1:]}" if shape.startswith("t") else f"gamma {shape}"


def runs_at(summary: dict, batch: int) -> tuple[dict, list[str]]:
    """(shape -> run, shapes in column order) of the runs at one batch size."""
    runs = {str(s["gamma"]): s for s in summary.values() if s["batch_size"] == batch}
    return runs, sorted(runs, key=lambda g: (g == "auto", g))


def batch_label(b: dict, batch: int) -> str:
    if len(b["categories"]) <= 2:
        return ", ".join(b["categories"]) + (f" ({b['rows']} rows)" if b["rows"] != batch else "")
    return f"{b['rows']} rows, {len(b['categories'])} categories"


def cell(x: dict | None) -> str:
    return "-" if x is None else f"{x['speedup']:.2f}x ({x['tokens_per_round']:.2f})"


def table(summary: dict) -> str:
    """Markdown: batch 1, one row per category; larger batches, one row per batch; one column per shape:
    speedup over plain decoding (tokens per round)."""
    lines = []
    for batch in sorted({s["batch_size"] for s in summary.values()}):
        runs, shapes = runs_at(summary, batch)
        lines += [f"batch {batch}: speedup over plain decoding (tokens per round)", ""]
        if batch == 1:
            categories = sorted({c for s in runs.values() for c in s["categories"]})
            lines += ["| category | " + " | ".join(label(g) for g in shapes) + " |", "|---|" + "---|" * len(shapes)]
            for c in [*categories, "overall"]:
                cells = [runs[g]["overall"] if c == "overall" else runs[g]["categories"].get(c) for g in shapes]
                lines.append(f"| {c} | " + " | ".join(map(cell, cells)) + " |")
        else:
            auto = runs.get("auto")
            widths = "/".join(map(str, auto["overall"]["verify_widths"])) if auto else ""
            extra = [f"auto's widths {widths}", "auto predicted"] if auto else []
            lines += ["| batch (rows' categories) | " + " | ".join([*map(label, shapes), *extra]) + " |",
                      "|---|" + "---|" * (len(shapes) + len(extra))]
            first = runs[shapes[0]]["batches"]
            for i, b in enumerate(first):
                cells = [cell(runs[g]["batches"][i]) if i < len(runs[g]["batches"]) else "-" for g in shapes]
                if auto:
                    a = auto["batches"][i]
                    cells += ["/".join(map(str, a["width_rounds"])), f"{a['predicted_speedup']:.2f}"]
                lines.append(f"| {batch_label(b, batch)} | " + " | ".join(cells) + " |")
            lines.append("| overall | " + " | ".join([cell(runs[g]["overall"]) for g in shapes]
                                                     + (["/".join(map(str, auto["overall"]["width_rounds"])), ""]
                                                        if auto else [])) + " |")
        lines.append("")
    return "\n".join(lines)


def plot(summary: dict, png: pathlib.Path) -> None:
    plt = pyplot()
    batches = sorted({s["batch_size"] for s in summary.values()})
    fig, axes = plt.subplots(len(batches), 1, figsize=(12, 3.5 * len(batches)), squeeze=False)
    for ax, batch in zip(axes[:, 0], batches):
        runs, shapes = runs_at(summary, batch)
        if batch == 1:
            groups = sorted({c for s in runs.values() for c in s["categories"]}) + ["overall"]
            values = {label(g): [(runs[g]["overall"] if c == "overall" else runs[g]["categories"].get(c, {}))
                                 .get("speedup", float("nan")) for c in groups] for g in shapes}
        else:
            first = runs[shapes[0]]["batches"]
            groups = [batch_label(b, batch) for b in first] + ["overall"]
            values = {label(g): [b["speedup"] for b in runs[g]["batches"]] + [runs[g]["overall"]["speedup"]]
                      for g in shapes}
        category_bars(ax, groups, values, ylabel="speedup over plain", title=f"batch {batch}", one_line=True)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    raise SystemExit(main())
