"""Issue 17: gamma auto's shape choices replayed offline, to tune the estimator without timing runs.

Greedy verification makes a run's tokens those of plain decoding, and the n-gram
drafter's proposal depends only on the committed tokens, so what each round
would draft, and how many of its drafts the target would accept, is known from
one plain run per prompt. This script takes those plain outputs, computes the
drafter's proposal at every committed length (the real `NgramDrafter`, on
device), and runs the shape policy's own functions (`engine.shape`:
`choose_verify`, `update`) round by round at batch 1, pricing each round with
the calibrated costs a bench report recorded (`T_by_width`, `D_by_width` of
`experiments/auto_shape.py`'s batch-1 auto bench). Its output per category is
the policy's predicted speedup (plain rounds over priced rounds) and the
verify widths it chose, for each estimator setting of `--grid`: with the
report's own setting the widths equal the bench's, which checks the replay.

    python experiments/policy_replay.py
    python experiments/policy_replay.py --grid prior=0.3,0.5,0.7 learn=0.25,0.5 relax=0.003,0.01
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import pathlib
import sys
import tempfile

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from common import markdown_table, save  # noqa: E402
from eagle_recipe import heldout_prompts_file  # noqa: E402

from specdec_jax import engine  # noqa: E402
from specdec_jax.config import RunConfig  # noqa: E402
from specdec_jax.data import load_prompts_file  # noqa: E402
from specdec_jax.drafters.base import DraftContext  # noqa: E402
from specdec_jax.engine import ShapePolicy, shape  # noqa: E402
from specdec_jax.models import load_model  # noqa: E402
from specdec_jax.runner import build_drafter, encode, stop_ids  # noqa: E402

RESULTS = pathlib.Path(__file__).parent / "results" / "policy_replay"
BENCH = pathlib.Path(__file__).parent / "results" / "auto_shape" / "rounds" / "bench_ngram_b1_gauto.json"


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


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--grid", nargs="*", default=["prior=0.3,0.5,0.7", "learn=0.25,0.5", "relax=0.003,0.01"])
    parser.add_argument("--bench", type=pathlib.Path, default=BENCH, help="a batch-1 auto bench report (costs)")
    parser.add_argument("--out", type=pathlib.Path, default=RESULTS)
    args = parser.parse_args(argv)
    report = json.loads(args.bench.read_text())
    costs = {str(b["ids"][0]): b for b in report["batches"]}
    cfg = RunConfig(**{k: report["config"][k] for k in ("ngram_min", "ngram_max", "max_new_tokens")})
    target = load_model(cfg.model)
    tok = target.tokenizer
    drafter = build_drafter(cfg, target)
    with tempfile.TemporaryDirectory() as folder:
        records = [r for r in load_prompts_file(heldout_prompts_file(pathlib.Path(folder))) if str(r["id"]) in costs]
    prompts = [encode(tok, r["prompt"], cfg.raw) for r in records]
    gamma, tables = max(engine.AUTO_GAMMAS), {}
    for r, p in zip(records, prompts):  # one at a time: a batch would pad every prompt to the longest
        out = engine.generate(target, [p], None, gamma=0, max_new_tokens=cfg.max_new_tokens,
                              stop_ids=stop_ids(cfg, tok)).tokens[0]
        tables[str(r["id"])] = proposals(drafter, p + out, len(p), gamma)
    settings = parse_grid(args.grid)
    rows, results = [], []
    for setting in settings:
        per_category, total_plain, total_cost = {}, 0, 0.0
        for r in records:
            b = costs[str(r["id"])]
            t1 = b["T1"]
            policy = ShapePolicy(tuple(w - 1 for w in b["verify_widths"]), [max(t / t1, 1.0) for t in b["T_by_width"]],
                                 [d / t1 for d in b["D_by_width"]], **setting)
            found, accepted = tables[str(r["id"])]
            cost, widths = replay(policy, found, accepted)
            per_category[r["category"]] = {"speedup": len(found) / cost, "widths": widths,
                                           "bench_widths": b["width_rounds"]}
            total_plain, total_cost = total_plain + len(found), total_cost + cost
        worst = min(per_category, key=lambda c: per_category[c]["speedup"])
        results.append({"setting": setting, "overall": total_plain / total_cost, "categories": per_category})
        rows.append([json.dumps(setting), total_plain / total_cost, worst, per_category[worst]["speedup"]]
                    + [per_category[c]["speedup"] for c in sorted(per_category)])
    header = ["setting", "overall", "worst", "worst speedup"] + sorted(results[0]["categories"])
    save(args.out, {"bench": str(args.bench), "results": results}, markdown_table(header, rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
