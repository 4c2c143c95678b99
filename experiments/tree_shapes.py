"""Token trees against chains, per Spec-Bench category, and the verify cost curve Tv(N)/T1.

Makes the entries of experiments/README.md "How much do token trees raise tokens per round, for
each drafter?" (`--tokens-only --out experiments/results/tree_shapes/tokens`), "Does the n-gram
trie beat the chain on copy-heavy categories?" (`.../tokens_ngram`) and "Does a 16-node tree pay
in wall-clock time on this CPU?" (`.../timed_<drafter>`).

For each drafter and shape, `specdec-jax bench` runs the drafter beside plain decoding (side by
side in one run, medians) on the held-out Spec-Bench questions of the recipes' split, the first
`--per-category` of each of `--categories`, batch 1, greedy. A shape is `g4` (a chain of gamma 4)
or `t16x4x4` (a tree of 16 nodes, depth 4, top-4: n-gram matches, EAGLE's or the draft model's
expansion, Medusa's ranks; for Medusa, `--tree-choices FILE` adds the static tree of a choices
file, named `c<file stem>`). `--draft-model` defaults to what the recipes left in the cache
(`experiments/eagle_recipe.py`, `experiments/train_draft_recipe.py`). Also measured, on this
device: the target pass at each of `--widths` tokens over T1 (the cost of verifying N nodes),
and, from it, the speedup the cost model predicts on a device where Tv(N) is about T1 (a
prediction, not a measurement): tokens per round / (1 + drafting / T1).

`--tokens-only` skips the timing (and plain decoding): tokens per round, which is deterministic
and hardware-independent, from one `generate` run per category, a few seconds a prompt where a
timed bench takes about a minute on this CPU.

Writes to `--out` (default experiments/results/tree_shapes): summary.json (merged with the runs
already there), table.md, tree_shapes.png and, when timed, one bench report per run.

    python experiments/tree_shapes.py --tokens-only --drafter eagle draft-model medusa \\
        --shapes g4 t8x4x2 t16x4x4 --tree-choices configs/trees/medusa_4heads_16.json --per-category 2 \\
        --out experiments/results/tree_shapes/tokens
    python experiments/tree_shapes.py --tokens-only --drafter ngram --shapes g4 g8 t8x4x2 t12x4x3 t16x4x4 \\
        t16x8x2 t24x8x3 --categories summarization rag extraction translation --per-category 5 \\
        --out experiments/results/tree_shapes/tokens_ngram
    python experiments/tree_shapes.py --drafter medusa --shapes t16x4x4 --per-category 1 \\
        --out experiments/results/tree_shapes/timed_medusa
    python experiments/tree_shapes.py --tokens-only --model qwen2.5-coder-1.5b --drafter draft-model \\
        --draft-model qwen2.5-coder-0.5b --draft-vocab 32768 --shapes g2 g3 g4 t4x2x2 t8x3x2 t16x4x4 \\
        --categories coding writing --per-category 3 --widths 1 3 4 5 8 9 16 17 \\
        --out experiments/results/tree_shapes/tokens_pair
"""

from __future__ import annotations

import argparse
import json
import pathlib

from common import RESULTS, cached_draft_model, category_bars, prompts_file, pyplot, recipe_questions, write_json

from specdec_jax import engine
from specdec_jax.bench import bench
from specdec_jax.config import DrafterSettings, RunConfig, run_config
from specdec_jax.engine.calibration import time_target_pass
from specdec_jax.models import load_model
from specdec_jax.runner import build_drafter, drop_compiled_programs, prompt_records, run

DRAFTERS = ["ngram", "draft-model", "eagle", "medusa"]


def shape_fields(shape: str) -> dict:
    """RunConfig fields of ``g4`` (a chain) or ``t16x4x4`` (nodes x depth x top-k)."""
    if shape.startswith("g"):
        return {"gamma": int(shape[1:])}
    if shape.startswith("t"):
        nodes, depth, topk = (int(x) for x in shape[1:].split("x"))
        return {"tree_nodes": nodes, "tree_depth": depth, "tree_topk": topk}
    raise argparse.ArgumentTypeError(f"a shape is g<gamma> or t<nodes>x<depth>x<topk>, got {shape!r}")


