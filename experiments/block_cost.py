"""What does drafting a DFlash block cost, against a chain of the same length from an EAGLE head or a draft model?

Makes the entry "What does a DFlash block cost to draft, against a chain?" of experiments/README.md; writes
results.json, table.md and plot.png to experiments/results/block_cost (`--out`).

    python experiments/block_cost.py [--targets smollm2-135m qwen2.5-coder-1.5b] [--blocks 4 8 16] [--repeats 7]

For each target (batch 1, a random prompt of 128 tokens, KV capacity 512), with the engine's own timers
(`engine.calibration`: medians of `--repeats`, each program's call overhead taken out as calibration takes
it out):

- T1, one target step (a plain decoding round's target pass);
- a DFlash drafter with random weights (costs do not depend on the values) of 1 and 5 draft layers at the
  target's widths, reading z-lab's default target layers: one block pass of B tokens, B in `--blocks`,
  drafting B - 1 tokens (`DFlashDrafter.with_block`);
- an EAGLE-3 head with random weights (one decoder layer at the target's widths, a draft vocabulary of 8,192
  ids for SmolLM2 and 32,768 for Qwen, as the published heads reduce theirs): chains of B - 1 drafts;
- for the Qwen target, its 0.5B draft model (`qwen2.5-coder-0.5b`, real weights): chains of B - 1 drafts.

Every cost is in units of T1, measured in the same process right after T1.
"""

from __future__ import annotations

import argparse
import dataclasses
import pathlib

import numpy as np
from common import RESULTS, markdown_table, pyplot, save

from specdec_jax.distill.dflash_drafter import init_dflash
from specdec_jax.distill.eagle3_head import eagle3_config, init_eagle3
from specdec_jax.drafters.dflash import DFlashConfig, DFlashDrafter
from specdec_jax.drafters.eagle3 import Eagle3Drafter
from specdec_jax.drafters.model import ModelDrafter
from specdec_jax.drafters.published import zlab_layer_ids
from specdec_jax.engine import ShapePolicy, prepare
from specdec_jax.engine.calibration import time_draft_steps, time_target_pass
from specdec_jax.models import load_model

DRAFT_MODEL = {"qwen2.5-coder-1.5b": "qwen2.5-coder-0.5b"}
HEAD_VOCAB = {"smollm2-135m": 8192, "qwen2.5-coder-1.5b": 32768}
DFLASH_LAYERS = (1, 5)
PROMPT, CAPACITY = 128, 512


def dflash_drafter(target, layers: int, block: int) -> DFlashDrafter:
    """A DFlash drafter of ``layers`` Qwen3 layers at the target's widths (random weights)."""
    tcfg = target.config
    layer = dataclasses.replace(tcfg, num_layers=layers, qk_norm=True, tie_embeddings=False, output_vocab_size=None)
    cfg = DFlashConfig(layer, tuple(zlab_layer_ids(tcfg.num_layers, layers)), tcfg.hidden_size, block, mask_token=0)
    return DFlashDrafter(cfg, init_dflash(cfg, seed=layers))


def eagle3_drafter(target, name: str) -> Eagle3Drafter:
    """An EAGLE-3 head at the target's widths over its `HEAD_VOCAB` first ids (random weights; another
    target: half its vocabulary, at most 8,192 ids)."""
    tcfg = target.config
    widths = {k: getattr(tcfg, k) for k in ("intermediate_size", "num_heads", "num_kv_heads", "head_dim")}
    cfg = eagle3_config(tcfg, (-1,), widths, HEAD_VOCAB.get(name, min(8192, tcfg.vocab_size // 2)))
    arrays = target.model.arrays()
    rows = np.asarray(arrays["lm_head"] if "lm_head" in arrays else arrays["embed"]).T  # [H, V]
    return Eagle3Drafter(cfg, init_eagle3(cfg, 0, rows, np.arange(cfg.output_vocab_size)))


def chain_costs(target, prompt, drafter, gammas, repeats: int) -> list[float]:
    """Seconds of drafting each of ``gammas`` tokens with ``drafter`` (less a step drafting none)."""
    policy = ShapePolicy((0, *gammas), (1.0,) * (len(gammas) + 1), (0.0,) + (1.0,) * len(gammas))
    run = prepare(target, [prompt], drafter, policy=policy, max_new_tokens=64, capacity=CAPACITY)
    idle, *timed = time_draft_steps(run, [0, *gammas], repeats)
    return [max(0.0, t - idle) for t in timed]


def measure(name: str, blocks: list[int], repeats: int) -> dict:
    target = load_model(name)
    prompt = np.random.default_rng(0).integers(0, target.config.vocab_size, PROMPT).tolist()
    t1 = time_target_pass(prepare(target, [prompt], None, gamma=0, max_new_tokens=64, capacity=CAPACITY), 1, repeats)
    chains = [b - 1 for b in blocks]
    costs = {}
    for layers in DFLASH_LAYERS:
        costs[f"DFlash, {layers} layer{'s' * (layers > 1)}"] = [
            chain_costs(target, prompt, dflash_drafter(target, layers, b), [b - 1], repeats)[0] for b in blocks]
    costs["EAGLE-3 head"] = chain_costs(target, prompt, eagle3_drafter(target, name), chains, repeats)
    if name in DRAFT_MODEL:
        draft = load_model(DRAFT_MODEL[name])
        costs[f"{DRAFT_MODEL[name]} draft"] = chain_costs(
            target, prompt, ModelDrafter(draft.config, draft.model.params()), chains, repeats)
    return {"T1_s": t1, "blocks": blocks, "drafts": chains, "seconds": costs,
            "in_T1": {k: [s / t1 for s in v] for k, v in costs.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--targets", nargs="+", default=["smollm2-135m", "qwen2.5-coder-1.5b"])
    parser.add_argument("--blocks", nargs="+", type=int, default=[4, 8, 16])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--out", type=pathlib.Path, default=RESULTS / "block_cost")
    args = parser.parse_args()
    results = {name: measure(name, args.blocks, args.repeats) for name in args.targets}
    header = ["target", "T1 (ms)", "drafter"] + [f"B = {b} ({b - 1} drafts)" for b in args.blocks]
    rows = [[name, round(1e3 * r["T1_s"], 1), drafter] + [round(x, 3) for x in r["in_T1"][drafter]]
            for name, r in results.items() for drafter in r["in_T1"]]
    plt = pyplot()
    figure, axes = plt.subplots(1, len(results), figsize=(5.5 * len(results), 4), squeeze=False)
    for ax, (name, r) in zip(axes[0], results.items()):
        for drafter, values in r["in_T1"].items():
            ax.plot(r["drafts"], values, marker="o", label=drafter)
        ax.set(xlabel="drafts per round", ylabel="drafting cost (T1)", title=name, xticks=r["drafts"])
        ax.legend(fontsize=8)
    save(args.out, {"targets": results, "repeats": args.repeats}, markdown_table(header, rows), figure)


if __name__ == "__main__":
    main()
