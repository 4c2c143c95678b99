"""The EAGLE recipe (and Medusa beside it): train or reuse both heads for SmolLM2-135M, then bench
them beside the n-gram drafter and the standalone draft on the held-out Spec-Bench questions (EAGLE-3
heads and a DFlash drafter, trained the same way, when named).

Makes the entries "Which drafter is fastest at `--gamma auto`, and how far are the trained heads
from their targets?", "Which drafter wins on which Spec-Bench category?", "Does an EAGLE-3 head trained
on the same data beat the EAGLE-1 head on SmolLM2?" and "Does a DFlash drafter trained on the same data
pay on SmolLM2?" of experiments/README.md.

    python experiments/eagle_recipe.py [--per-category 1] [--max-new-tokens 128] [--temperatures 0 0.7]

1. `specdec-jax train-draft --config configs/train/smollm2-eagle.yaml` (and `smollm2-medusa.yaml`)
   into `<cache>/heads/<config name>`: data (teacher-forced target features), checkpoints and the
   head stay out of the repository; a second call resumes or reuses them. When both configs ask
   for the same data (same prompts, answers, windows and feature layers), the Medusa run starts
   from a copy of the EAGLE run's data instead of building it again.
2. `specdec-jax bench` of each drafter against plain decoding (side by side, in one process) on
   the first `--per-category` held-out questions (never trained on) of every category, batch 1,
   at each temperature, each drafter at `--gamma auto` (the shape chosen per round from this
   device's measured costs and the row's acceptance) unless `--gamma DRAFTER=G` fixes it. The
   standalone draft (`draft-model`, left in the cache by `python experiments/train_draft_recipe.py`)
   is benched beside the heads when it is there.

Writes to experiments/results/eagle_recipe/: summary.json (per drafter and temperature:
acceptance_pos1, tokens_per_round, speedup, speedup_open_ended (writing + roleplay + qa),
td_over_t1, tv_over_t1, gamma), table.md (that table, then per category: tokens per round and
speedup of each drafter, greedy), per_category.png, one bench report per drafter and temperature
(bench_<drafter>_t<temperature>.json) and the heads' training curves (training_curve_<kind>.png).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import shutil
import time

from common import (HEAD_CONFIGS, OPEN_ENDED, RESULTS, STANDALONE_DRAFT, category_bars, markdown_table,
                    prompts_file, pyplot, recipe_questions, run_folder, save, standalone_draft, write_json)

from specdec_jax.bench import bench
from specdec_jax.config import RunConfig, run_config
from specdec_jax.distill.config import train_config
from specdec_jax.distill.kinds import kind_of
from specdec_jax.distill.train import train_draft
from specdec_jax.drafters.published import head_kind
from specdec_jax.engine import AUTO
from specdec_jax.cache import cache_dir

# Setups benched: name -> (--drafter, the HEAD_CONFIGS head it drafts with or None, further run settings).
SETUPS = {"ngram": ("ngram", None, {}), "draft-model": ("draft-model", None, {}), "medusa": ("medusa", "medusa", {}),
          "eagle": ("eagle", "eagle", {}), "eagle3": ("eagle", "eagle3", {}),
          "eagle3-tree": ("eagle", "eagle3", {"tree_nodes": AUTO, "tree_depth": 4, "tree_topk": 4}),
          "dflash": ("dflash", "dflash", {})}
DRAFTERS = tuple(SETUPS)
DEFAULT_DRAFTERS = ("ngram", "draft-model", "medusa", "eagle")  # EAGLE-3 and DFlash when asked for


def gamma_of(text: str) -> int | str:
    return text if text == AUTO else int(text)


def trained_head(kind: str, config: pathlib.Path) -> tuple[pathlib.Path, dict, float]:
    """(head folder, final held-out metrics, seconds spent): trains, resumes or reuses."""
    tc = train_config(config)
    run = run_folder(kind)
    tick = time.perf_counter()
    if head_kind(run / "head") is None:
        resume = (run / "checkpoints").is_dir() and any((run / "checkpoints").iterdir())
        train_draft(tc, run, resume=resume)
    log = [json.loads(line) for line in (run / "log.jsonl").read_text().splitlines()]
    return run / "head", [r for r in log if "heldout" in r][-1]["heldout"], time.perf_counter() - tick


DATA_FIELDS = ("target", "prompts_file", "heldout_per_category", "max_train_prompts", "eval_prompts",
               "max_prompt_tokens", "answers", "gen_max_new_tokens", "teacher_top_k", "seq_len", "extra_text",
               "extra_examples")


def share_data(source: pathlib.Path, target: pathlib.Path) -> None:
    """Seeds run `target`'s OUT/data with run `source`'s when their configs build the same data."""
    a, b = (train_config(HEAD_CONFIGS[kind]) for kind in ("eagle", "medusa"))
    same = all(getattr(a, f) == getattr(b, f) for f in DATA_FIELDS) and \
        kind_of(a).data_layers(a) == kind_of(b).data_layers(b)
    if same and (source / "data" / "split.json").is_file() and not (target / "data").exists():
        shutil.copytree(source / "data", target / "data")


def reusable_report(path: pathlib.Path, cfg: RunConfig, per_category: int) -> dict | None:
    """The bench report at `path` if it benched `cfg` (its prompts file aside) on the first `per_category`
    held-out questions of each category, else None."""
    if not path.is_file():
        return None
    report = json.loads(path.read_text())
    config = {k: v for k, v in json.loads(json.dumps(cfg.to_dict(), default=str)).items() if k != "prompts_file"}
    wanted = [q["question_id"] for q in recipe_questions("heldout", per_category)]
    same = {k: v for k, v in report["config"].items() if k != "prompts_file"} == config
    return report if same and [i for b in report["batches"] for i in b["ids"]] == wanted else None


def open_ended_speedup(report: dict) -> float:
    """Decode-phase speedup over the writing, roleplay and qa batches together (summed tokens and times)."""
    rows = [b for b in report["batches"] if b["categories"][0] in OPEN_ENDED]
    plain = sum(b["plain_tokens"] for b in rows) / sum(b["plain_s"] for b in rows)
    spec = sum(b["spec_tokens"] for b in rows) / sum(b["spec_s"] for b in rows)
    return spec / plain


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--per-category", type=int, default=1)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 0.7])
    parser.add_argument("--drafters", nargs="+", default=None, choices=DRAFTERS,
                        help="default: ngram, medusa, eagle, and draft-model when the cache holds one; eagle3, "
                             "eagle3-tree (EAGLE-3's head, chains and --tree-nodes auto) and dflash (a DFlash drafter) "
                             "when named")
    parser.add_argument("--sampled-drafters", nargs="+", default=None, metavar="DRAFTER",
                        help="drafters benched at the non-zero temperatures (default: the heads among --drafters)")
    parser.add_argument("--gamma", action="append", default=[], metavar="DRAFTER=G",
                        help="gamma per drafter, an int or auto (default: auto for every drafter)")
    parser.add_argument("--out", type=pathlib.Path, default=RESULTS / "eagle_recipe")
    parser.add_argument("--reuse-benches", action="store_true",
                        help="keep the bench reports already in --out that ran the same config on the same prompts "
                             "(e.g. to add the standalone draft without benching the others again)")
    parser.add_argument("--tables-only", action="store_true",
                        help="train and bench nothing: write table.md and per_category.png again from --out")
    args = parser.parse_args(argv)
    if args.tables_only:
        return rewrite_tables(args.out)
    gammas = dict.fromkeys(DRAFTERS, AUTO) | {k: gamma_of(v) for k, v in (g.split("=") for g in args.gamma)}
    if args.drafters is None:
        args.drafters = [d for d in DEFAULT_DRAFTERS if d != "draft-model" or standalone_draft()]
    if "draft-model" in args.drafters and not standalone_draft():
        parser.error(f"no standalone draft in {cache_dir() / STANDALONE_DRAFT / 'draft'}: "
                     "`python experiments/train_draft_recipe.py` trains one")

    tick = time.perf_counter()
    heads, heldout, train_s = {"draft-model": standalone_draft()}, {}, {}
    kinds = {SETUPS[d][1] for d in args.drafters} - {None}
    for kind in sorted(kinds, key=list(HEAD_CONFIGS).index):
        if kind == "medusa":
            share_data(run_folder("eagle"), run_folder("medusa"))
        heads[kind], heldout[kind], train_s[kind] = trained_head(kind, pathlib.Path(HEAD_CONFIGS[kind]))
    args.out.mkdir(parents=True, exist_ok=True)
    for kind in heldout:
        shutil.copy(run_folder(kind) / "training_curve.png", args.out / f"training_curve_{kind}.png")
    tc = train_config(HEAD_CONFIGS["eagle"])
    reports, summary = {}, {}
    with prompts_file(recipe_questions("heldout")) as prompts:
        for temperature in args.temperatures:
            sampled = args.sampled_drafters or [d for d in args.drafters if SETUPS[d][1] is not None]
            for drafter in args.drafters if temperature == 0 else sampled:
                name_of, head, settings = SETUPS[drafter]
                cfg = run_config(model=tc.target, drafter=name_of, draft_model=str(heads.get(head or drafter) or "")
                                 or None, gamma=gammas[drafter], temperature=temperature,
                                 max_new_tokens=args.max_new_tokens, prompts_file=str(prompts), **settings)
                name = f"{drafter}_t{temperature:g}"
                path = args.out / f"bench_{name}.json"
                report = args.reuse_benches and reusable_report(path, cfg, args.per_category)
                if not report:
                    report = bench(cfg, repeats=1, per_category=args.per_category)
                    write_json(path, report)
                reports[name] = report
                summary[name] = summary_row(drafter, temperature, gammas[drafter], report)
    total_s = time.perf_counter() - tick
    payload = {"args": {k: str(v) for k, v in vars(args).items()}, "heldout_agreement": heldout,
               "train_s": train_s, "total_s": total_s, "results": summary}
    save(args.out, payload, *tables(payload, reports), png="per_category.png", data="summary.json")
    return 0


def summary_row(drafter: str, temperature: float, gamma, report: dict) -> dict:
    o = report["overall"]
    return {"drafter": drafter, "temperature": temperature, "gamma": gamma,
            "acceptance_pos1": o["per_position_acceptance"][0], "tokens_per_round": o["tokens_per_round"],
            "speedup": o["speedup"], "speedup_open_ended": open_ended_speedup(report),
            "td_over_t1": o["Td_ms"] / o["T1_ms"], "tv_over_t1": o["Tv_over_T1"],
            "predicted_speedup": o["predicted_speedup"], "tie_aware_equal": o["tie_aware_equal"],
            "prompts": o["prompts"]}


def tables(payload: dict, reports: dict) -> tuple[str, object]:
    """(table.md's text, the per-category figure or None) of a recipe's summary and bench reports."""
    summary, heldout, train_s = payload["results"], payload["heldout_agreement"], payload["train_s"]
    header = ["drafter", "temperature", "gamma", "accept@1", "tokens/round", "speedup", "open-ended speedup",
              "Td/T1", "Tv/T1", "predicted", "spec = plain"]
    rows = [[s["drafter"], s["temperature"], s["gamma"], s["acceptance_pos1"], s["tokens_per_round"], s["speedup"],
             s["speedup_open_ended"], s["td_over_t1"], s["tv_over_t1"], s["predicted_speedup"],
             s["tie_aware_equal"] if s["temperature"] == 0 else "n/a"] for s in summary.values()]
    table = markdown_table(header, rows)
    greedy = [n for n in reports if n.endswith("_t0")]
    categories = sorted(reports[greedy[0]]["categories"]) if greedy else []
    per_category = [[c] + [x for n in greedy for x in (reports[n]["categories"][c]["tokens_per_round"],
                                                       reports[n]["categories"][c]["speedup"])] for c in categories]
    table += "\nPer category, greedy (tokens per round, speedup):\n\n" + markdown_table(
        ["category"] + [f"{n[:-3]} {m}" for n in greedy for m in ("tok/round", "speedup")], per_category)
    table += ("\nheld-out teacher-forced agreement at draft position 1: "
              + ", ".join(f"{k} {v['agreement']:.3f}" for k, v in heldout.items())
              + "\ntraining (or reuse): " + ", ".join(f"{k} {v / 60:.1f} min" for k, v in train_s.items())
              + f"; whole recipe: {payload['total_s'] / 60:.1f} min\n")
    if not greedy:
        return table, None
    fig, ax = pyplot().subplots(figsize=(11, 4))
    category_bars(ax, categories, {n[:-3]: [reports[n]["categories"][c]["speedup"] for c in categories]
                                   for n in greedy},
                  ylabel="speedup over plain decoding (greedy)",
                  title="SmolLM2-135M, held-out Spec-Bench, batch 1, gamma auto", one_line=True)
    return table, fig


def rewrite_tables(out: pathlib.Path) -> int:
    """table.md and per_category.png again from out/summary.json and the bench reports beside it."""
    payload = json.loads((out / "summary.json").read_text())
    reports = {name: json.loads((out / f"bench_{name}.json").read_text()) for name in payload["results"]}
    save(out, payload, *tables(payload, reports), png="per_category.png", data="summary.json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
