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

`--outputs-pass`: the model's own outputs as a datastore. Pass 1 decodes the first `--per-category`
held-out questions of each category, pass 2 the other held-out ones; tokens per round of pass 2 for
prompt lookup, the fixed datastore, and the fixed datastore beside `outputs` (which holds pass 1's
outputs, and pass 2's earlier ones, as it would serving these requests in turn), chain and tree.
Writes outputs.json too (the questions' ids, prompt and output token ids of both passes; not
committed), which experiments/suffix_decoding_peer.py replays through arctic-inference's SuffixDecoding.

Writes `--out` (default experiments/results/retrieval): summary.json, table.md, retrieval.png.

    python experiments/retrieval.py --tokens-only --per-category 2 --out experiments/results/retrieval/tokens
    python experiments/retrieval.py --per-category 2 --temperatures 0 --out experiments/results/retrieval/timed
    python experiments/retrieval.py --outputs-pass --per-category 2 --out experiments/results/retrieval/outputs
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib

from common import RESULTS, category_bars, first_per_category, prompts_file, pyplot, recipe_questions, write_json
from tree_shapes import timed, tokens_only

from specdec_jax import engine
from specdec_jax.config import RunConfig, run_config
from specdec_jax.datastore import OUTPUTS, load_datastore
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
OUTPUTS_RUNS = {  # name -> RunConfig fields; "outputs": the drafter keeps the model's outputs, from pass 1 on
    "ngram g4": RUNS["ngram g4"], "retrieval g4": RUNS["retrieval g4"],
    "retrieval+outputs g4": {**RUNS["retrieval g4"], "outputs": True},
    "ngram t16": RUNS["ngram t16"], "retrieval t16": RUNS["retrieval t16"],
    "retrieval+outputs t16": {**RUNS["retrieval t16"], "outputs": True},
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
    parser.add_argument("--outputs-pass", action="store_true", help="pass 2 with the outputs of pass 1 (tokens only)")
    parser.add_argument("--out", type=pathlib.Path, default=RESULTS / "retrieval")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    summary_path = args.out / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.is_file() else {}
    target = load_model(run_config().model)
    store = load_datastore(args.datastore, target.tokenizer)
    summary["datastore"] = {**store.meta, "MiB": store.nbytes / 2**20}
    base = run_config(max_new_tokens=args.max_new_tokens)
    datastore = tuple(args.datastore)
    if args.outputs_pass:
        summary["outputs_pass"] = outputs_pass(base, datastore, args.per_category, args.out)
        write_json(summary_path, summary)
        (args.out / "table.md").write_text(outputs_table(summary))
        print(outputs_table(summary))
        return 0
    if "lookup_cost" not in summary:  # timed once per --out folder (later runs may add temperatures)
        summary["lookup_cost"] = {name: lookup_cost(base.updated(**_fields(fields, datastore)), target)
                                  for name, fields in RUNS.items() if "alone" not in fields}
        write_json(summary_path, summary)
    with prompts_file(recipe_questions("heldout")) as prompts:  # Spec-Bench text is read at run time, never committed
        for temperature in args.temperatures:
            for name, fields in (RUNS if args.tokens_only else TIMED).items():
                if args.runs and name not in args.runs:
                    continue
                cfg = base.updated(prompts_file=str(prompts), temperature=temperature, **_fields(fields, datastore))
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
    """RunConfig fields of a run (``datastore``, with outputs if asked, if it is a retrieval run)."""
    datastore += (OUTPUTS,) if fields.get("outputs") else ()
    return {**{k: v for k, v in fields.items() if k not in ("alone", "outputs")},
            "datastore": datastore if fields["drafter"] == "retrieval" else ()}


def outputs_pass(base: RunConfig, datastore: tuple[str, ...], per_category: int, out: pathlib.Path) -> dict:
    """Tokens per round of pass 2 (the held-out questions after the first ``per_category`` of each
    category) for every OUTPUTS_RUNS entry, pass 1 decoded first by the drafters that keep outputs;
    out/outputs.json: both passes' token ids (greedy, so the same for every drafter)."""
    held = recipe_questions("heldout")
    first = first_per_category(held, per_category)
    second = [q for q in held if q not in first]
    results, rows = {}, {}
    with prompts_file(first) as path_1, prompts_file(second) as path_2:
        for name, fields in OUTPUTS_RUNS.items():
            cfg = base.updated(**_fields(fields, datastore))
            drafter = build_drafter(cfg, load_model(cfg.model))
            passes = [("pass 1", path_1), ("pass 2", path_2)] if fields.get("outputs") else [("pass 2", path_2)]
            for label, path in passes:
                rows[label] = []
                results.setdefault(name, {})[label] = tokens_only(cfg.updated(prompts_file=str(path)),
                                                                  len(held), drafter=drafter, results=rows[label])
    write_json(out / "outputs.json", {label: [{k: r[k] for k in ("id", "category", "prompt_tokens", "tokens")}
                                              for r in rs] for label, rs in rows.items()})
    return {"pass 1": len(first), "pass 2": len(second), "runs": results}


def outputs_table(summary: dict) -> str:
    """Markdown: tokens per round of pass 2 per category, one column per run."""
    runs = {name: r["pass 2"] for name, r in summary["outputs_pass"]["runs"].items()}
    names = list(runs)
    categories = sorted({c for r in runs.values() for c in r["categories"]})
    lines = [f"Tokens per round on {summary['outputs_pass']['pass 2']} held-out questions (pass 2), after "
             f"{summary['outputs_pass']['pass 1']} others (pass 1) whose outputs the `outputs` runs hold; "
             "greedy, batch 1", "", "| category | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    for c in [*categories, "overall"]:
        cells = [runs[n]["overall"] if c == "overall" else runs[n]["categories"].get(c) for n in names]
        lines.append(f"| {c} | " + " | ".join("-" if x is None else f"{x['tokens_per_round']:.2f}" for x in cells) + " |")
    return "\n".join(lines) + "\n"


def _alone(cfg: RunConfig, per_category: int) -> dict:
    """`tokens_only` of the datastore alone: the retrieval drafter without its prompt lookup."""
    drafter = dataclasses.replace(build_drafter(cfg, load_model(cfg.model)), lookup=None)
    return tokens_only(cfg, per_category, drafter=drafter)


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
