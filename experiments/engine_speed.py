"""Engine throughput: plain decoding (gamma 0) vs the oracle drafter (alpha 0.8, gamma 4) on tiny-random.

Makes the entry "How fast is the engine itself: plain decoding vs the oracle drafter on tiny-random?"
of experiments/README.md; writes results.json and table.md to experiments/results/engine_speed.

    python experiments/engine_speed.py [--repeats 5] [--max-new-tokens 128]

Batch 1 and 16, random byte prompts of ragged lengths, greedy, no EOS. Every
configuration is compiled first (untimed); then the timed runs alternate
between gamma 0 and gamma 4 so that machine noise hits both alike. Reports
median tokens/s and their ratio, plus tokens per round; writes JSON and a
markdown table to --out.
"""

from __future__ import annotations

import argparse
import pathlib
import statistics

import numpy as np
from common import RESULTS, save

from specdec_jax.drafters import oracle_drafter
from specdec_jax.engine import generate
from specdec_jax.models import load_model


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--alpha", type=float, default=0.8)
    parser.add_argument("--gamma", type=int, default=4)
    parser.add_argument("--out", type=pathlib.Path, default=RESULTS / "engine_speed")
    args = parser.parse_args(argv)

    target = load_model("tiny-random")
    drafter = oracle_drafter(target.config, target.model.params(), args.alpha)
    rng = np.random.default_rng(0)
    records = []
    for batch in (1, 16):
        prompts = [rng.integers(0, 256, int(n)).tolist() for n in rng.integers(8, 33, batch)]
        runs = {0: None, args.gamma: drafter}

        def once(gamma):
            return generate(target, prompts, runs[gamma], gamma=gamma, max_new_tokens=args.max_new_tokens,
                            capacity=256)

        for gamma in runs:  # compile
            once(gamma)
        times = {gamma: [] for gamma in runs}
        last = {}
        for _ in range(args.repeats):
            for gamma in runs:
                last[gamma] = once(gamma)
                times[gamma].append(last[gamma].wall_s)
        tps = {g: batch * args.max_new_tokens / statistics.median(t) for g, t in times.items()}
        record = {
            "batch": batch,
            "plain_tokens_per_s": tps[0],
            "spec_tokens_per_s": tps[args.gamma],
            "speedup": tps[args.gamma] / tps[0],
            "tokens_per_round": last[args.gamma].metrics.mean_accepted_length,
            "outputs_equal": last[0].tokens == last[args.gamma].tokens,
            "median_wall_s": {str(g): statistics.median(t) for g, t in times.items()},
        }
        records.append(record)
        print(record)
    table = ["| batch | gamma 0 tok/s | gamma 4 (oracle a=0.8) tok/s | ratio | tokens/round | outputs equal |",
             "|---|---|---|---|---|---|"]
    for r in records:
        table.append(f"| {r['batch']} | {r['plain_tokens_per_s']:.0f} | {r['spec_tokens_per_s']:.0f} | "
                     f"{r['speedup']:.2f}x | {r['tokens_per_round']:.2f} | {r['outputs_equal']} |")
    save(args.out, {"args": vars(args) | {"out": str(args.out)}, "records": records}, "\n".join(table) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
