"""Where does a draft step of the Qwen pair's 0.5B go, and what does a reduced draft vocabulary save?

Makes the entry "Where does the 0.5B's draft step go?" of experiments/README.md; writes results.json and
table.md to experiments/results/draft_step_cost (`--out`).

    python experiments/draft_step_cost.py [--draft-vocab 32768] [--repeats 15]

One process, the pieces timed in turn each repeat (medians), batch 1, KV capacity 512, 100 tokens in the
caches:

- the machine's memory bandwidth (`bench.memory_bandwidth`: a large read in JAX) and, for each piece, the
  floor its weight bytes give (bytes / bandwidth);
- the 0.5B's forward pass of 1 and 4 tokens without its output head, with its whole head (151,936 rows)
  and with the head of a reduced vocabulary (`--draft-vocab` first ids and the stop ids,
  `LoadedModel.with_output_vocab`);
- the engine's draft step (`engine.calibration.time_draft_steps`, less a step that drafts nothing) at
  gamma 1 to 4 with each head, and T1, the 1.5B target's one-token step, in the same process.
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import time

import jax
import jax.numpy as jnp
from common import RESULTS, markdown_table, save

from specdec_jax.bench import memory_bandwidth
from specdec_jax.drafters.model import ModelDrafter
from specdec_jax.engine import ShapePolicy, prepare
from specdec_jax.engine.calibration import time_draft_steps, time_target_pass
from specdec_jax.models import load_model
from specdec_jax.models.llama import forward

TARGET, DRAFT = "qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b"
CAPACITY, FILLED = 512, 100
GAMMAS = (0, 1, 2, 3, 4)


def forward_timer(draft, width: int, logits: bool):
    """A function of no arguments timing one forward pass of ``width`` tokens (seconds), compiled."""
    cfg, params = draft.config, draft.model.params()
    step = jax.jit(lambda p, c, t: forward(cfg, p, t, c, compute_logits=logits), donate_argnums=1)
    tokens = jnp.ones((1, width), jnp.int32)
    state = {"cache": cfg.init_cache(1, CAPACITY)}

    def once() -> float:
        cache = state["cache"].with_lengths(jnp.array([FILLED], jnp.int32))
        start = time.perf_counter()
        out, state["cache"] = step(params, cache, tokens)
        jax.block_until_ready((out, state["cache"]))
        return time.perf_counter() - start

    once()
    return once


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--draft-vocab", type=int, default=32768)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--out", type=pathlib.Path, default=RESULTS / "draft_step_cost")
    args = parser.parse_args()
    bandwidth = memory_bandwidth()
    target, full = load_model(TARGET), load_model(DRAFT)
    reduced = full.with_output_vocab(args.draft_vocab)
    arrays = full.model.params()  # the device arrays, not copies
    head = arrays["lm_head"] if "lm_head" in arrays else arrays["embed"]
    body = sum(a.nbytes for n, v in arrays.items() if n not in ("embed", "lm_head") for a in jax.tree.leaves(v))
    pieces = {  # name -> (timer, weight bytes read)
        "body, 1 token": (forward_timer(full, 1, False), body),
        "body, 4 tokens": (forward_timer(full, 4, False), body),
        "body + whole head, 1 token": (forward_timer(full, 1, True), body + head.nbytes),
        "body + whole head, 4 tokens": (forward_timer(full, 4, True), body + head.nbytes),
        f"body + {args.draft_vocab}-id head, 1 token": (forward_timer(reduced, 1, True),
                                                       body + reduced.model.params()["lm_head"].nbytes),
    }
    samples = {name: [] for name in pieces}
    for _ in range(args.repeats):
        for name, (once, _) in pieces.items():
            samples[name].append(once())
    forward_ms = {name: 1e3 * statistics.median(s) for name, s in samples.items()}
    prompt = list(range(1000, 1000 + FILLED))
    policy = ShapePolicy(GAMMAS, (1.0,) * len(GAMMAS), (0.0,) + (1.0,) * (len(GAMMAS) - 1))
    steps, t1 = {}, None
    for label, draft in (("whole head", full), (f"{args.draft_vocab}-id head", reduced)):
        run = prepare(target, [prompt], ModelDrafter(draft.config, draft.model.params()), policy=policy,
                      max_new_tokens=64, capacity=CAPACITY)
        t1 = time_target_pass(run, 1, args.repeats) if t1 is None else t1
        idle, *timed = time_draft_steps(run, list(GAMMAS), args.repeats)  # gamma 0 first: the call alone
        steps[label] = [1e3 * max(0.0, t - idle) for t in timed]
    t1_ms = 1e3 * t1
    rows = [[name, round(ms, 1), round(ms / t1_ms, 3), round(1e3 * b / bandwidth, 1)]
            for name, ms in forward_ms.items() for b in [pieces[name][1]]]
    rows += [[f"draft step, gamma {g}, {label}", round(ms, 1), round(ms / t1_ms, 3), ""]
             for label, values in steps.items() for g, ms in zip(GAMMAS[1:], values)]
    table = (f"T1 (the 1.5B's step) {t1_ms:.1f} ms; bandwidth {bandwidth / 1e9:.1f} GB/s\n\n"
             + markdown_table(["piece", "ms", "T1", "bandwidth floor (ms)"], rows))
    save(args.out, {"T1_ms": t1_ms, "bandwidth_gb_s": bandwidth / 1e9, "forward_ms": forward_ms,
                    "weight_bytes": {n: b for n, (_, b) in pieces.items()}, "draft_step_ms": steps,
                    "repeats": args.repeats, "draft_vocab": args.draft_vocab}, table)


if __name__ == "__main__":
    main()
