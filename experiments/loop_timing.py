"""The decoding loop alone on one held-out batch: plain vs auto that never verifies vs calibrated auto.

Makes the loop timing cited in the entry "Does `--gamma auto` hold up at batch 16 and 32?" of
experiments/README.md (how much of auto's shortfall on a batch of 16 is its program, how much its
probes); writes results.json and table.md to experiments/results/loop_timing/ (`--out`).

    python experiments/loop_timing.py [--batch-size 16] [--repeats 5] [--drafter eagle]

Prefill is done once per program (`engine.prepare`); each timed call runs
`engine.run_loop` on a copy of the prefilled state (copied before the clock
starts), the three programs in turn, so the machine's load hits them alike.
"never" is the shape policy's program (the calibrated one) with every verify width priced out of
reach: what auto costs when it chooses plain steps only. The batch is the first
``--batch-size`` held-out questions of the recipes' split (two per category, at
most 1024 prompt tokens: `experiments/auto_shape.py`'s batches), greedy, 128 new
tokens, the n-gram drafter unless `--drafter` names another (`--draft-model` defaults to the
recipe's head or draft in the cache).
"""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
import statistics
import time

import jax
import jax.numpy as jnp
from common import RESULTS, cached_draft_model, markdown_table, prompt_record, recipe_questions, save

from specdec_jax import engine
from specdec_jax.config import run_config
from specdec_jax.engine import AUTO_GAMMAS, run_loop
from specdec_jax.models import load_model
from specdec_jax.runner import build_drafter, encode, stop_ids


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--drafter", default="ngram")
    parser.add_argument("--draft-model", default=None, help="default: the recipe's head or draft in the cache")
    parser.add_argument("--out", type=pathlib.Path, default=RESULTS / "loop_timing")
    args = parser.parse_args(argv)
    cfg = run_config(max_new_tokens=128, drafter=args.drafter,
                    draft_model=args.draft_model or cached_draft_model(args.drafter))
    target = load_model(cfg.model)
    tok, drafter = target.tokenizer, build_drafter(cfg, target)
    records = [prompt_record(q) for q in recipe_questions("heldout", 2, max_prompt_tokens=1024, tokenizer=tok)]
    prompts = [encode(tok, r["prompt"], cfg.inputs.raw) for r in records[: args.batch_size]]
    capacity = engine.default_capacity(max(map(len, prompts)), cfg.inputs.max_new_tokens, max(AUTO_GAMMAS))

    def program(drafter=None, gamma=None, policy=None):
        return engine.prepare(target, prompts, drafter, gamma=gamma, policy=policy, max_new_tokens=cfg.inputs.max_new_tokens,
                              stop_ids=stop_ids(cfg, tok), capacity=capacity)

    runs = {"plain": program(gamma=0), "auto": program(drafter)}
    calibrated = runs["auto"].spec.policy  # its draft costs decide whether drafting runs every round
    never = dataclasses.replace(calibrated, verify_cost=(1.0,) + (1e9,) * (len(calibrated.gammas) - 1))
    runs = {"plain": runs["plain"], "never": program(drafter, policy=never), "auto": runs["auto"]}
    seconds, last = {name: [] for name in runs}, {}
    for repeat in range(args.repeats + 1):  # the first pass compiles
        for name, run in runs.items():
            state = jax.block_until_ready(jax.tree.map(jnp.copy, run.state))
            start = time.perf_counter()
            last[name] = jax.block_until_ready(run_loop(run.spec, run.params, state))
            if repeat:
                seconds[name].append(time.perf_counter() - start)
    plain = statistics.median(seconds["plain"])
    rows = []
    for name, state in last.items():
        rounds = int(state.step)
        median = statistics.median(seconds[name])
        rows.append([name, 1e3 * median / rounds, rounds, plain / median,
                     "/".join(map(str, state.counters.width_rounds.tolist())),
                     " ".join(f"{s:.2f}" for s in seconds[name])])
    table = (f"batch {len(prompts)}, capacity {capacity}, drafter {args.drafter}, medians of {args.repeats} "
             "alternated runs of the decoding loop\n\n"
             + markdown_table(["program", "ms / round", "rounds", "speedup over plain", "verify widths chosen",
                               "runs (s)"], rows))
    save(args.out, {"args": {k: str(v) for k, v in vars(args).items()}, "capacity": capacity,
                    "ids": [r["id"] for r in records[: args.batch_size]], "seconds": seconds,
                    "rows": rows}, table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
