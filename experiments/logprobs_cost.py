"""What reporting log-probabilities (`--logprobs K`) costs the decoding loop, against leaving it off.

Makes the entry "What does `--logprobs` cost?" of experiments/README.md; writes results.json and
table.md to experiments/results/logprobs_cost (`--out`).

    python experiments/logprobs_cost.py [--repeats 5] [--model smollm2-135m]

For plain decoding and the n-gram drafter at a fixed gamma 4 (no calibration), this times
`engine.generate` with logprobs off, K = 0 (each emitted token's own log-prob), K = 20 (the most
the CLI takes) and K = 5 in "processed" mode, alternated in one process, one run of each a repeat
(their order rotating), after a warm-up call of each (compiles): medians of the decoding loop's
seconds (`GenerationResult.decode_s`) and the median of each run's ratio to the run with logprobs
off of the same repeat (runs of one repeat are back to back, so a change in a shared machine's load
reaches them alike). Batch 1, greedy, 128 new tokens, a 32-token prompt (an 8-token random pattern
repeated, so that the n-gram drafter finds drafts). The tokens must not change with logprobs.
"""

from __future__ import annotations

import argparse
import pathlib
import statistics

import numpy as np
from common import RESULTS, markdown_table, save

from specdec_jax.drafters import NgramDrafter
from specdec_jax.engine import generate
from specdec_jax.models import load_model

MODES = {"off": {}, "K=0": {"logprobs": 0}, "K=20": {"logprobs": 20},
         "K=5 processed": {"logprobs": 5, "logprobs_mode": "processed"}}
CASES = (("plain", None, 0), ("n-gram gamma 4", "ngram", 4))  # (name, drafter, gamma)


def time_case(target, drafter: str | None, gamma: int, max_new_tokens: int, repeats: int) -> dict:
    """Median decode seconds per mode and each mode's paired ratio to logprobs off."""
    pattern = np.random.default_rng(0).integers(0, target.config.vocab_size, 8).tolist()
    prompts = [pattern * 4]

    def once(mode):
        return generate(target, prompts, NgramDrafter() if drafter else None, gamma=gamma,
                        max_new_tokens=max_new_tokens, **MODES[mode])

    last = {mode: once(mode) for mode in MODES}  # compile and warm up
    seconds = {mode: [] for mode in MODES}
    names = list(MODES)
    for repeat in range(repeats):
        for mode in names[repeat % len(names):] + names[:repeat % len(names)]:
            last[mode] = once(mode)
            seconds[mode].append(last[mode].decode_s)
    return {"rounds": last["off"].loop_rounds, "tokens": len(last["off"].tokens[0]),
            "ms": {m: 1e3 * statistics.median(s) for m, s in seconds.items()},
            "ratio": {m: statistics.median(a / b for a, b in zip(s, seconds["off"])) for m, s in seconds.items()},
            "tokens_equal": all(r.tokens == last["off"].tokens for r in last.values()), "seconds": seconds}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--out", type=pathlib.Path, default=RESULTS / "logprobs_cost")
    args = parser.parse_args(argv)
    target = load_model(args.model)
    records = []
    for name, drafter, gamma in CASES:
        record = {"case": name, **time_case(target, drafter, gamma, args.max_new_tokens, args.repeats)}
        print({k: v for k, v in record.items() if k != "seconds"}, flush=True)
        records.append(record)
    table = markdown_table(
        ["case", "rounds"] + [f"{m}: ms (x off)" for m in MODES] + ["tokens equal"],
        [[r["case"], r["rounds"]] + [f"{r['ms'][m]:.0f} ({r['ratio'][m]:.3f})" for m in MODES]
         + ["yes" if r["tokens_equal"] else "no"] for r in records])
    save(args.out, {"model": args.model, "repeats": args.repeats, "max_new_tokens": args.max_new_tokens,
                    "records": records},
         f"{args.model}, batch 1, greedy, {args.max_new_tokens} new tokens; medians of {args.repeats} rotated runs "
         f"(paired ratio to logprobs off)\n\n{table}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
