"""Issue 17: gamma auto's shape choices replayed offline, to tune the estimator without timing runs.

Greedy verification makes a run's tokens those of plain decoding, and the n-gram
drafter's proposal depends only on the committed tokens, so what each round
would draft, and how many of its drafts the target would accept, is known from
one plain run per prompt. This script makes those plain runs, computes the
drafter's proposal at every committed length (the real `NgramDrafter`, on
device), and runs the shape policy's own functions (`engine.shape`:
`choose_draft`, `choose_verify`, `update`) round by round at batch 1, pricing
each round with this device's calibrated costs (`engine.calibrated_costs`,
the cache a run at that capacity uses). Per category it writes the policy's
predicted speedup (plain rounds over priced rounds) and the verify widths
chosen, for each estimator setting of `--grid`. Tune on the training split
(`--split train`, the default), check on the held-out questions; with
`--bench REPORT` (a batch-1 auto bench of the same prompts and settings) the
bench's widths are kept beside the replay's, which checks that the replay is
the run.

    python experiments/policy_replay.py --grid prior=0.3,0.5,0.7 learn=0.25,0.5 relax=0.003,0.01
    python experiments/policy_replay.py --split heldout --per-category 1 --grid prior=0.7 \
        --bench experiments/results/auto_shape/rounds/bench_ngram_b1_gauto.json
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from common import markdown_table, save  # noqa: E402
from eagle_recipe import HEAD_CONFIGS  # noqa: E402
from tqdm import tqdm  # noqa: E402

from specdec_jax import engine  # noqa: E402
from specdec_jax.config import RunConfig  # noqa: E402
from specdec_jax.data import spec_bench_questions  # noqa: E402
from specdec_jax.distill.config import train_config  # noqa: E402
from specdec_jax.distill.data import split_questions  # noqa: E402
from specdec_jax.drafters.base import DraftContext  # noqa: E402
from specdec_jax.engine import ShapePolicy, shape  # noqa: E402
from specdec_jax.models import load_model  # noqa: E402
from specdec_jax.runner import build_drafter, encode, stop_ids  # noqa: E402

RESULTS = pathlib.Path(__file__).parent / "results" / "policy_replay"


def proposals(drafter, sequence: list[int], prompt_len: int, gamma: int) -> tuple[np.ndarray, np.ndarray]:
    """(found i32[J], accepted i32[J]) at each of the J generated positions: the drafts the drafter
    proposes with prompt_len + j tokens committed, and how many of them lead the plain output."""
    tokens = np.asarray(sequence, np.int32)
    steps = len(sequence) - prompt_len
    lengths = jnp.asarray(prompt_len + np.arange(steps), jnp.int32)
    buffer = jnp.broadcast_to(jnp.asarray(np.pad(tokens, (0, gamma + 1))), (steps, len(tokens) + gamma + 1))
    ctx = DraftContext(tokens=buffer, num_tokens=lengths, prompt_lens=jnp.full((steps,), prompt_len), room=None,
                       last_emit=None, last_accepted=None, features=None, keys=None, sampling=None,
                       target_params=None, target=None)
    proposal, _ = drafter.propose(None, None, ctx, gamma)
    drafts, found = np.asarray(proposal.drafts), np.asarray(proposal.num_draft)
    accepted = np.zeros(steps, np.int32)
    for j in range(steps):
        truth = tokens[prompt_len + j : prompt_len + j + found[j]]
        match = drafts[j, : len(truth)] == truth
        accepted[j] = len(truth) if match.all() else int(np.argmin(match))
    return found, accepted


@functools.partial(jax.jit, static_argnums=0)
def _round(policy: ShapePolicy, acceptance, found, accepted, room):
    """One batch-1 round as `engine.round.draft_step` takes it: the draft choice (a free drafter
    always drafts G; a chain's first g drafts are its G-draft proposal's), the verify choice, the
    drafts verified and accepted, the new estimates."""
    live, gammas = jnp.ones((1,), bool), jnp.asarray(policy.gammas)
    drafted = jnp.asarray(len(policy.gammas) - 1) if policy.free_drafts else shape.choose_draft(
        policy, acceptance, live, room)
    found = jnp.minimum(jnp.minimum(found, room), gammas[drafted])
    chosen = shape.choose_verify(policy, acceptance, live, found, drafted)
    verified = jnp.minimum(found, gammas[chosen])
    accepted = jnp.minimum(accepted, verified)
    return drafted, chosen, accepted, shape.update(policy, acceptance, live, verified, accepted)


def replay(policy: ShapePolicy, found: np.ndarray, accepted: np.ndarray) -> tuple[float, list[int]]:
    """(priced rounds in units of T1, rounds per verify shape) of one prompt's generation."""
    steps, j, cost = len(found), 0, 0.0
    widths = [0] * len(policy.gammas)
    acceptance = policy.initial(1)
    while j < steps:
        room = jnp.asarray([steps - j - 1], jnp.int32)
        drafted, chosen, n, acceptance = _round(policy, acceptance, jnp.asarray(found[j : j + 1]),
                                                jnp.asarray(accepted[j : j + 1]), room)
        chosen = int(chosen)
        widths[chosen] += 1
        cost += policy.verify_cost[chosen] + policy.draft_cost[int(drafted)]
        j += int(n[0]) + 1
    return cost, widths


