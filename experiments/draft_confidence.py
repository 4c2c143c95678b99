"""Does stopping a draft model's chain at its first unconfident draft pay? A replay on the Qwen2.5-Coder pair.

Makes the entry "Should a draft model's chain stop at its first unconfident draft?" of
experiments/README.md.

`--draft-confidence C` (`drafters.model.ModelDrafter.stop_below`) ends a chain after the first draft
whose probability under the drafter's law is below C: the drafts after it are not drawn (their draft
steps are not paid) and not verified. Under greedy verification a chain's accepted drafts are those
the draft's greedy tokens get right in a row, and its confidences are the probabilities of those
tokens, both known from one teacher-forced pass of the draft over each prompt and plain output
(`common.draft_guesses`). So each round of a fixed gamma, with and without the stop, is replayed
here and priced with the costs a bench report measured on this device (`--costs-from`: the median
over its batches of `T_by_width` and `D_by_width`; the replay's widths are those it measured).
After a wrong draft the real chain continues from its own draft, not from the target's token, so
where it stops after a wrong draft is approximated by the teacher-forced confidences; what the
target accepts is not. Tune on the training split, check on the held-out questions:

    python experiments/draft_confidence.py --split train --per-category 1 \\
        --costs-from experiments/results/qwen_pair/speed.json
    python experiments/draft_confidence.py --split heldout \\
        --rows-from experiments/results/qwen_pair/speed.json --costs-from experiments/results/qwen_pair/speed.json

Writes experiments/results/draft_confidence/<split>/ (results.json, table.md, plot.png).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics

from common import RESULTS, draft_guesses, markdown_table, pyplot, save
from policy_replay import chain_tables, plain_rows

from specdec_jax.config import run_config
from specdec_jax.models import load_model

CODING = "coding"


def replay_chain(matches: list[bool], confidence: list[float], gamma: int, threshold: float,
                 max_new: int) -> list[tuple[int, int]]:
    """Per round of one row, ``(drafts, accepted)``: `policy_replay.chain_tables`'s chain at each committed length
    (at most gamma greedy drafts, ended after the first whose confidence is below ``threshold``), cut at the budget
    of ``max_new`` tokens (whose last is the target's own) or the output's end."""
    found, accepted = chain_tables(matches, gamma, confidence, threshold)
    rounds, j = [], 0
    while j < len(matches):
        drafts = int(min(found[j], max_new - 1 - j, len(matches) - j))
        rounds.append((drafts, int(min(accepted[j], drafts))))
        j += rounds[-1][1] + 1
    return rounds


def report_costs(path: pathlib.Path) -> tuple[float, list[float], list[float]]:
    """(T1, verify seconds by width 1.., draft seconds by number of drafts 0..): medians over a bench report's
    batches."""
    batches = json.loads(path.read_text())["batches"]
    median = lambda key: [statistics.median(b[key][i] for b in batches)  # noqa: E731
                          for i in range(len(batches[0][key]))]
    return statistics.median(b["T1"] for b in batches), median("T_by_width"), median("D_by_width")


def price(rounds: list[tuple[int, int]], verify_s: list[float], draft_s: list[float]) -> float:
    """Seconds of the rounds: each round's drafts and its verify pass over t0 and them."""
    return sum(draft_s[d] + verify_s[d] for d, _ in rounds)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen2.5-coder-1.5b")
    parser.add_argument("--draft-model", default="qwen2.5-coder-0.5b")
    parser.add_argument("--draft-vocab", type=int, default=32768)
    parser.add_argument("--split", choices=("train", "heldout"), default="train")
    parser.add_argument("--per-category", type=int, default=1)
    parser.add_argument("--max-prompt-tokens", type=int, default=128)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--rows-from", type=pathlib.Path, default=None,
                        help="a bench report whose prompts and plain outputs to replay (no plain runs)")
    parser.add_argument("--costs-from", type=pathlib.Path, required=True,
                        help="a bench report of the pair (batch 1) whose measured costs price the rounds")
    parser.add_argument("--gammas", type=int, nargs="+", default=[2, 3, 4])
    parser.add_argument("--thresholds", type=float, nargs="+", default=[0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7])
    parser.add_argument("--out", type=pathlib.Path, default=RESULTS / "draft_confidence")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    cfg = run_config(model=args.model, drafter="draft-model", draft_model=args.draft_model,
                     draft_vocab=args.draft_vocab, max_new_tokens=args.max_new_tokens)
    t1, verify_s, draft_s = report_costs(args.costs_from)
    if max(args.gammas) + 1 > len(verify_s):
        raise SystemExit(f"{args.costs_from} measured verify widths up to {len(verify_s)}: gammas up to "
                         f"{len(verify_s) - 1}")
    records, rows = plain_rows(args, cfg, load_model(cfg.model) if not args.rows_from else None)
    guesses = draft_guesses(args.draft_model, rows, args.draft_vocab)
    results, table = [], []
    for gamma in args.gammas:
        for threshold in args.thresholds:
            by_category, total = {}, [0, 0.0, 0, 0]  # emitted tokens, seconds, rounds, drafts
            for (_, category, _, output), (matches, confidence) in zip(rows, guesses):
                rounds = replay_chain(matches, confidence, gamma, threshold, args.max_new_tokens)
                cell = by_category.setdefault(category, [0, 0.0, 0, 0])
                for acc in (cell, total):
                    acc[0] += len(output)
                    acc[1] += price(rounds, verify_s, draft_s)
                    acc[2] += len(rounds)
                    acc[3] += sum(d for d, _ in rounds)
            speedup = {c: v[0] * t1 / v[1] for c, v in by_category.items()}
            overall = total[0] * t1 / total[1]
            worst = min(speedup, key=speedup.get)
            results.append({"gamma": gamma, "threshold": threshold, "speedup": overall,
                            "tokens_per_round": total[0] / total[2], "drafts_per_round": total[3] / total[2],
                            "by_category": speedup})
            table.append([gamma, threshold, overall, total[0] / total[2], total[3] / total[2],
                          speedup.get(CODING, float("nan")), f"{worst} {speedup[worst]:.3f}"])
    header = ["gamma", "confidence", "predicted speedup", "tokens/round", "drafts/round", "coding", "slowest category"]
    figure, ax = pyplot().subplots(figsize=(6, 4))
    for gamma in args.gammas:
        mine = [r for r in results if r["gamma"] == gamma]
        ax.plot([r["threshold"] for r in mine], [r["speedup"] for r in mine], marker="o", label=f"gamma {gamma}")
    ax.set_xlabel("draft confidence below which a chain stops")
    ax.set_ylabel("predicted speedup over plain decoding")
    ax.set_title(f"{args.draft_model} drafting for {args.model} ({args.split}, {len(rows)} questions)")
    ax.legend()
    payload = {"split": args.split, "records": [r["id"] for r in records], "costs_from": str(args.costs_from),
               "T1": t1, "verify_s": verify_s, "draft_s": draft_s, "results": results}
    save(args.out / args.split, payload, markdown_table(header, table), figure)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
