"""Experiment 4: drafters per Spec-Bench category (copy-heavy vs open-ended prompts).

    python experiments/drafters_by_category.py [BENCH_JSON ...] [--out experiments/results/drafters_by_category]

Reads `specdec-jax bench --json` reports (default: the n-gram run of the issue-5
benchmark, experiments/results/bench/spec_bench_5pc.json) and puts their
per-category speedup, acceptance and tokens per round side by side, one bar
group per category and one bar per report's drafter. To add a draft model once
one is trained, run the same bench with `--drafter draft-model --draft-model
PATH --json draft.json` and pass both files.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

from common import RESULTS, markdown_table, pyplot, save

DEFAULT = RESULTS / "bench" / "spec_bench_5pc.json"
COPY_HEAVY = ("summarization", "rag", "extraction", "translation")  # answers quote the prompt


def label(report: dict) -> str:
    cfg = report["config"]
    name = cfg["drafter"] if cfg["drafter"] != "draft-model" else f"draft {pathlib.Path(cfg['draft_model']).name}"
    return f"{name} g={cfg['gamma']}"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("reports", type=pathlib.Path, nargs="*", default=[DEFAULT])
    parser.add_argument("--out", type=pathlib.Path, default=RESULTS / "drafters_by_category")
    args = parser.parse_args(argv)
    reports = [json.loads(p.read_text()) for p in args.reports]
    categories = sorted({c for r in reports for c in r["categories"]},
                        key=lambda c: (c not in COPY_HEAVY, c))
    rows = []
    for report in reports:
        for cat in categories:
            a = report["categories"].get(cat)
            if a:
                rows.append([label(report), cat, "copy-heavy" if cat in COPY_HEAVY else "open-ended", a["prompts"],
                             a["acceptance_rate"], a["tokens_per_round"], a["speedup"], a["predicted_speedup"]])
    header = ["drafter", "category", "kind", "prompts", "acceptance", "tokens/round", "speedup", "predicted"]
    plt = pyplot()
    fig, axes = plt.subplots(2, 1, figsize=(10, 6), sharex=True)
    width = 0.8 / len(reports)
    for i, report in enumerate(reports):
        name = label(report)
        xs = [j + i * width for j in range(len(categories))]
        stats = [report["categories"].get(c, {}) for c in categories]
        axes[0].bar(xs, [s.get("speedup", 0) for s in stats], width, label=name)
        axes[1].bar(xs, [s.get("tokens_per_round", 0) for s in stats], width, label=name)
    axes[0].axhline(1.0, color="gray", lw=0.8)
    axes[0].set(ylabel="speedup over plain", title="Per category (copy-heavy first)")
    axes[1].set(ylabel="tokens per round")
    axes[1].set_xticks([j + 0.4 - width / 2 for j in range(len(categories))], categories, rotation=30, ha="right")
    for ax in axes:
        ax.grid(alpha=0.3, axis="y")
        ax.legend(fontsize=8)
    save(args.out, {"reports": [str(p) for p in args.reports], "header": header, "rows": rows},
         markdown_table(header, rows), fig, "drafters_by_category.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
