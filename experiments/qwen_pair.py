"""The Qwen2.5-Coder pair: the 0.5B drafting for the 1.5B on held-out Spec-Bench questions.

Makes the entries "How many tokens per round does Qwen2.5-Coder-0.5B give its 1.5B sibling?" and
"Does the same-family pair pay in wall-clock time on this CPU?" of experiments/README.md; writes to
experiments/results/qwen_pair (`--out`):

    python experiments/qwen_pair.py acceptance   # gamma 2, 3, 4; greedy and temperature 0.7; per category
    python experiments/qwen_pair.py speed        # --gamma auto against plain decoding, side by side (bench)
    python experiments/qwen_pair.py peer         # transformers greedy and assisted generation beside ours
    python experiments/qwen_pair.py tables       # redraws tables and figures from the saved JSON

Prompts: the held-out split (the 5 highest question ids of each category, never trained on), the
first `--per-category` of each category plus `--extra-coding` more coding questions; batch 1, 128
new tokens, float32. `acceptance` runs speculative decoding only, all prompts as one ragged batch per
setting (tokens per round and acceptance by draft position are deterministic for a seed and the same on
any hardware, and a row's counts are those of its solo run); `speed` and `peer`
run `specdec_jax.bench` (plain and speculative decoding alternate on each prompt; decode-phase
medians).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

from common import RESULTS, category_bars, markdown_table, prompts_file, pyplot, recipe_questions, write_json

TARGET, DRAFT = "qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b"
GAMMAS = (2, 3, 4)
TEMPERATURES = (0.0, 0.7)


def questions(args) -> list[dict]:
    chosen = recipe_questions("heldout", per_category=args.per_category)
    if args.extra_coding:
        coding = recipe_questions("heldout", categories=["coding"])
        have = {q["question_id"] for q in chosen}
        chosen += [q for q in coding if q["question_id"] not in have][: args.extra_coding]
    return chosen


def run_acceptance(args) -> dict:
    """{"runs": [{"temperature", "gamma", "id", "category", "rounds", "emitted_tokens", ...}]}: one ragged batch
    of every prompt per (temperature, gamma); each row's counts are its solo run's (rows are independent)."""
    import time

    from specdec_jax.drafters import ModelDrafter
    from specdec_jax.engine import generate
    from specdec_jax.models import load_model
    from specdec_jax.runner import encode
    from specdec_jax.sampling import SamplingParams

    target, draft = load_model(TARGET), load_model(DRAFT)
    drafter = ModelDrafter(draft.config, draft.model.params())
    chosen = questions(args)
    prompts = [encode(target.tokenizer, q["turns"][0], raw=False) for q in chosen]
    runs, positions = [], []
    for temperature in TEMPERATURES:
        for gamma in GAMMAS:
            start = time.perf_counter()
            out = generate(target, prompts, drafter, gamma=gamma, sampling=SamplingParams(temperature=temperature),
                           max_new_tokens=args.max_new_tokens, stop_ids=target.tokenizer.stop_ids, seed=args.seed)
            print(f"temperature {temperature}, gamma {gamma}: {out.metrics.mean_accepted_length:.2f} tokens/round "
                  f"({time.perf_counter() - start:.0f} s)", flush=True)
            positions.append({"temperature": temperature, "gamma": gamma,
                              "per_position_acceptance": out.metrics.per_position_acceptance,
                              "tokens_per_round": out.metrics.mean_accepted_length})
            runs += [{"temperature": temperature, "gamma": gamma, "id": q["question_id"], "category": q["category"],
                      **counts, "tokens": tokens} for q, counts, tokens in zip(chosen, out.row_counts, out.tokens)]
    return {"target": TARGET, "draft": DRAFT, "max_new_tokens": args.max_new_tokens, "seed": args.seed,
            "runs": runs, "overall": positions}


def acceptance_tables(payload: dict, out: pathlib.Path) -> str:
    runs = payload["runs"]
    categories = list(dict.fromkeys(r["category"] for r in runs))
    pooled = {}  # (temperature, gamma, category or "overall") -> tokens per round from summed counts

    def rate(rows):
        return sum(r["emitted_tokens"] for r in rows) / max(sum(r["rounds"] for r in rows), 1)

    for t in TEMPERATURES:
        for g in GAMMAS:
            rows = [r for r in runs if r["temperature"] == t and r["gamma"] == g]
            pooled[t, g, "overall"] = rate(rows)
            for c in categories:
                pooled[t, g, c] = rate([r for r in rows if r["category"] == c])
    header = ["category"] + [f"T={t} g={g}" for t in TEMPERATURES for g in GAMMAS]
    table = markdown_table(header, [[c] + [pooled[t, g, c] for t in TEMPERATURES for g in GAMMAS]
                                    for c in [*categories, "overall"]])
    position = [[o["temperature"], o["gamma"], *o["per_position_acceptance"]] for o in payload["overall"]]
    width = max(len(row) for row in position)
    table += "\nacceptance by draft position (all prompts):\n\n" + markdown_table(
        ["temperature", "gamma"] + [f"draft {i}" for i in range(1, width - 1)],
        [row + ["-"] * (width - len(row)) for row in position])
    plt = pyplot()
    fig, axes = plt.subplots(1, len(TEMPERATURES), figsize=(13, 4), sharey=True)
    for ax, t in zip(axes, TEMPERATURES):
        category_bars(ax, [*categories, "overall"], {f"gamma {g}": [pooled[t, g, c] for c in [*categories, "overall"]]
                                                     for g in GAMMAS},
                      ylabel="tokens per round", title=f"Qwen2.5-Coder 0.5B -> 1.5B, temperature {t}")
    (out / "acceptance_table.md").write_text(table)
    fig.tight_layout()
    fig.savefig(out / "acceptance.png", dpi=120)
    plt.close(fig)
    return table


def run_bench(args, peer: bool) -> dict:
    from specdec_jax.bench import bench
    from specdec_jax.config import RunConfig

    chosen = questions(args) if not peer else recipe_questions("heldout", categories=["coding"])[: args.peer_prompts]
    with prompts_file(chosen) as path:
        cfg = RunConfig(model=TARGET, drafter="draft-model", draft_model=DRAFT, gamma="auto" if not peer else 4,
                        max_new_tokens=args.max_new_tokens, prompts_file=str(path), seed=args.seed)
        return bench(cfg, repeats=args.repeats, peer="hf" if peer else None)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("stage", choices=["acceptance", "speed", "peer", "tables"])
    parser.add_argument("--per-category", type=int, default=1)
    parser.add_argument("--extra-coding", type=int, default=3, help="more held-out coding questions")
    parser.add_argument("--peer-prompts", type=int, default=3, help="coding questions timed beside transformers")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=pathlib.Path, default=RESULTS / "qwen_pair")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.stage == "acceptance":
        write_json(args.out / "acceptance.json", run_acceptance(args))
    elif args.stage in ("speed", "peer"):
        from specdec_jax.bench import format_report

        report = run_bench(args, peer=args.stage == "peer")
        write_json(args.out / f"{args.stage}.json", report)
        (args.out / f"{args.stage}_table.md").write_text(format_report(report) + "\n")
        print(format_report(report))
    if (args.out / "acceptance.json").is_file():
        print(acceptance_tables(json.loads((args.out / "acceptance.json").read_text()), args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
