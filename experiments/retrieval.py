"""Retrieval drafting against prompt lookup: tokens per round per Spec-Bench category, the lookup's cost.

Makes the entries of experiments/README.md "How many tokens per round does a ShareGPT datastore add to
prompt lookup?" and "Does retrieval pay in wall-clock time on this CPU?".

Runs, on the held-out Spec-Bench questions of the recipes' split (the first `--per-category` of
each category), batch 1, `--max-new-tokens` new tokens, SmolLM2-135M: the n-gram drafter
(`--ngram-min 1`, as the retrieval drafter's own lookup), the retrieval drafter (prompt lookup first,
the datastore to fill) as a chain of gamma 4 and as a 16-node tree (depth 4, top-4), and the
datastore alone (no prompt lookup), each at every `--temperatures` (0 = greedy). `--tokens-only`:
tokens per round from one untimed run per category (deterministic, hardware-independent);
otherwise `specdec-jax bench` beside plain decoding at `--gamma auto` (speedups, medians).
Also: the datastore's build time and size, and one draft step of each drafter over T1 (a target
pass of one token), timed on this device (batch 1, a 200-token context).

Writes `--out` (default experiments/results/retrieval): summary.json, table.md, retrieval.png.

    python experiments/retrieval.py --tokens-only --per-category 2 --out experiments/results/retrieval/tokens
    python experiments/retrieval.py --per-category 2 --temperatures 0 --out experiments/results/retrieval/timed
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib

from common import RESULTS, category_bars, prompts_file, pyplot, recipe_questions, write_json
from tree_shapes import timed, tokens_only

from specdec_jax import engine
from specdec_jax.config import RunConfig
from specdec_jax.datastore import load_datastore
from specdec_jax.engine.calibration import time_draft_step, time_target_pass
from specdec_jax.models import load_model
from specdec_jax.runner import build_drafter

TREE = {"tree_nodes": 16, "tree_depth": 4, "tree_topk": 4}
RUNS = {  # name -> RunConfig fields (besides model, prompts, temperature)
    "ngram g4": {"drafter": "ngram", "gamma": 4, "ngram_min": 1},
    "retrieval g4": {"drafter": "retrieval", "gamma": 4, "ngram_min": 1},
    "ngram t16": {"drafter": "ngram", "ngram_min": 1, **TREE},
    "retrieval t16": {"drafter": "retrieval", "ngram_min": 1, **TREE},
    "datastore only g4": {"drafter": "retrieval", "gamma": 4, "ngram_min": 1, "alone": True},
}
TIMED = {"ngram auto": {"drafter": "ngram", "ngram_min": 1}, "retrieval auto": {"drafter": "retrieval", "ngram_min": 1},
         "retrieval t16 auto": {"drafter": "retrieval", "ngram_min": 1, **TREE, "tree_nodes": "auto"}}


def lookup_cost(cfg: RunConfig, target, context: int = 200) -> dict:
    """One draft step of ``cfg``'s drafter over T1, batch 1, a ``context``-token context of repeated text."""
    drafter = build_drafter(cfg, target)
    prompt = target.tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 40)[:context]
    gamma = cfg.effective_gamma if cfg.effective_gamma != "auto" else 4
    run = engine.prepare(target, [prompt], drafter, gamma=gamma, max_new_tokens=32)
    draft, t1 = time_draft_step(run), time_target_pass(engine.prepare(target, [prompt], max_new_tokens=32), 1)
    return {"draft_ms": 1000 * draft, "T1_ms": 1000 * t1, "draft_over_T1": draft / t1}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--datastore", nargs="+", default=["sharegpt"])
    parser.add_argument("--per-category", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--temperatures", nargs="+", type=float, default=[0.0, 0.7])
    parser.add_argument("--tokens-only", action="store_true", help="tokens per round only (no timing)")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--runs", nargs="+", default=None, help=f"only these runs (of {list(RUNS)}, or timed: "
                        f"{list(TIMED)})")
    parser.add_argument("--out", type=pathlib.Path, default=RESULTS / "retrieval")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    summary_path = args.out / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.is_file() else {}
    target = load_model(RunConfig().model)
    store = load_datastore(args.datastore, target.tokenizer)
    summary["datastore"] = {**store.meta, "MiB": store.nbytes / 2**20}
    base = RunConfig(max_new_tokens=args.max_new_tokens)
    datastore = tuple(args.datastore)
    summary["lookup_cost"] = {name: lookup_cost(dataclasses.replace(base, **_fields(fields, datastore)), target)
                              for name, fields in RUNS.items() if "alone" not in fields}
    write_json(summary_path, summary)
    with prompts_file(recipe_questions("heldout")) as prompts:  # Spec-Bench text is read at run time, never committed
        for temperature in args.temperatures:
            for name, fields in (RUNS if args.tokens_only else TIMED).items():
                if args.runs and name not in args.runs:
                    continue
                cfg = dataclasses.replace(base, prompts_file=str(prompts), temperature=temperature, **_fields(fields, datastore))
                key = f"{name} T={temperature:g}"
                if fields.get("alone"):
                    summary[key] = _alone(cfg, args.per_category)
                elif args.tokens_only:
                    summary[key] = tokens_only(cfg, args.per_category)
                else:
                    summary[key] = timed(cfg, args.repeats, args.per_category, args.out / f"bench_{key}.json")
                write_json(summary_path, summary)
    (args.out / "table.md").write_text(table(summary))
    plot(summary, args.out / "retrieval.png")
    print(table(summary))
    return 0


def _fields(fields: dict, datastore: tuple[str, ...]) -> dict:
    """RunConfig fields of a run (``datastore`` if it is a retrieval run)."""
    return {**{k: v for k, v in fields.items() if k != "alone"},
            "datastore": datastore if fields["drafter"] == "retrieval" else ()}


def _alone(cfg: RunConfig, per_category: int) -> dict:
    """`tokens_only` of the datastore alone: the retrieval drafter without its prompt lookup."""
    return tokens_only(cfg, per_category, dataclasses.replace(build_drafter(cfg, load_model(cfg.model)), lookup=None))


def runs_of(summary: dict) -> dict:
    return {k: v for k, v in summary.items() if isinstance(v, dict) and "categories" in v}


def table(summary: dict) -> str:
    ds = summary["datastore"]
    lines = [f"Datastore {'+'.join(ds['sources'])}: {ds['documents']:,} documents, {ds['tokens']:,} tokens, "
             f"{ds['MiB']:.0f} MiB, built in {ds['build_s']} s.", "",
             "One draft step over T1 (batch 1, 200-token context): " + ", ".join(
                 f"{name} {c['draft_ms']:.2f} ms = {c['draft_over_T1']:.3f} T1" for name, c in
                 summary["lookup_cost"].items()), ""]
    runs = runs_of(summary)
    names = list(runs)
    categories = sorted({c for r in runs.values() for c in r["categories"]})
    lines += ["Speedup over plain decoding where timed, (tokens per round); held-out Spec-Bench, batch 1", "",
              "| category | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    for c in [*categories, "overall"]:
        cells = [runs[n]["overall"] if c == "overall" else runs[n]["categories"].get(c) for n in names]
        lines.append(f"| {c} | " + " | ".join(
            "-" if x is None else (f"{x['speedup']:.2f}x " if "speedup" in x else "") + f"({x['tokens_per_round']:.2f})"
            for x in cells) + " |")
    return "\n".join(lines) + "\n"


def plot(summary: dict, png: pathlib.Path) -> None:
    plt = pyplot()
    runs = runs_of(summary)
    categories = sorted({c for r in runs.values() for c in r["categories"]}) + ["overall"]
    fig, ax = plt.subplots(figsize=(14, 4.5))
    category_bars(ax, categories, {name: [(r["overall"] if c == "overall" else r["categories"].get(c, {}))
                                          .get("tokens_per_round", float("nan")) for c in categories]
                                   for name, r in runs.items()},
                  ylabel="tokens per round", title="prompt lookup and retrieval, held-out Spec-Bench")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    raise SystemExit(main())
