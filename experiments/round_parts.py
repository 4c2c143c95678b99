"""Does a drafting round cost more than its parts? The draft model's round against its target pass and draft steps.

Makes the entry "Does a drafting round of the pair cost more than its target pass and its draft steps?" of
experiments/README.md; writes results.json, table.md and samples.png to experiments/results/round_parts
(`--out`).

    python experiments/round_parts.py [--gammas 1 3] [--repeats 11] [--capacity 256]

The Qwen2.5-Coder pair (`--model`, `--draft-model`, the draft's 32,768-id head), one row of 64
random tokens, every part a `fori_loop` of `--rounds` in one jitted call with its state donated
(`engine.calibration`'s method), all programs timed in turn, one call of each per repeat:

- ``plain``: plain decoding's rounds (T1 and its bookkeeping);
- ``Tv{w}``: the target pass alone at width w (w = 1 and gamma + 1), its cache read in a
  conditional and its block written back, its greedy tokens kept;
- ``D{g}``: the engine's `draft_step` at a fixed gamma g, its drafts never verified;
- ``fixed{g}``: whole rounds at a fixed gamma g, draft step then verify step.

A round should cost its target pass plus its draft step: the rest is the round's bookkeeping
(acceptance, commit, the drafter's hook). A shared machine's speed can move between the samples
(and least samples of the parts can come from one speed and the whole's from another), so the
rest is taken within each repeat, whole less parts timed seconds apart, and its median kept; the
table gives each part's median beside it. samples.png plots every sample in the order taken,
which shows when the machine's speed moved.
Set XLA_FLAGS to compare XLA CPU's options (the table names the flags it ran with).
"""

from __future__ import annotations

import argparse
import functools
import os
import pathlib
import statistics

import jax
import jax.numpy as jnp
import numpy as np
from common import RESULTS, pyplot, save
from round_overhead import time_in_turn

from specdec_jax.config import run_config
from specdec_jax.engine import prepare
from specdec_jax.engine.calibration import loop_of_rounds, target_pass_step
from specdec_jax.engine.round import draft_step
from specdec_jax.models import load_model
from specdec_jax.runner import build_drafter


def target_passes(run, width: int, rounds: int):
    """A jitted ``(target params, (cache, acc i32[])) -> (cache, acc)``: ``rounds`` of the calibration's target
    pass of ``width`` tokens (`engine.calibration.target_pass_step`), the carry donated; ``acc`` sums the greedy
    tokens, so that no pass's logits are dead code."""
    one = target_pass_step(run.spec, width)

    def passes(params, carry):
        def body(_, carry):
            cache, top = one(params, carry)
            return cache, carry[1] + jnp.sum(top)

        return jax.lax.fori_loop(0, rounds, body, carry)

    return jax.jit(passes, donate_argnums=1)


def draft_steps(run, rounds: int):
    """A jitted ``(params, state) -> state``: ``rounds`` of ``run``'s draft step, never verified."""
    step = functools.partial(draft_step, run.spec)
    return jax.jit(lambda params, state: jax.lax.fori_loop(0, rounds, lambda _, s: step(params, s), state),
                   donate_argnums=1)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen2.5-coder-1.5b")
    parser.add_argument("--draft-model", default="qwen2.5-coder-0.5b")
    parser.add_argument("--draft-vocab", type=int, default=32768)
    parser.add_argument("--gammas", type=int, nargs="+", default=[1, 3])
    parser.add_argument("--capacity", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=11)
    parser.add_argument("--rounds", type=int, default=8, help="rounds per timed call")
    parser.add_argument("--out", type=pathlib.Path, default=RESULTS / "round_parts")
    args = parser.parse_args(argv)

    cfg = run_config(model=args.model, drafter="draft-model", draft_model=args.draft_model, gamma=1,
                     draft_vocab=args.draft_vocab)
    target = load_model(args.model)
    drafter = build_drafter(cfg, target)
    prompts = np.random.default_rng(0).integers(0, target.config.vocab_size, (1, 64)).tolist()
    budget = args.rounds * (max(args.gammas) + 1) + 2
    plain = prepare(target, prompts, None, gamma=0, max_new_tokens=budget, capacity=args.capacity)
    copy = lambda run: jax.tree.map(jnp.copy, run.state)  # noqa: E731
    programs = {"plain": (functools.partial(loop_of_rounds(plain, args.rounds), plain.params), lambda: copy(plain))}
    for width in sorted({1, *(g + 1 for g in args.gammas)}):
        passes = functools.partial(target_passes(plain, width, args.rounds), plain.params.target)
        programs[f"Tv{width}"] = (passes, lambda: (jax.tree.map(jnp.copy, plain.state.cache),
                                                   jnp.zeros((), jnp.int32)))
    for gamma in args.gammas:
        fixed = prepare(target, prompts, drafter, gamma=gamma, max_new_tokens=budget, capacity=args.capacity)
        programs[f"D{gamma}"] = (functools.partial(draft_steps(fixed, args.rounds), fixed.params),
                                 lambda run=fixed: copy(run))
        programs[f"fixed{gamma}"] = (functools.partial(loop_of_rounds(fixed, args.rounds), fixed.params),
                                     lambda run=fixed: copy(run))
    samples = {name: [1e3 * t for t in times] for name, times in time_in_turn(programs, args.repeats,
                                                                              args.rounds).items()}
    parts = {"plain": ("plain", "Tv1", None)}
    parts.update({f"gamma {g}": (f"fixed{g}", f"Tv{g + 1}", f"D{g}") for g in args.gammas})
    rows = []
    for label, (whole, target_pass, draft) in parts.items():
        drafts = samples[draft] if draft else [0.0] * args.repeats
        rests = [w - t - d for w, t, d in zip(samples[whole], samples[target_pass], drafts)]
        rows.append({"round": label, "whole_ms": statistics.median(samples[whole]),
                     "target_ms": statistics.median(samples[target_pass]), "draft_ms": statistics.median(drafts),
                     "rest_ms": statistics.median(rests), "least_whole_ms": min(samples[whole])})
    t1 = statistics.median(samples["Tv1"])
    ratios = ", ".join(f"{k}: {statistics.median(v) / t1:.2f}" for k, v in samples.items() if k.startswith("Tv"))
    lines = [f"XLA_FLAGS: {os.environ.get('XLA_FLAGS') or '(none)'}; medians of {args.repeats} samples, ms per round; "
             f"Tv(w)/T1 = {ratios}",
             "", "| round | whole | target pass | draft steps | rest (within a repeat) | least whole |",
             "|---|---|---|---|---|---|"]
    lines += [f"| {r['round']} | {r['whole_ms']:.1f} | {r['target_ms']:.1f} | {r['draft_ms']:.1f} | "
              f"{r['rest_ms']:+.1f} | {r['least_whole_ms']:.1f} |" for r in rows]
    plt = pyplot()
    figure, axis = plt.subplots(figsize=(7, 4))
    for name, times in samples.items():
        axis.plot(range(1, len(times) + 1), times, marker="o", label=name)
    axis.set(xlabel="repeat (programs timed in turn)", ylabel="ms per round", title="every sample, in the order taken")
    axis.legend(fontsize=8, ncol=2)
    save(args.out, {"xla_flags": os.environ.get("XLA_FLAGS"), "samples_ms": samples, "rows": rows, **vars(args),
                    "out": str(args.out)}, "\n".join(lines) + "\n", figure, png="samples.png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
