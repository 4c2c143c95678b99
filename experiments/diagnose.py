"""Experiment 7: diagnosis of a slow configuration ("gamma 5 barely moved latency").

    python experiments/diagnose.py [--from-bench REPORT.json] [--gamma 5] [--per-category 1] [--out ...]

Runs `specdec_jax.bench` on a configuration (default: SmolLM2-135M, n-gram,
gamma 5, the first question of each Spec-Bench category, 64 new tokens) or reads
a saved bench report, and writes the table a researcher reads first:

1. acceptance by draft position: rounds that proposed >= i drafts, of those the
   share whose draft i was accepted, and accepted(i) / accepted(i-1) (the rate
   given draft i-1 was accepted, when such rounds go on to propose draft i);
2. where a round's time goes: drafting (gamma Td), verifying (at the width each
   round ran), and the rest (measured minus predicted: loop overhead);
3. what each shorter gamma' would give under the same acceptance curve and the
   same share of rounds that draft at all, with a verify pass interpolated
   linearly between T1 and Tv: the gamma the cost model recommends.
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import sys

from common import RESULTS, markdown_table, pyplot, save, spec_bench_subset
from specdec_jax.bench import bench
from specdec_jax.config import RunConfig


def position_table(batches: list[dict]) -> list[list]:
    proposed = [sum(b["position_proposed"][i] for b in batches) for i in range(len(batches[0]["position_proposed"]))]
    accepted = [sum(b["position_accepted"][i] for b in batches) for i in range(len(proposed))]
    rows = []
    for i, (p, a) in enumerate(zip(proposed, accepted)):
        prev = accepted[i - 1] if i else None
        conditional = a / prev if prev else (a / p if p else float("nan"))
        rows.append([i + 1, p, a, a / p if p else float("nan"), conditional])
    return rows


def gamma_table(rows: list[list], overall: dict, drafting: float) -> list[list]:
    """Predicted tokens/round and speedup if drafts stopped at gamma' (same acceptance curve). A share
    `drafting` of rounds proposes drafts; the others verify at width 1 and cost T1."""
    t1, tv, td, gamma = overall["T1_ms"], overall["Tv_ms"], overall["Td_ms"], len(rows)
    out, survive, extra = [], 1.0, 0.0
    for g in range(0, gamma + 1):
        if g:
            survive *= 0.0 if math.isnan(rows[g - 1][4]) else rows[g - 1][4]
            extra += survive
        verify = t1 + (tv - t1) * g / gamma
        tokens = 1 + drafting * extra
        round_ms = (1 - drafting) * t1 + drafting * verify + g * td
        out.append([g, tokens, round_ms, tokens * t1 / round_ms])
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--from-bench", type=pathlib.Path, help="a saved `specdec-jax bench --json` report")
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--drafter", default="ngram")
    parser.add_argument("--gamma", type=int, default=5)
    parser.add_argument("--per-category", type=int, default=1)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--out", type=pathlib.Path, default=RESULTS / "diagnose")
    args = parser.parse_args(argv)
    if args.from_bench:
        report = json.loads(args.from_bench.read_text())
    else:
        with spec_bench_subset(args.per_category) as prompts_file:
            cfg = RunConfig(model=args.model, drafter=args.drafter, gamma=args.gamma,
                            max_new_tokens=args.max_new_tokens, prompts_file=str(prompts_file))
            report = bench(cfg, repeats=1)
    overall, batches = report["overall"], report["batches"]
    positions = position_table(batches)
    rounds = sum(b["loop_rounds"]["spec"] for b in batches)
    width_rounds = [sum(b["width_rounds"][i] for b in batches) for i in range(len(batches[0]["width_rounds"]))]
    spec_s = sum(b["spec_s"] for b in batches)
    draft_ms = report["config"]["gamma"] * overall["Td_ms"]
    verify_ms = overall["verify_ms_per_round"]
    measured_ms = 1000 * spec_s / rounds
    time_rows = [["draft (gamma Td)", draft_ms, draft_ms / measured_ms],
                 ["verify (widths run)", verify_ms, verify_ms / measured_ms],
                 ["rest (loop, sampling, overhead)", measured_ms - draft_ms - verify_ms,
                  (measured_ms - draft_ms - verify_ms) / measured_ms],
                 ["measured round", measured_ms, 1.0]]
    gammas = gamma_table(positions, overall, positions[0][1] / rounds)
    best = max(gammas, key=lambda r: r[3])
    cfg = report["config"]
    table = (f"Diagnosis: {cfg['model']}, drafter {cfg['drafter']}, gamma {cfg['gamma']}, {overall['prompts']} prompts; "
             f"speedup {overall['speedup']:.2f}x measured, {overall['predicted_speedup']:.2f}x predicted; "
             f"tokens/round {overall['tokens_per_round']:.2f}; T1 {overall['T1_ms']:.1f} ms, Tv {overall['Tv_ms']:.1f} ms "
             f"(Tv/T1 {overall['Tv_over_T1']:.2f}); rounds with no draft at all (verified at width 1): "
             f"{width_rounds[0]} of {rounds}\n\n"
             + markdown_table(["draft position", "rounds proposing it", "accepted", "acceptance",
                               "accepted(i) / accepted(i-1)"], positions)
             + "\n" + markdown_table(["part of a round", "ms", "share"], time_rows)
             + "\n" + markdown_table(["gamma'", "predicted tokens/round", "predicted round ms", "predicted speedup"],
                                     gammas)
             + f"\nThe cost model recommends gamma' = {best[0]} ({best[3]:.2f}x predicted).\n")
    plt = pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.4))
    left.plot([r[0] for r in positions], [r[3] for r in positions], "o-", label="acceptance")
    left.plot([r[0] for r in positions], [r[4] for r in positions], "s--", label="given previous accepted")
    left.set(xlabel="draft position", ylabel="rate", ylim=(0, 1), title="Acceptance by position")
    left.legend(fontsize=8)
    right.plot([r[0] for r in gammas], [r[3] for r in gammas], "o-")
    right.axhline(1.0, color="gray", lw=0.8)
    right.set(xlabel="gamma'", ylabel="predicted speedup", title="Same acceptance, shorter drafts")
    for ax in (left, right):
        ax.grid(alpha=0.3)
    save(args.out, {"config": cfg, "positions": positions, "time": time_rows, "gammas": gammas,
                    "width_rounds": width_rounds}, table, fig, "diagnose.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
