"""Leviathan et al.'s walltime model: speedup vs gamma, predicted vs measured.

Makes the entry "Does Leviathan et al.'s walltime model predict the measured speedup?" of
experiments/README.md; writes results.json, table.md and walltime_model.png to
experiments/results/walltime_model (`--out`).

    python experiments/walltime_model.py [--per-category 1] [--max-new-tokens 64]

SmolLM2-135M, greedy, batch 1, Spec-Bench prompts (the first --per-category of
each category), through `specdec_jax.bench` (plain and speculative decoding
interleaved, the cost terms measured in the same run) for the n-gram drafter and
the oracle drafter (alpha 0.8; it drafts with the target itself, so each draft
costs a full target step: c = Td/T1 = 1). Two predictions per point:

    Leviathan (eq. 1 and Thm 3.8): (1 - a^(g+1)) / ((1 - a) (g c + 1)), c = Td / T1,
        a = the measured acceptance at draft 1 (under the paper's i.i.d. assumption,
        every draft's acceptance probability; accepted / drafted is not: it counts
        the drafts after a rejection as rejected). Assumes i.i.d. acceptance and a
        verify pass costing one target step.
    ours (docs/design.md section 8): tau T1 / (g Td + mean verify cost of the rounds run),
        with the measured tau and the width each round verified at.

On this CPU a gamma+1 verify pass costs about 2 T1, so Leviathan's model
overestimates; the per-width cost model should track the measurement.
"""

from __future__ import annotations

import argparse
import pathlib
import sys

from common import RESULTS, markdown_table, pyplot, save, spec_bench_subset
from specdec_jax.bench import bench
from specdec_jax.config import run_config
from specdec_jax.theory import expected_tokens_per_round

GAMMAS = [1, 2, 4, 8]
DRAFTERS = {"ngram": {"drafter": "ngram"}, "oracle a=0.8": {"drafter": "oracle", "oracle_alpha": 0.8}}


def leviathan(alpha: float, gamma: int, c: float) -> float:
    return expected_tokens_per_round(alpha, gamma) / (gamma * c + 1)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--per-category", type=int, default=1)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--out", type=pathlib.Path, default=RESULTS / "walltime_model")
    args = parser.parse_args(argv)
    rows, records = [], []
    with spec_bench_subset(args.per_category) as prompts_file:
        for name, drafter in DRAFTERS.items():
            for gamma in GAMMAS:
                cfg = run_config(model=args.model, gamma=gamma, max_new_tokens=args.max_new_tokens,
                                prompts_file=str(prompts_file), **drafter)
                overall = bench(cfg, repeats=args.repeats)["overall"]
                alpha, c = overall["per_position_acceptance"][0], overall["Td_ms"] / overall["T1_ms"]
                row = [name, gamma, alpha, expected_tokens_per_round(alpha, gamma), overall["tokens_per_round"], c,
                       overall["Tv_over_T1"], leviathan(alpha, gamma, c), overall["predicted_speedup"],
                       overall["speedup"]]
                rows.append(row)
                records.append({"drafter": name, "gamma": gamma, **overall})
                print(row, flush=True)
    header = ["drafter", "gamma", "acceptance at draft 1", "i.i.d. tokens/round", "measured tokens/round",
              "c = Td/T1", "Tv/T1", "Leviathan predicted", "cost-model predicted", "measured"]
    plt = pyplot()
    fig, axes = plt.subplots(1, len(DRAFTERS), figsize=(5 * len(DRAFTERS), 3.6))
    for ax, name in zip(axes, DRAFTERS):
        pts = [r for r in rows if r[0] == name]
        ax.plot(GAMMAS, [p[9] for p in pts], "o-", label="measured")
        ax.plot(GAMMAS, [p[8] for p in pts], "s--", label="cost model (measured Tv, widths)")
        ax.plot(GAMMAS, [p[7] for p in pts], "x:", label="Leviathan (i.i.d., verify = 1 step)")
        ax.axhline(1.0, color="gray", lw=0.8)
        ax.set(xlabel="gamma", ylabel="speedup over plain", title=name)
        ax.set_xticks(GAMMAS)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    save(args.out, {"args": vars(args), "header": header, "rows": rows, "records": records},
         markdown_table(header, rows), fig, "walltime_model.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
