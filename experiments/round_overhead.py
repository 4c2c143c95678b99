"""What a round of `--gamma auto` costs when it verifies nothing, against a plain decoding round.

Makes the entry "What does a round of `--gamma auto` cost when it verifies nothing?" of
experiments/README.md; writes results.json and table.md to experiments/results/round_overhead
(`--out`).

    python experiments/round_overhead.py --batches 1 4 16 --capacities 512 1024 [--repeats 5]
    python experiments/round_overhead.py --model qwen2.5-coder-1.5b --draft-model qwen2.5-coder-0.5b \
        --batches 1 --capacities 512 --rounds 32 --out experiments/results/round_overhead_pair
    python experiments/round_overhead.py --head eagle3 --batches 1 13 --capacities 512 \
        --out experiments/results/round_overhead_heads/eagle3   (likewise --head dflash)

A shape policy's program runs every round through the draft and verify
`lax.switch`es, and carries columns for the widest shape; when it chooses
gamma 0 it should cost what plain decoding (gamma 0, no policy) costs. For each
batch size and KV capacity this times, on SmolLM2-135M with the n-gram drafter
(or `--model` with the draft model `--draft-model`, which skips the rounds that
draft nothing and catches up only when drafting resumes: `drafters.model`; or with `--head` a
random EAGLE-3 head, which skips them too, or a 1-layer DFlash drafter with blocks of 16, which
writes the context of the committed tokens every round) and rows of
64 random tokens, rounds in a loop as the decoding loop runs them
(`engine.calibration.time_rounds`' method: 8 rounds, or `--rounds`, per timed call from the prefilled
state, the state donated): plain rounds, and auto rounds forced to draft and verify nothing
(`DecodeState.forced_shape` (0, 0)), and auto rounds forced to the widest shape.
The two programs alternate, so a change in the machine's load hits both; medians
of ``--repeats``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from block_cost import dflash_drafter, eagle3_drafter
from common import RESULTS, save

from specdec_jax.drafters import ModelDrafter, NgramDrafter
from specdec_jax.engine import prepare
from specdec_jax.engine.shape import ShapePolicy
from specdec_jax.engine.calibration import CALIBRATION_PROMPT, CALIBRATION_ROUNDS, loop_of_rounds
from specdec_jax.engine.shape import AUTO_GAMMAS
from specdec_jax.models import load_model


def time_in_turn(programs: dict, repeats: int, rounds: int) -> dict:
    """Seconds per round of each ``name -> (step, fresh_state)``, ``repeats`` samples each, timed in turn
    (one call of each per repeat)."""
    for step, fresh in programs.values():  # compile and warm up
        jax.block_until_ready(step(fresh()))
    times = {name: [] for name in programs}
    for _ in range(repeats):
        for name, (step, fresh) in programs.items():
            state = jax.block_until_ready(fresh())
            start = time.perf_counter()
            jax.block_until_ready(step(state))
            times[name].append((time.perf_counter() - start) / rounds)
    return times


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--draft-model", default=None, help="a draft model instead of the n-gram drafter")
    parser.add_argument("--head", choices=["eagle3", "dflash"], default=None,
                        help="a random EAGLE-3 head or 1-layer DFlash drafter at the target's widths instead")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16, 32])
    parser.add_argument("--capacities", type=int, nargs="+", default=[512, 1024])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--catch-up", type=int, default=None, help="the draft model's catch_up (default its own)")
    parser.add_argument("--rounds", type=int, default=CALIBRATION_ROUNDS,
                        help="rounds per timed call, from the prefilled state")
    parser.add_argument("--out", type=pathlib.Path, default=RESULTS / "round_overhead")
    args = parser.parse_args(argv)

    target = load_model(args.model)
    if args.head is not None:  # what a round costs does not depend on the weights
        drafter = eagle3_drafter(target, args.model) if args.head == "eagle3" else dflash_drafter(target, 1, 16)
        draft_cost = 1.0
    elif args.draft_model is None:
        drafter, draft_cost = NgramDrafter(), 0.0  # a free drafter: the policy drafts G every round
    else:
        draft = load_model(args.draft_model)
        drafter, draft_cost = ModelDrafter(draft.config, draft.model.params()), 1.0
        if args.catch_up is not None:
            drafter = dataclasses.replace(drafter, catch_up=args.catch_up)
    gammas = AUTO_GAMMAS
    policy = ShapePolicy(gammas, (1.0,) * len(gammas), (0.0,) + (draft_cost,) * (len(gammas) - 1))
    widest = len(gammas) - 1
    records = []
    for capacity in args.capacities:
        for batch in args.batches:
            prompts = np.random.default_rng(0).integers(0, target.config.vocab_size,
                                                        (batch, CALIBRATION_PROMPT)).tolist()
            budget = args.rounds * (max(gammas) + 1) + 2
            plain = prepare(target, prompts, None, gamma=0, max_new_tokens=budget, capacity=capacity)
            auto = prepare(target, prompts, drafter, policy=policy, max_new_tokens=budget, capacity=capacity)
            copy = lambda run, **kw: jax.tree.map(jnp.copy, run.state.replace(**kw))  # noqa: E731
            forced = lambda d, v: jnp.array([d, v], jnp.int32)  # noqa: E731
            plain_step, auto_step = loop_of_rounds(plain, args.rounds), loop_of_rounds(auto, args.rounds)
            samples = time_in_turn({
                "plain": (lambda s: plain_step(plain.params, s), lambda: copy(plain)),
                "auto_none": (lambda s: auto_step(auto.params, s), lambda: copy(auto, forced_shape=forced(0, 0))),
                "auto_widest": (lambda s: auto_step(auto.params, s),
                                lambda: copy(auto, forced_shape=forced(widest, widest))),
            }, args.repeats, args.rounds)
            seconds = {name: statistics.median(t) for name, t in samples.items()}
            record = {"batch": batch, "capacity": capacity, **{f"{k}_ms": 1e3 * v for k, v in seconds.items()},
                      "none_over_plain": seconds["auto_none"] / seconds["plain"],
                      "widest_over_plain": seconds["auto_widest"] / seconds["plain"]}
            print(json.dumps(record), flush=True)
            records.append(record)

    lines = ["| capacity | batch | plain ms | auto, nothing verified ms | ratio | auto, widest ms | ratio |",
             "|---|---|---|---|---|---|---|"]
    lines += [f"| {r['capacity']} | {r['batch']} | {r['plain_ms']:.1f} | {r['auto_none_ms']:.1f} | "
              f"{r['none_over_plain']:.3f} | {r['auto_widest_ms']:.1f} | {r['widest_over_plain']:.2f} |"
              for r in records]
    save(args.out, records, "\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