def parse_grid(items: list[str]) -> list[dict]:
    """["prior=0.3,0.5", "learn=0.25"] -> every combination as ShapePolicy keyword arguments."""
    axes = {}
    for item in items:
        name, _, values = item.partition("=")
        if name not in ("prior", "learn", "relax", "follow") or not values:
            raise SystemExit(f"--grid takes name=v1,v2 with name in prior/learn/relax/follow, got {item!r}")
        axes[name] = [float(v) for v in values.split(",")]
    return [dict(zip(axes, combo)) for combo in itertools.product(*axes.values())] or [{}]


def questions(split: str, per_category: int) -> list[dict]:
    """The first `per_category` questions of each category of the heads' training or held-out split
    (`experiments/eagle_recipe.py`), as prompt records."""
    tc = train_config(HEAD_CONFIGS["eagle"])
    train, held = split_questions(spec_bench_questions(tc.prompts_file), tc.heldout_per_category)
    seen: dict[str, int] = {}
    records = []
    for q in train if split == "train" else held:
        if seen.setdefault(q["category"], 0) < per_category:
            seen[q["category"]] += 1
            records.append({"id": q["question_id"], "category": q["category"], "prompt": q["turns"][0]})
    return records


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--grid", nargs="*", default=["prior=0.3,0.5,0.7", "learn=0.25,0.5", "relax=0.003,0.01"])
    parser.add_argument("--split", choices=("train", "heldout"), default="train",
                        help="tune on training-split questions; check on the held-out ones")
    parser.add_argument("--per-category", type=int, default=2)
    parser.add_argument("--bench", type=pathlib.Path, default=None,
                        help="a batch-1 auto bench report of the same prompts: its verify widths are printed "
                             "beside the replay's (they agree when the replay is exact)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--out", type=pathlib.Path, default=RESULTS)
    args = parser.parse_args(argv)
    cfg = RunConfig(max_new_tokens=args.max_new_tokens)
    target = load_model(cfg.model)
    tok = target.tokenizer
    drafter = build_drafter(cfg, target)
    records = questions(args.split, args.per_category)
    bench_widths = {}
    if args.bench:
        bench_widths = {str(b["ids"][0]): b["width_rounds"] for b in json.loads(args.bench.read_text())["batches"]}
    gamma, tables, costs = max(engine.AUTO_GAMMAS), {}, {}
    for r in tqdm(records, desc="plain runs", unit="prompt"):  # one at a time: a batch pads every prompt
        p = encode(tok, r["prompt"], cfg.raw)
        out = engine.generate(target, [p], None, gamma=0, max_new_tokens=cfg.max_new_tokens,
                              stop_ids=stop_ids(cfg, tok)).tokens[0]
        tables[r["id"]] = proposals(drafter, p + out, len(p), gamma)
        capacity = engine.default_capacity(len(p), cfg.max_new_tokens, gamma)
        costs[r["id"]] = engine.calibrated_costs(target, drafter, 1, capacity)
    rows, results = [], []
    for setting in parse_grid(args.grid):
        per_category: dict[str, dict] = {}
        for r in records:
            cost, widths = replay(engine.policy_from_costs(costs[r["id"]], **setting), *tables[r["id"]])
            entry = per_category.setdefault(r["category"], {"plain": 0, "cost": 0.0, "widths": [], "bench": []})
            entry["plain"] += len(tables[r["id"]][0])
            entry["cost"] += cost
            entry["widths"].append(widths)
            entry["bench"].append(bench_widths.get(str(r["id"])))
        for entry in per_category.values():
            entry["speedup"] = entry["plain"] / entry["cost"]
        overall = sum(e["plain"] for e in per_category.values()) / sum(e["cost"] for e in per_category.values())
        worst = min(per_category, key=lambda c: per_category[c]["speedup"])
        results.append({"setting": setting, "overall": overall, "categories": per_category})
        rows.append([json.dumps(setting), overall, worst, per_category[worst]["speedup"]]
                    + [per_category[c]["speedup"] for c in sorted(per_category)])
    header = ["setting", "overall", "worst", "worst speedup"] + sorted(per_category)
    save(args.out / args.split, {"split": args.split, "records": [r["id"] for r in records], "results": results},
         markdown_table(header, rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
