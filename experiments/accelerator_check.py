"""The accelerator check: what speculative decoding can gain on this device, in one report.

Makes the entry "What does a GPU or TPU give speculative decoding?" of experiments/README.md; run by
`scripts/accelerator_check.sh`, which writes its report beside the gpu/tpu tests' results.

    python experiments/accelerator_check.py [--out DIR] [--budget-s 240] [--dry-run]

Random bfloat16 weights of real shapes (`SHAPES`: the Qwen2.5-1.5B and the Llama-3-8B decoder), drawn
on the device itself (no download, nothing on the host), then per shape, in this order until the
time budget is spent (what did not fit is listed under ``skipped``):

1. plain decoding's step ``T1`` at batch 1 against the memory-bandwidth floor (weight bytes over the
   measured bandwidth of a device-resident sum);
2. the target pass's cost by width, ``Tv(w) / T1`` for w in 1, 2, 4, 8, 16, 32 (batch 1), timed as the
   loop runs it (`engine.calibration.time_target_pass`);
3. the same at batches 8, 32 and 64 (w = 1 and 8), with plain decoding's tokens per second;
4. whole rounds of the decoding loop at gamma 1..8 and for a 16-node token tree (batch 1), timed in a
   loop of rounds as the program runs them (`engine.calibration.measure_costs`, n-gram drafts, so the
   drafting costs next to nothing): the round's cost past its drafting in ``T1``, the loop's
   per-round overhead (a plain round less a plain target pass), and the speedup an oracle drafter
   whose drafts are free would reach at acceptance 0.6 and 0.8 (``E[tokens per round] / (round /
   T1)``, with E from `specdec_jax.theory`; the tree's tokens per round depend on its drafter, so
   its row gives the break-even instead).

``--dry-run``: tiny float32 shapes on whatever jax sees (the CPU here), every step, in seconds: the
check's own test (tests/test_accelerator_check.py, slow).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import time

import jax
import jax.numpy as jnp
import numpy as np

from common import RESULTS, markdown_table, save
from specdec_jax.bench import memory_bandwidth
from specdec_jax.drafters.ngram import NgramDrafter
from specdec_jax.engine import prepare
from specdec_jax.engine.calibration import measure_costs, time_target_pass
from specdec_jax.models.llama import LlamaConfig, LlamaTarget, layer_params, param_shapes
from specdec_jax.theory import expected_tokens_per_round
from specdec_jax.token_tree import TreeShape

SHAPES = {  # decoder shapes of published checkpoints (RoPE scaling changes no cost and is left out)
    "qwen2.5-1.5b": LlamaConfig(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_layers=28,
                                num_heads=12, num_kv_heads=2, head_dim=128, rope_theta=1e6, tie_embeddings=True,
                                attention_bias=True, dtype="bfloat16"),
    "llama3-8b": LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32,
                             num_heads=32, num_kv_heads=8, head_dim=128, rope_theta=500000.0, tie_embeddings=False,
                             dtype="bfloat16"),
}
DRY_SHAPES = {"tiny": LlamaConfig(vocab_size=258, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                                  num_kv_heads=2, head_dim=16)}
WIDTHS = (1, 2, 4, 8, 16, 32)
BATCHES = (8, 32, 64)
GAMMAS = tuple(range(9))  # rounds drafting 0..8
TREE = TreeShape(nodes=16, depth=4, topk=4)
ALPHAS = (0.6, 0.8)
PROMPT = 64  # tokens per row
CAPACITY = 512


@dataclasses.dataclass(frozen=True)
class RandomTarget:
    """A target of ``config``'s shape with ``params`` drawn on the device (`random_params`)."""

    config: LlamaConfig
    params: dict

    def as_target(self):
        return LlamaTarget(self.config), self.params


def random_params(config: LlamaConfig, seed: int = 0) -> dict:
    """Weights of ``config`` in its dtype, drawn with jax.random on the default device: norms ones,
    matrices N(0, 1/in), embedding and head N(0, 4/H) (logits of std about 2). Layer weights come as
    tuples of L arrays, as `Llama.params` hands them out."""
    dtype, shapes, per_layer = jnp.dtype(config.dtype), param_shapes(config), set(layer_params(config))
    keys = iter(jax.random.split(jax.random.key(seed), 4 * len(shapes) * config.num_layers + 8))

    def draw(name: str, shape: tuple[int, ...]) -> jax.Array:
        if name.endswith("norm"):
            return jnp.ones(shape, dtype)
        scale = 2.0 / np.sqrt(config.hidden_size) if name in ("embed", "lm_head") else 1.0 / np.sqrt(shape[-1])
        return (scale * jax.random.normal(next(keys), shape, jnp.float32)).astype(dtype)

    return {name: tuple(draw(name, shape[1:]) for _ in range(config.num_layers)) if name in per_layer
            else draw(name, shape) for name, shape in shapes.items()}


def param_bytes(params: dict) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))


def prepared(target: RandomTarget, batch: int, drafter=None):
    """A prepared batch of ``batch`` rows of PROMPT random tokens (`engine.prepare`) to time passes on."""
    prompts = np.random.default_rng(batch).integers(0, target.config.vocab_size, (batch, PROMPT)).tolist()
    return prepare(target, prompts, drafter, gamma=max(WIDTHS) - 1 if drafter else 0, max_new_tokens=64,
                   capacity=CAPACITY)