def verify_cost_curve(target, widths: list[int], context: int = 200) -> dict[int, float]:
    """Seconds of one pass of the loaded ``target`` at each width over a ``context``-token prompt (batch 1)."""
    run = engine.prepare(target, [[1] * context], max_new_tokens=max(widths) + 1)
    return {w: time_target_pass(run, w) for w in widths}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=run_config().model, help="the target (default SmolLM2-135M-Instruct)")
    parser.add_argument("--drafter", nargs="+", default=["ngram"], choices=DRAFTERS, help="one or more drafters")
    parser.add_argument("--draft-model", default=None,
                        help="with one drafter: its model or head (default: the recipe's, in the cache)")
    parser.add_argument("--shapes", nargs="+", default=["g4", "t8x4x2", "t12x4x3", "t16x4x4"])
    parser.add_argument("--tree-choices", type=pathlib.Path, default=None,
                        help="a static tree in Medusa's format (JSON rank paths), one more shape of medusa: c<stem>")
    parser.add_argument("--categories", nargs="+", default=None, help="Spec-Bench categories (default: all)")
    parser.add_argument("--per-category", type=int, default=1)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--widths", nargs="+", type=int, default=[1, 2, 3, 5, 9, 13, 17, 33])
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--tokens-only", action="store_true", help="tokens per round only (no timing)")
    parser.add_argument("--ngram-min", type=int, default=DrafterSettings.ngram_min, help="shortest n-gram the lookup tries")
    parser.add_argument("--draft-vocab", type=int, default=DrafterSettings.draft_vocab,
                        help="a draft model's head over its first N ids (the Qwen pair's default: 32768)")
    parser.add_argument("--out", type=pathlib.Path, default=RESULTS / "tree_shapes")
    args = parser.parse_args(argv)
    if args.tree_choices is not None and "medusa" not in args.drafter:
        parser.error("--tree-choices is a static tree for --drafter medusa")
    if args.draft_model is not None and len(args.drafter) > 1:
        parser.error("--draft-model goes with one --drafter")
    shapes = {shape: shape_fields(shape) for shape in args.shapes}
    draft_models = {d: args.draft_model or cached_draft_model(d) for d in args.drafter}
    args.out.mkdir(parents=True, exist_ok=True)
    summary_path = args.out / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.is_file() else {}
    target = load_model(args.model)  # loaded once: two copies of a 1.5B and their tree programs overflow 24 GB
    curve = verify_cost_curve(target, args.widths)
    summary["verify_cost"] = {str(w): t / curve[1] for w, t in curve.items()}
    summary["T1_ms"] = 1000 * curve[1]
    # Spec-Bench text is read at run time, never committed
    with prompts_file(recipe_questions("heldout", categories=args.categories)) as prompts:
        for drafter in args.drafter:
            mine = dict(shapes)
            if drafter == "medusa" and args.tree_choices is not None:
                mine[f"c{args.tree_choices.stem}"] = {"tree_choices": str(args.tree_choices)}
            for shape, fields in mine.items():
                cfg = run_config(model=args.model, drafter=drafter, draft_model=draft_models[drafter],
                                max_new_tokens=args.max_new_tokens, prompts_file=str(prompts),
                                ngram_min=args.ngram_min, draft_vocab=args.draft_vocab, **fields)
                name = f"{drafter}_{shape}" + (f"_min{args.ngram_min}" if args.ngram_min != DrafterSettings.ngram_min
                                               else "")
                summary[name] = (tokens_only(cfg, args.per_category, target) if args.tokens_only
                                 else timed(cfg, args.repeats, args.per_category, args.out / f"bench_{name}.json"))
                summary[name].update(drafter=drafter, shape=name[len(drafter) + 1:])
                write_json(summary_path, summary)
    (args.out / "table.md").write_text(table(summary))
    plot(summary, args.out / "tree_shapes.png")
    print(table(summary))
    return 0


def timed(cfg: RunConfig, repeats: int, per_category: int, path: pathlib.Path) -> dict:
    """`bench` beside plain decoding: speedups, tokens per round, the cost model's prediction."""
    report = bench(cfg, repeats=repeats, per_category=per_category)
    write_json(path, report)
    overall = report["overall"]
    draft_over_t1 = overall["Td_ms"] * overall["drafts_per_round"] / overall["T1_ms"]
    return {"overall": {k: overall[k] for k in ("speedup", "tokens_per_round", "tie_aware_equal", "prompts",
                                                "drafts_per_round", "accepted_depth_rounds", "Tv_over_T1",
                                                "per_position_acceptance")},
            "predicted_accelerator_speedup": overall["tokens_per_round"] / (1 + draft_over_t1),
            "categories": {c: {"speedup": a["speedup"], "tokens_per_round": a["tokens_per_round"]}
                           for c, a in report["categories"].items()}}


