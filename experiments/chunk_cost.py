"""What running the decoding loop in chunks costs, against one call for the whole generation.

Makes the entry "What does running the decoding loop in chunks cost?" of experiments/README.md;
writes results.json and table.md to experiments/results/chunk_cost (`--out`).

    python experiments/chunk_cost.py [--repeats 7]

`engine.generate` calls the compiled `run_loop` in chunks of about
`generation.CHUNK_S` seconds (the first of `FIRST_CHUNK_ROUNDS` rounds, each
next one sized from the last one's rate) and reads each row's ``done`` and the
round count on the host between them, so that Ctrl-C is seen within about a
second; `CHUNK_S = None` runs the same program in one call for the whole
generation. For each case this times `generate` both ways, alternated in one
process, one pair a repeat (its order alternating), after a warm-up call of
each (compiles): medians of ``--repeats`` of the decoding loop's seconds
(`GenerationResult.decode_s`, from after prefill to the tokens on the host),
the median and range of each pair's ratio (a pair runs back to back, so a
change in a shared machine's load reaches both of its runs alike), the
chunked run's loop calls, and whether the outputs are equal. The cases are
plain decoding (gamma 0) and the n-gram drafter at a fixed gamma 4 (no
calibration) on tiny-random, and plain decoding on smollm2-135m-random
(SmolLM2-135M's shapes, random weights: nothing is downloaded); batch 1,
greedy, random prompts of 32 tokens (a repeated 8-token pattern for the
n-gram case).
"""

from __future__ import annotations

import argparse
import pathlib
import statistics

import numpy as np
from common import RESULTS, markdown_table, save

from specdec_jax.drafters import NgramDrafter
from specdec_jax.engine import generate, generation
from specdec_jax.models import load_model

CASES = (  # (name, model, drafter, gamma, max_new_tokens)
    ("tiny-random, plain", "tiny-random", None, 0, 256),
    ("tiny-random, n-gram gamma 4", "tiny-random", "ngram", 4, 256),
    ("smollm2-135m-random, plain", "smollm2-135m-random", None, 0, 24),
)


def time_case(model: str, drafter: str | None, gamma: int, max_new_tokens: int, repeats: int) -> dict:
    """Median decode seconds of `generate` with the shipped chunks and with one call, alternated."""
    target = load_model(model)
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, target.config.vocab_size, 32 if drafter is None else 8).tolist()
    prompts = [prompt if drafter is None else prompt * 4]
    shipped, calls = generation.CHUNK_S, []
    real_loop = generation.run_loop

    def counted(*args):
        calls.append(1)
        return real_loop(*args)

    def once(chunk_s):
        generation.CHUNK_S, generation.run_loop = chunk_s, counted
        try:
            return generate(target, prompts, NgramDrafter() if drafter else None, gamma=gamma,
                            max_new_tokens=max_new_tokens)
        finally:
            generation.CHUNK_S, generation.run_loop = shipped, real_loop

    modes = {"chunks": shipped, "one call": None}
    last = {mode: once(chunk_s) for mode, chunk_s in modes.items()}  # compile and warm up
    seconds, chunk_calls = {mode: [] for mode in modes}, []
    for repeat in range(repeats):  # a pair a repeat, its order alternating
        for mode in (list(modes) if repeat % 2 == 0 else list(modes)[::-1]):
            calls.clear()
            last[mode] = once(modes[mode])
            seconds[mode].append(last[mode].decode_s)
            if modes[mode] is not None:
                chunk_calls.append(len(calls))
    ratios = [c / o for c, o in zip(seconds["chunks"], seconds["one call"])]
    return {"rounds": last["chunks"].loop_rounds, "tokens": len(last["chunks"].tokens[0]),
            "chunks_ms": 1e3 * statistics.median(seconds["chunks"]),
            "one_call_ms": 1e3 * statistics.median(seconds["one call"]),
            "paired_ratio": statistics.median(ratios), "ratio_range": [min(ratios), max(ratios)],
            "loop_calls": statistics.median(chunk_calls),
            "outputs_equal": last["chunks"].tokens == last["one call"].tokens, "seconds": seconds}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--out", type=pathlib.Path, default=RESULTS / "chunk_cost")
    args = parser.parse_args(argv)
    records = []
    for name, model, drafter, gamma, max_new in CASES:
        record = {"case": name, "max_new_tokens": max_new, **time_case(model, drafter, gamma, max_new, args.repeats)}
        print(record, flush=True)
        records.append(record)
    table = markdown_table(
        ["case", "new tokens", "rounds", "loop calls (chunks)", "decode ms, chunks", "decode ms, one call",
         "chunks / one call, paired (range)", "outputs equal"],
        [[r["case"], r["tokens"], r["rounds"], f"{r['loop_calls']:g}", f"{r['chunks_ms']:.1f}",
          f"{r['one_call_ms']:.1f}", "{:.3f} ({:.2f}-{:.2f})".format(r["paired_ratio"], *r["ratio_range"]),
          "yes" if r["outputs_equal"] else "no"]
         for r in records])
    save(args.out, {"repeats": args.repeats, "chunk_s": generation.CHUNK_S, "records": records},
         f"medians of {args.repeats} alternated runs, batch 1, greedy\n\n{table}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
