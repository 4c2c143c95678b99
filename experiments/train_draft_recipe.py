"""The standalone-draft recipe: distil a 2-layer draft for SmolLM2-135M-Instruct, then bench it on
held-out prompts.

Makes the entry "Can a distilled standalone draft for SmolLM2 reach useful acceptance?" of
experiments/README.md, and leaves the draft in the cache, where `experiments/eagle_recipe.py`
benches it beside the EAGLE and Medusa heads.

    python experiments/train_draft_recipe.py [--gamma 2] [--per-category 5] [--max-new-tokens 128]

1. `specdec-jax train-draft --config configs/train/smollm2-draft.yaml` into
   `<cache>/drafts/smollm2-recipe` (data, checkpoints and the draft stay out of the
   repository; a second call resumes or reuses them).
2. `specdec-jax bench` of the draft against plain decoding on the held-out
   questions (never trained on) of the open-ended categories writing, roleplay
   and qa: greedy, then temperature 0.7.

Writes results.json, table.md, training_curve.png and one bench report per temperature
(bench_t0.json, bench_t0.7.json) to experiments/results/draft_recipe.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import shutil
import time

from common import (DRAFT_CONFIG, OPEN_ENDED, RESULTS, STANDALONE_DRAFT, markdown_table, prompts_file,
                    recipe_questions, save, write_json)

from specdec_jax.bench import bench
from specdec_jax.config import run_config
from specdec_jax.distill.config import train_config
from specdec_jax.distill.train import train_draft
from specdec_jax.cache import cache_dir


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=pathlib.Path, default=pathlib.Path(DRAFT_CONFIG))
    parser.add_argument("--run", type=pathlib.Path, default=None, help="training folder (default: in the cache)")
    parser.add_argument("--gamma", type=int, default=2, help="2: on this CPU Tv/T1 grows fast with the width")
    parser.add_argument("--per-category", type=int, default=5)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 0.7])
    parser.add_argument("--out", type=pathlib.Path, default=RESULTS / "draft_recipe")
    args = parser.parse_args(argv)

    tc = train_config(args.config)
    run = args.run or cache_dir() / STANDALONE_DRAFT
    tick = time.perf_counter()
    draft = run / "draft"
    if not (draft / "specdec_model.json").is_file():
        resume = (run / "checkpoints").is_dir() and any((run / "checkpoints").iterdir())
        train_draft(tc, run, resume=resume)
    train_s = time.perf_counter() - tick
    log = [json.loads(line) for line in (run / "log.jsonl").read_text().splitlines()]
    heldout = [r for r in log if "heldout" in r][-1]["heldout"]

    args.out.mkdir(parents=True, exist_ok=True)
    reports = {}
    with prompts_file(recipe_questions("heldout", categories=list(OPEN_ENDED), config=str(args.config))) as prompts:
        for temperature in args.temperatures:
            cfg = run_config(model=tc.target, drafter="draft-model", draft_model=str(draft), gamma=args.gamma,
                            temperature=temperature, max_new_tokens=args.max_new_tokens, prompts_file=str(prompts))
            reports[temperature] = bench(cfg, repeats=1, per_category=args.per_category)
            write_json(args.out / f"bench_t{temperature:g}.json", reports[temperature])
    total_s = time.perf_counter() - tick
    shutil.copy(run / "training_curve.png", args.out / "training_curve.png")

    header = ["temperature", "category", "plain tok/s", "draft tok/s", "speedup", "tokens/round", "acceptance",
              "per-position acceptance", "T1 ms", "Td ms", "Td/T1", "Tv ms", "spec = plain"]
    rows = []
    for temperature, report in reports.items():
        for name, a in [*report["categories"].items(), ("overall", report["overall"])]:
            rows.append([temperature, name, a["plain_tokens_per_s"], a["spec_tokens_per_s"], a["speedup"],
                         a["tokens_per_round"], a["acceptance_rate"],
                         " ".join(f"{x:.2f}" for x in a["per_position_acceptance"]), a["T1_ms"], a["Td_ms"],
                         a["Td_ms"] / a["T1_ms"], a["Tv_ms"], a["tie_aware_equal"] if temperature == 0 else "n/a"])
    table = markdown_table(header, rows)
    table += (f"\nheld-out teacher-forced greedy agreement at the end of training: {heldout['agreement']:.3f} "
              f"(loss {heldout['loss']:.3f})\ntraining (data + steps, or reuse): {train_s / 60:.1f} min; "
              f"whole recipe: {total_s / 60:.1f} min\n")
    save(args.out, {"args": {k: str(v) for k, v in vars(args).items()}, "train_config": tc.to_dict(),
                    "heldout": heldout, "train_s": train_s, "total_s": total_s,
                    "bench": {str(t): r for t, r in reports.items()}}, table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