def tokens_only(cfg: RunConfig, per_category: int, target=None, drafter=None, results: list | None = None) -> dict:
    """Tokens per round per category (one untimed run each), and overall; ``target`` (default the config's
    model, loaded) and ``drafter`` (default the config's, built once for all categories) may be given built;
    ``results`` (a list) collects the report's rows."""
    by_category = {}
    for r in prompt_records(cfg):
        by_category.setdefault(r["category"], [])
        if len(by_category[r["category"]]) < per_category:
            by_category[r["category"]].append(r)
    target = target or load_model(cfg.model)
    drafter = drafter if drafter is not None else build_drafter(cfg, target)
    metrics = {}
    for c, rs in by_category.items():
        drop_compiled_programs()  # XLA CPU keeps every program compiled in a process
        report = run(cfg, target=target, drafter=drafter, records=rs, progress=False)
        metrics[c] = report["metrics"]
        if results is not None:
            results += report["results"]
    emitted = sum(m["emitted_tokens"] for m in metrics.values())
    rounds = sum(m["rounds"] for m in metrics.values())
    drafted = sum(m["draft_tokens"] for m in metrics.values())
    return {"overall": {"tokens_per_round": emitted / rounds, "drafts_per_round": drafted / rounds,
                        "prompts": sum(map(len, by_category.values()))},
            "categories": {c: {"tokens_per_round": m["mean_accepted_length"],
                               "acceptance_by_depth": [x for x in m["per_position_acceptance"] if x == x]}  # to its depth
                           for c, m in metrics.items()}}


def runs_of(summary: dict) -> dict:
    return {k: v for k, v in summary.items() if isinstance(v, dict) and "shape" in v}


def table(summary: dict) -> str:
    """Markdown: per drafter, one row per category, one column per shape: speedup (tokens per round)."""
    lines = ["Verify pass of w tokens (N + 1 for N nodes) over T1 on this device (T1 = %.1f ms): " % summary["T1_ms"]
             + ", ".join(f"w={w}: {r:.2f}" for w, r in summary["verify_cost"].items()), ""]
    runs = runs_of(summary)
    for drafter in sorted({r["drafter"] for r in runs.values()}):
        mine = {r["shape"]: r for r in runs.values() if r["drafter"] == drafter}
        shapes = list(mine)
        categories = sorted({c for r in mine.values() for c in r["categories"]})
        lines += [f"{drafter}: speedup over plain decoding (tokens per round; untimed runs: tokens per round only), "
                  "batch 1, greedy", "",
                  "| category | " + " | ".join(shapes) + " |", "|---|" + "---|" * len(shapes)]
        for c in [*categories, "overall"]:
            cells = [mine[s]["overall"] if c == "overall" else mine[s]["categories"].get(c) for s in shapes]
            lines.append(f"| {c} | " + " | ".join(
                "-" if x is None else (f"{x['speedup']:.2f}x " if "speedup" in x else "")
                + f"({x['tokens_per_round']:.2f})" for x in cells) + " |")
        lines.append("| nodes verified / round | " + " | ".join(
            f"{mine[s]['overall']['drafts_per_round']:.1f}" for s in shapes) + " |")
        if all("predicted_accelerator_speedup" in mine[s] for s in shapes):
            lines.append("| predicted where Tv(N) = T1 | " + " | ".join(
                f"{mine[s]['predicted_accelerator_speedup']:.2f}x" for s in shapes) + " |")
        lines.append("")
    return "\n".join(lines)


def plot(summary: dict, png: pathlib.Path) -> None:
    plt = pyplot()
    runs = runs_of(summary)
    drafters = sorted({r["drafter"] for r in runs.values()})
    fig, axes = plt.subplots(1, 1 + len(drafters), figsize=(6 + 7 * len(drafters), 4), squeeze=False)
    widths = [int(w) for w in summary["verify_cost"]]
    axes[0, 0].plot(widths, list(summary["verify_cost"].values()), "o-")
    axes[0, 0].set(xlabel="tokens in the verify pass (N + 1)", ylabel="Tv / T1", title="verify cost on this device")
    for ax, drafter in zip(axes[0, 1:], drafters):
        mine = {r["shape"]: r for r in runs.values() if r["drafter"] == drafter}
        categories = sorted({c for r in mine.values() for c in r["categories"]}) + ["overall"]
        category_bars(ax, categories, {shape: [(r["overall"] if c == "overall" else r["categories"].get(c, {}))
                                               .get("tokens_per_round", float("nan")) for c in categories]
                                       for shape, r in mine.items()},
                      ylabel="tokens per round", title=f"{drafter}: chains and trees (greedy, batch 1)")
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    raise SystemExit(main())
