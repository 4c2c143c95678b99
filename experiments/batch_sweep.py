"""Throughput and speculative speedup vs batch size, fixed gamma (speculation stops paying as the batch grows).

Makes the entry "Does fixed-gamma speculation still pay as the batch grows?" of experiments/README.md.

    python experiments/batch_sweep.py --max-new-tokens 32 [--batches 1 4 16 32] [--repeats 1]

Ragged Spec-Bench prompts of copy-heavy categories (default extraction and
translation: the n-gram drafter finds drafts there, and prompts of 50-400
tokens keep the run short): the first `--prompts` of them in file order, the same
prompt set for every batch size, plain vs n-gram speculative decoding (gamma 4)
through `specdec_jax.bench`. Writes results.json, table.md and batch_sweep.png to
experiments/results/batch_sweep (`--out`).
"""

from __future__ import annotations

import argparse
import pathlib

from common import RESULTS, prompts_file, pyplot, save

from specdec_jax.bench import bench
from specdec_jax.config import run_config
from specdec_jax.data import spec_bench_questions


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16, 32])
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--gamma", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--prompts", type=int, default=32, help="prompts in the set (a multiple of every batch size)")
    parser.add_argument("--categories", nargs="+", default=["extraction", "translation"])
    parser.add_argument("--out", type=pathlib.Path, default=RESULTS / "batch_sweep")
    args = parser.parse_args(argv)

    chosen = [q for q in spec_bench_questions() if q["category"] in args.categories][: args.prompts]
    records = []
    with prompts_file(chosen) as prompts:  # Spec-Bench text is read at run time, never written to the repository
        for batch in args.batches:
            cfg = run_config(model=args.model, drafter="ngram", gamma=args.gamma, max_new_tokens=args.max_new_tokens,
                            batch_size=batch, prompts_file=str(prompts))
            overall = bench(cfg, repeats=args.repeats)["overall"]
            records.append({"batch": batch, **overall})
            print(f"batch {batch}: end to end plain {overall['plain_e2e_tokens_per_s']:.1f} tok/s, spec "
                  f"{overall['spec_e2e_tokens_per_s']:.1f} tok/s, speedup {overall['e2e_speedup']:.2f}x; "
                  f"Tv/T1 {overall['Tv_over_T1']:.2f}", flush=True)
    lines = ["| batch | plain tok/s (end to end) | spec tok/s (end to end) | speedup (end to end) | speedup (decode "
             "phase) | tokens/round | T1 ms | Tv ms | Tv/T1 | predicted (decode) | spec = plain |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in records:
        lines.append(f"| {r['batch']} | {r['plain_e2e_tokens_per_s']:.1f} | {r['spec_e2e_tokens_per_s']:.1f} | "
                     f"{r['e2e_speedup']:.2f}x | {r['speedup']:.2f}x | {r['tokens_per_round']:.2f} | {r['T1_ms']:.1f} | "
                     f"{r['Tv_ms']:.1f} | {r['Tv_over_T1']:.2f} | {r['predicted_speedup']:.2f}x | "
                     f"{r['tie_aware_equal']} ({r['exact_match_rate']:.2f} exact) |")
    save(args.out, {"args": {k: str(v) for k, v in vars(args).items()}, "records": records}, "\n".join(lines) + "\n",
         plot(records), "batch_sweep.png")
    return 0


def plot(records: list[dict]):
    batches = [r["batch"] for r in records]
    fig, (left, right) = pyplot().subplots(1, 2, figsize=(9, 3.6))
    left.plot(batches, [r["plain_e2e_tokens_per_s"] for r in records], "o-", label="plain")
    left.plot(batches, [r["spec_e2e_tokens_per_s"] for r in records], "s-", label="n-gram speculative")
    left.set(xscale="log", xlabel="batch size", ylabel="tokens/s (end to end)", title="Throughput")
    left.set_xticks(batches, [str(b) for b in batches])
    left.legend()
    right.plot(batches, [r["e2e_speedup"] for r in records], "o-", label="measured, end to end")
    right.plot(batches, [r["speedup"] for r in records], "s:", label="measured, decode phase")
    right.plot(batches, [r["predicted_speedup"] for r in records], "x--", label="cost model (decode)")
    right.axhline(1.0, color="gray", lw=0.8)
    right.set(xscale="log", xlabel="batch size", ylabel="speculative / plain", title="Speedup")
    right.set_xticks(batches, [str(b) for b in batches])
    right.legend()
    for ax in (left, right):
        ax.grid(alpha=0.3)
    return fig


if __name__ == "__main__":
    raise SystemExit(main())
