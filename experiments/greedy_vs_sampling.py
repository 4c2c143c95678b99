"""Greedy vs sampling: the n-gram drafter's acceptance and speedup at temperature 0, 0.7 and 1.0.

Makes the entry "How do acceptance and speedup change with the sampling temperature?" of
experiments/README.md; writes results.json, table.md and greedy_vs_sampling.png to
experiments/results/greedy_vs_sampling (`--out`).

    python experiments/greedy_vs_sampling.py --per-category 1 --max-new-tokens 64

SmolLM2-135M with the n-gram drafter (gamma 4), batch 1, the first `--per-category` Spec-Bench questions of each category,
through `specdec_jax.bench` at each temperature (same seed). The n-gram drafter
is a point mass q, so a draft d is accepted with probability p(d): sampling
spreads p and lowers acceptance, and with it the speedup. Sampled outputs differ
from plain decoding's by design (same law, other draws), so equality is only
checked at temperature 0.
"""

from __future__ import annotations

import argparse
import pathlib
import sys

from common import RESULTS, markdown_table, pyplot, save, spec_bench_subset
from specdec_jax.bench import bench
from specdec_jax.config import run_config

TEMPERATURES = [0.0, 0.7, 1.0]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--gamma", type=int, default=4)
    parser.add_argument("--per-category", type=int, default=1)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--out", type=pathlib.Path, default=RESULTS / "greedy_vs_sampling")
    args = parser.parse_args(argv)
    rows, records = [], []
    with spec_bench_subset(args.per_category) as prompts_file:
        for temperature in TEMPERATURES:
            cfg = run_config(model=args.model, drafter="ngram", gamma=args.gamma, temperature=temperature,
                            max_new_tokens=args.max_new_tokens, prompts_file=str(prompts_file))
            overall = bench(cfg, repeats=args.repeats)["overall"]
            rows.append([temperature, overall["prompts"], overall["acceptance_rate"], overall["tokens_per_round"],
                         overall["per_position_acceptance"][0], overall["speedup"], overall["predicted_speedup"],
                         "-" if overall["tie_aware_equal"] is None else overall["tie_aware_equal"]])
            records.append({"temperature": temperature, **overall})
            print(rows[-1], flush=True)
    header = ["temperature", "prompts", "acceptance", "tokens/round", "acceptance at draft 1", "speedup", "predicted",
              "spec = plain (tie-aware)"]
    plt = pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.5))
    left.plot(TEMPERATURES, [r[2] for r in rows], "o-", label="acceptance")
    left.plot(TEMPERATURES, [r[4] for r in rows], "s--", label="at draft 1")
    left.set(xlabel="temperature", ylabel="acceptance rate", title="n-gram acceptance")
    left.legend()
    right.plot(TEMPERATURES, [r[5] for r in rows], "o-", label="measured")
    right.plot(TEMPERATURES, [r[6] for r in rows], "x--", label="cost model")
    right.axhline(1.0, color="gray", lw=0.8)
    right.set(xlabel="temperature", ylabel="speedup over plain", title="Speedup")
    right.legend()
    for ax in (left, right):
        ax.grid(alpha=0.3)
    save(args.out, {"args": vars(args), "header": header, "rows": rows, "records": records},
         markdown_table(header, rows), fig, "greedy_vs_sampling.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
