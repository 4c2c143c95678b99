"""Issue 16's recipe: train (or reuse) an EAGLE head and Medusa heads for SmolLM2-135M, then bench
them beside the n-gram drafter on held-out Spec-Bench questions.

    python experiments/eagle_recipe.py [--per-category 1] [--max-new-tokens 128] [--temperatures 0 0.7]

1. `specdec-jax train-draft --config configs/train/smollm2-eagle.yaml` (and `smollm2-medusa.yaml`)
   into `<cache>/heads/<config name>`: data (teacher-forced target features), checkpoints and the
   head stay out of the repository; a second call resumes or reuses them. When both configs ask
   for the same data (same prompts, answers, windows and feature layers), the Medusa run starts
   from a copy of the EAGLE run's data instead of building it again.
2. `specdec-jax bench` of each drafter against plain decoding (side by side, in one process) on
   the first `--per-category` held-out questions (never trained on) of every category, batch 1,
   at each temperature, each drafter at its own gamma (`--gamma DRAFTER=G`).

Writes summary.json (per drafter and temperature: acceptance_pos1, tokens_per_round, speedup,
speedup_open_ended (writing + roleplay + qa), td_over_t1, tv_over_t1, gamma), table.md (per
category: tokens per round and speedup of each drafter), per_category.png and every bench report
and the heads' training curves to experiments/results/eagle_recipe.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import shutil
import tempfile
import time

from common import RESULTS, markdown_table, pyplot

from specdec_jax.bench import bench
from specdec_jax.config import RunConfig
from specdec_jax.data import spec_bench_questions
from specdec_jax.distill.config import train_config
from specdec_jax.distill.data import split_questions
from specdec_jax.distill.kinds import kind_of
from specdec_jax.distill.train import train_draft
from specdec_jax.drafters.heads import is_head_dir
from specdec_jax.models.fetch import cache_dir

OPEN_ENDED = ("writing", "roleplay", "qa")
HEAD_CONFIGS = {"eagle": "configs/train/smollm2-eagle.yaml", "medusa": "configs/train/smollm2-medusa.yaml"}
DEFAULT_GAMMA = {"ngram": 4, "medusa": 3, "eagle": 3}


def run_folder(kind: str) -> pathlib.Path:
    return cache_dir() / "heads" / pathlib.Path(HEAD_CONFIGS[kind]).stem


def trained_head(kind: str, config: pathlib.Path) -> tuple[pathlib.Path, dict, float]:
    """(head folder, final held-out metrics, seconds spent): trains, resumes or reuses."""
    tc = train_config(config)
    run = run_folder(kind)
    tick = time.perf_counter()
    if not is_head_dir(run / "head"):
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


def heldout_prompts_file(folder: pathlib.Path) -> pathlib.Path:
    """A prompts file (first turns) of the held-out Spec-Bench questions of the heads' split, in `folder`."""
    tc = train_config(HEAD_CONFIGS["eagle"])
    _, held = split_questions(spec_bench_questions(tc.prompts_file), tc.heldout_per_category)
    path = folder / "heldout_prompts.jsonl"
    path.write_text("\n".join(json.dumps({"question_id": q["question_id"], "category": q["category"],
                                          "turns": q["turns"][:1]}) for q in held))
    return path


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
    parser.add_argument("--drafters", nargs="+", default=["ngram", "medusa", "eagle"], choices=list(DEFAULT_GAMMA))
    parser.add_argument("--sampled-drafters", nargs="+", default=None, metavar="DRAFTER",
                        help="drafters benched at the non-zero temperatures (default: all of --drafters)")
    parser.add_argument("--gamma", action="append", default=[], metavar="DRAFTER=G",
                        help=f"gamma per drafter (default {DEFAULT_GAMMA})")
    parser.add_argument("--out", type=pathlib.Path, default=RESULTS / "eagle_recipe")
    args = parser.parse_args(argv)
    gammas = dict(DEFAULT_GAMMA, **{k: int(v) for k, v in (g.split("=") for g in args.gamma)})

    tick = time.perf_counter()
    heads, heldout, train_s = {}, {}, {}
    for kind in sorted((d for d in args.drafters if d in HEAD_CONFIGS), key=list(HEAD_CONFIGS).index):
        if kind == "medusa":
            share_data(run_folder("eagle"), run_folder("medusa"))
        heads[kind], heldout[kind], train_s[kind] = trained_head(kind, pathlib.Path(HEAD_CONFIGS[kind]))
    args.out.mkdir(parents=True, exist_ok=True)
    for kind in heads:
        shutil.copy(run_folder(kind) / "training_curve.png", args.out / f"training_curve_{kind}.png")
    tc = train_config(HEAD_CONFIGS["eagle"])
    reports, summary = {}, {}
    with tempfile.TemporaryDirectory() as folder:  # Spec-Bench text is read at run time, never committed
        prompts = heldout_prompts_file(pathlib.Path(folder))
        for temperature in args.temperatures:
            for drafter in args.drafters if temperature == 0 else (args.sampled_drafters or args.drafters):
                cfg = RunConfig(model=tc.target, drafter=drafter, draft_model=str(heads.get(drafter) or "") or None,
                                gamma=gammas[drafter], temperature=temperature, max_new_tokens=args.max_new_tokens,
                                prompts_file=str(prompts))
                report = bench(cfg, repeats=1, per_category=args.per_category)
                name = f"{drafter}_t{temperature:g}"
                reports[name] = report
                (args.out / f"bench_{name}.json").write_text(json.dumps(report, indent=1, default=str))
                o = report["overall"]
                summary[name] = {
                    "drafter": drafter, "temperature": temperature, "gamma": gammas[drafter],
                    "acceptance_pos1": o["per_position_acceptance"][0], "tokens_per_round": o["tokens_per_round"],
                    "speedup": o["speedup"], "speedup_open_ended": open_ended_speedup(report),
                    "td_over_t1": o["Td_ms"] / o["T1_ms"], "tv_over_t1": o["Tv_over_T1"],
                    "predicted_speedup": o["predicted_speedup"], "tie_aware_equal": o["tie_aware_equal"],
                    "prompts": o["prompts"]}
    total_s = time.perf_counter() - tick
    payload = {"args": {k: str(v) for k, v in vars(args).items()}, "heldout_agreement": heldout,
               "train_s": train_s, "total_s": total_s, "results": summary}
    (args.out / "summary.json").write_text(json.dumps(payload, indent=1, default=str))

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
              + f"; whole recipe: {total_s / 60:.1f} min\n")
    (args.out / "table.md").write_text(table)
    if greedy:
        plt = pyplot()
        fig, ax = plt.subplots(figsize=(11, 4))
        width = 0.8 / len(greedy)
        for i, n in enumerate(greedy):
            ax.bar([j + i * width for j in range(len(categories))],
                   [reports[n]["categories"][c]["speedup"] for c in categories], width, label=n[:-3])
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(categories))], categories, rotation=30, ha="right")
        ax.set(ylabel="speedup over plain decoding (greedy)", title="SmolLM2-135M, held-out Spec-Bench, batch 1")
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.out / "per_category.png", dpi=120)
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