def steps(target: RandomTarget, bandwidth: float, report: dict, repeats: int) -> list[tuple[str, object]]:
    """The measurements of the module docstring for one shape, in order, as (name, thunk) pairs, each
    filling its part of ``report`` (so that the time budget can stop between any two)."""
    runs = {}

    def run(batch: int):
        if batch not in runs:
            runs.clear()  # one prepared batch (and its KV cache) on the device at a time
            runs[batch] = prepared(target, batch, NgramDrafter())
        return runs[batch]

    def width(w: int):
        report.setdefault("Tv_ms", {})[w] = 1e3 * time_target_pass(run(1), w, repeats)
        t1 = report["Tv_ms"][1]
        floor = report["weight_bytes"] / bandwidth
        report.update(T1_ms=t1, floor_ms=1e3 * floor, T1_over_floor=t1 / (1e3 * floor),
                      Tv_over_T1={k: v / t1 for k, v in report["Tv_ms"].items()})

    def batch(b: int):
        t1, t8 = (time_target_pass(run(b), w, repeats) for w in (1, 8))
        report.setdefault("batches", {})[b] = {"T1_ms": 1e3 * t1, "Tv8_over_T1": t8 / t1, "plain_tokens_per_s": b / t1}

    def chain():
        runs.clear()
        costs = measure_costs(target, NgramDrafter(), 1, CAPACITY, GAMMAS, repeats=repeats)
        t1 = costs["T1"]
        report["round_overhead_ms"] = 1e3 * t1 - report.get("T1_ms", float("nan"))
        report["rounds"] = {g: {"round_over_T1": v / t1, **{f"speedup_alpha_{a}": expected_tokens_per_round(a, g) * t1 / v
                                                            for a in ALPHAS}}
                            for g, v in zip(GAMMAS, costs["verify_s"]) if g}

    def tree():
        costs = measure_costs(target, NgramDrafter(tree=TREE), 1, CAPACITY, (0, TREE.nodes), tree=True, repeats=repeats)
        report["tree16_round_over_T1"] = costs["verify_s"][1] / costs["T1"]

    return ([(f"Tv({w})", lambda w=w: width(w)) for w in WIDTHS] + [(f"batch {b}", lambda b=b: batch(b)) for b in BATCHES]
            + [("rounds", chain), (f"tree {TREE.nodes}", tree)])


def check_shape(name: str, config: LlamaConfig, bandwidth: float, deadline: float, repeats: int) -> dict:
    """The report of one shape: each of its `steps` run while the time budget lasts, the rest listed
    under ``skipped``."""
    start = time.monotonic()
    target = RandomTarget(config, jax.block_until_ready(random_params(config)))
    report = {"shape": name, "weight_bytes": param_bytes(target.params), "skipped": []}
    for step, thunk in steps(target, bandwidth, report, repeats):
        if time.monotonic() > deadline:
            report["skipped"].append(step)
        else:
            thunk()
    report["seconds"] = time.monotonic() - start
    return report


def table(reports: list[dict]) -> str:
    """The report as markdown: one row per shape for the passes, one per shape and gamma for rounds."""
    passes = [[r["shape"], r.get("T1_ms", "-"), r.get("floor_ms", "-"), r.get("T1_over_floor", "-"),
               r.get("round_overhead_ms", "-"), *[r.get("Tv_over_T1", {}).get(w, "-") for w in WIDTHS],
               ", ".join(r["skipped"]) or "-"] for r in reports]
    text = markdown_table(["shape", "T1 ms", "floor ms", "T1/floor", "round overhead ms",
                           *[f"Tv({w})/T1" for w in WIDTHS], "skipped"], passes)
    batches = [[r["shape"], b, v["T1_ms"], v["Tv8_over_T1"], v["plain_tokens_per_s"]]
               for r in reports for b, v in r.get("batches", {}).items()]
    text += "\n" + markdown_table(["shape", "batch", "T1 ms", "Tv(8)/T1", "plain tokens/s"], batches)
    rounds = [[r["shape"], g, v["round_over_T1"], *[v[f"speedup_alpha_{a}"] for a in ALPHAS]]
              for r in reports for g, v in r.get("rounds", {}).items()]
    rounds += [[r["shape"], f"tree {TREE.nodes}", r["tree16_round_over_T1"], "-", "-"]
               for r in reports if "tree16_round_over_T1" in r]
    text += "\n" + markdown_table(["shape", "gamma", "round/T1", *[f"free-draft speedup a={a}" for a in ALPHAS]],
                                  rounds)
    return text


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, default=RESULTS / "accelerator")
    parser.add_argument("--budget-s", type=float, default=240.0, help="start no step after this many seconds")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dry-run", action="store_true", help="tiny float32 shapes (a check of the check)")
    args = parser.parse_args(argv)
    deadline = time.monotonic() + args.budget_s
    bandwidth = memory_bandwidth()
    shapes = DRY_SHAPES if args.dry_run else SHAPES
    reports = [check_shape(name, config, bandwidth, deadline, args.repeats) for name, config in shapes.items()]
    payload = {"jax": jax.__version__, "devices": [str(d) for d in jax.devices()], "bandwidth_GBps": bandwidth / 1e9,
               "budget_s": args.budget_s, "dry_run": args.dry_run, "shapes": reports}
    save(args.out, json.loads(json.dumps(payload)), table(reports))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
