"""The target pass's cost by width on this device: Tv(w) / T1, the curve `--gamma auto` decides with.

Makes the entry "What does verifying w tokens cost, against one plain step?" of experiments/README.md;
writes results.json and table.md to experiments/results/verify_widths (`--out`).

    python experiments/verify_widths.py [--batch-sizes 1 4] [--widths 1 2 3 5 9] [--capacity 512]

SmolLM2-135M (or `--model`), rows of 64 random tokens, the pass timed as the loop runs it
(`engine.calibration.time_target_pass`: the cache read in a conditional, its
block written back, the buffers donated); per (batch, width) the least of
--rounds medians of 5 calls, so a busy moment of a shared machine does not
count. Compare two revisions by running it at each (`git worktree add`, the revision's package
first on PYTHONPATH), e.g. for Qwen2.5-Coder-1.5B with and without the CPU's padded rows:

    python experiments/verify_widths.py --model qwen2.5-coder-1.5b --batch-sizes 1 \\
        --widths 1 2 4 5 8 9 13 16 --out experiments/results/verify_widths/qwen_1.5b
"""

from __future__ import annotations

import argparse
import pathlib

import numpy as np

from common import RESULTS, markdown_table, save
from specdec_jax.drafters.ngram import NgramDrafter
from specdec_jax.engine import prepare
from specdec_jax.engine.calibration import time_target_pass
from specdec_jax.models import load_model


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--widths", type=int, nargs="+", default=[1, 2, 3, 5, 9])
    parser.add_argument("--capacity", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=pathlib.Path, default=RESULTS / "verify_widths")
    args = parser.parse_args(argv)
    if min(args.widths) < 1 or 1 not in args.widths:
        parser.error("--widths must be >= 1 and include 1 (T1)")
    target = load_model(args.model)
    rows, payload = [], {"model": args.model, "capacity": args.capacity, "ms": {}}
    for batch in args.batch_sizes:
        prompts = np.random.default_rng(0).integers(0, target.config.vocab_size, (batch, 64)).tolist()
        run = prepare(target, prompts, NgramDrafter(), gamma=max(args.widths) - 1, max_new_tokens=64,
                      capacity=args.capacity)
        ms = {w: 1e3 * min(time_target_pass(run, w, repeats=5) for _ in range(args.rounds)) for w in args.widths}
        payload["ms"][batch] = ms
        rows += [[batch, w, ms[w], ms[w] / ms[1]] for w in args.widths]
        print(f"batch {batch}: " + ", ".join(f"w{w} {t:.1f} ms" for w, t in ms.items()), flush=True)
    save(args.out, payload, markdown_table(["batch", "width", "ms", "Tv/T1"], rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
