"""`--gamma auto`'s shape choices replayed offline, to tune the policy's estimator without timing runs.

Makes the entry "Which prior should the shape policy start from?" of experiments/README.md, and the
`--gamma auto` table of "Should a draft model's chain stop at its first unconfident draft?".

Greedy verification makes a run's tokens those of plain decoding, and the n-gram
drafter's proposal depends only on the committed tokens, so what each round
would draft, and how many of its drafts the target would accept, is known from
one plain run per prompt. This script makes those plain runs, computes the
drafter's proposal at every committed length (the real `NgramDrafter`, on
device), and runs the shape policy's own functions (`engine.shape`:
`choose_draft`, `choose_verify`, `update`) round by round (batches of
each of `--batch-sizes` rows in file order, as `bench` makes them), pricing
each round with this device's calibrated costs (`engine.calibrated_costs`,
the cache a run at that capacity uses). Per batch it writes the policy's
predicted speedup (the longest row's plain rounds over the priced rounds) and
the verify widths chosen, for each estimator setting of `--grid` (and each fixed gamma of
`--fixed-gammas`, as a run at that gamma), to
experiments/results/policy_replay/<split>_b<batch>/ (results.json, table.md). Tune on the
training split (`--split train`, the default), check on the held-out questions; with
`--bench REPORT` (an auto bench of the same prompts and one batch size) the
bench's widths are kept beside the replay's, which checks that the replay is
the run.

    python experiments/policy_replay.py --batch-sizes 1 4 --max-prompt-tokens 1024 \\
        --grid prior=0.3,0.5,0.7 learn=0.25,0.5 relax=0.003,0.01
    python experiments/policy_replay.py --split heldout --per-category 1 --grid prior=0.5 \\
        --bench experiments/results/auto_shape/batch1/bench_ngram_b1_gauto.json

With `--draft-model` the drafter is that model drafting for `--model`: under greedy verification a
chain's accepted drafts are those the draft's greedy tokens get right in a row, known from one
teacher-forced pass of the draft over each prompt and plain output (`common.draft_guesses`; with
`--draft-confidence C` a chain stops after its first draft of confidence below C, as
`drafters.model.ModelDrafter.stop_below` does, and a round pays for the drafts it drew), and a
drafting round after plain rounds pays for the draft catching up (`--catch-up-cost` T1 per pass of
`drafters.model.CATCH_UP` tokens; `drafters.model`). `--rows-from` takes the prompts and plain
outputs of a bench report (e.g. experiments/qwen_pair.py's speed.json) instead of plain runs:

    python experiments/policy_replay.py --model qwen2.5-coder-1.5b --draft-model qwen2.5-coder-0.5b \\
        --draft-vocab 32768 --max-prompt-tokens 128 --per-category 1 --grid relax=0.01,0.03,0.1
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
from common import RESULTS, draft_guesses, markdown_table, prompt_record, recipe_questions, save
from tqdm import tqdm

from specdec_jax import engine
from specdec_jax.config import run_config
from specdec_jax.drafters.base import DraftContext
from specdec_jax.drafters.model import CATCH_UP, WINDOW
from specdec_jax.engine import ShapePolicy, shape
from specdec_jax.models import load_model
from specdec_jax.runner import build_drafter, encode, stop_ids


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
def _round(policy: ShapePolicy, acceptance, share, live, found, accepted, room):
    """One round as `engine.round.draft_step` takes it, rows [B]: the draft choice (a free drafter
    always drafts G; a chain's first g drafts are its G-draft proposal's), the verify choice, the
    drafts verified and accepted, the new estimates and shares of rounds with drafts found."""
    gammas = jnp.asarray(policy.gammas)
    weight = shape.row_weights(policy, acceptance, live, room, share)
    drafted = jnp.asarray(len(policy.gammas) - 1) if policy.free_drafts else shape.choose_draft(
        policy, acceptance, weight, room)
    found = jnp.where(live, jnp.minimum(jnp.minimum(found, room), gammas[drafted]), 0)
    share = shape.update_found(policy, share, live & (room > 0) & (drafted > 0), found)
    chosen = shape.choose_verify(policy, acceptance, weight, found, drafted)
    verified = jnp.minimum(found, gammas[chosen])
    accepted = jnp.minimum(accepted, verified)
    return drafted, chosen, accepted, shape.update(policy, acceptance, live, verified, accepted), share


def chain_tables(matches: list[bool], gamma: int, confidence: list[float] | None = None,
                 stop: float = 0.0) -> tuple[np.ndarray, np.ndarray]:
    """(found i32[J], accepted i32[J]) of a draft model's greedy chain at each of the J generated
    positions: it proposes gamma, or with ``stop`` (`--draft-confidence`) up to its first draft whose
    ``confidence`` is below it, and the target accepts them up to the first the draft gets wrong
    (``matches``, ``confidence``: `common.draft_guesses`)."""
    steps = len(matches)
    found, accepted = np.full(steps, gamma, np.int32), np.zeros(steps, np.int32)
    for j in range(steps):
        if stop:
            found[j] = next((k for k in range(1, gamma + 1) if j + k - 1 < steps and confidence[j + k - 1] < stop),
                            gamma)
        while accepted[j] < found[j] and j + accepted[j] < steps and matches[j + accepted[j]]:
            accepted[j] += 1
    return found, accepted


def replay(policy: ShapePolicy, rows: list[tuple[np.ndarray, np.ndarray]], max_new: int,
           batch: int, catch_up_cost: float = 0.0, stops: bool = False) -> tuple[float, list[int]]:
    """(priced rounds in units of T1, rounds per verify shape) of one batch's generation: rows of
    (found, accepted) tables, padded to the engine's ``batch`` with rows that are done. With
    ``catch_up_cost`` (T1 per pass), a drafting round first pays for the passes of `CATCH_UP` tokens
    that bring the rows' draft caches within `WINDOW` of their t0 (`drafters.model`). With ``stops``
    (chains that stop at an unconfident draft) a round pays for the drafts its longest chain drew, not
    for the size the policy chose (a fixed gamma's policy knows only its own size, and pays it)."""
    steps = np.zeros(batch, np.int64)
    steps[: len(rows)] = [len(found) for found, _ in rows]
    tables = np.zeros((2, batch, max_new + 1), np.int32)
    for b, table in enumerate(rows):
        tables[:, b, : len(table[0])] = table
    position, cost = np.zeros(batch, np.int64), 0.0
    widths = [0] * len(policy.gammas)
    acceptance, share = policy.initial(batch), jnp.ones(batch, jnp.float32)
    lacking = np.ones(batch, np.int64)  # tokens the draft cache lacks up to t0, t0 included
    while (position < steps).any():
        live = position < steps
        at = np.minimum(position, max_new)
        room = np.where(live, max_new - position - 1, 0)
        drafted, chosen, n, acceptance, share = _round(policy, acceptance, share, jnp.asarray(live),
                                                       jnp.asarray(tables[0, np.arange(batch), at]),
                                                       jnp.asarray(tables[1, np.arange(batch), at]),
                                                       jnp.asarray(room, jnp.int32))
        chosen, paid = int(chosen), int(drafted)
        widths[chosen] += 1
        if stops and paid > 0:  # the chains drew min(chosen size, found) drafts; the longest is paid
            drawn = np.minimum(tables[0, np.arange(batch), at], policy.gammas[paid])
            paid = int(np.searchsorted(policy.gammas, int(np.max(np.where(live, drawn, 0)))))
        cost += policy.verify_cost[chosen] + policy.draft_cost[paid]
        if int(drafted) > 0:
            cost += catch_up_cost * int(np.max(np.ceil(np.maximum(lacking[live] - WINDOW, 0) / CATCH_UP)))
        lacking = np.where(live, 2 if int(drafted) > 0 else lacking + 1, lacking)  # t0 and at most one draft
        position = np.where(live, position + np.asarray(n) + 1, position)
    return cost, widths


def parse_grid(items: list[str]) -> list[dict]:
    """["prior=0.3,0.5", "weigh_rows=1,0"] -> every combination as ShapePolicy keyword arguments."""
    axes = {}
    for item in items:
        name, _, values = item.partition("=")
        if name not in ("prior", "learn", "relax", "follow", "weigh_rows") or not values:
            raise SystemExit(f"--grid takes name=v1,v2 with name in prior/learn/relax/follow/weigh_rows, got {item!r}")
        axes[name] = [bool(int(v)) if name == "weigh_rows" else float(v) for v in values.split(",")]
    return [dict(zip(axes, combo)) for combo in itertools.product(*axes.values())] or [{}]


def setting_policy(costs: dict, setting: dict) -> ShapePolicy:
    """The policy a setting names: the calibrated one with those estimator constants, or with ``gamma`` (a
    `--fixed-gammas` entry) one that drafts and verifies that many every round, as a run at that fixed gamma."""
    if "gamma" not in setting:
        return engine.policy_from_costs(costs, **setting)
    at = costs["gammas"].index(setting["gamma"])
    fixed = {**costs, "gammas": [0, setting["gamma"]], "verify_s": [costs["verify_s"][0], costs["verify_s"][at]],
             "draft_s": [0.0, costs["draft_s"][at]]}
    return engine.policy_from_costs(fixed, prior=1.0, learn=0.0, relax=0.0, follow=0.0)


def batch_name(chunk: list[dict]) -> str:
    return "+".join(dict.fromkeys(r["category"] for r in chunk))


def plain_rows(args, cfg, target) -> tuple[list[dict], list[tuple]]:
    """(records, rows): the prompts to replay ({id, category}) and per prompt (id, category, prompt ids, plain
    output ids), from `--rows-from`'s bench report or from plain runs of the split's questions."""
    if args.rows_from:
        report = json.loads(args.rows_from.read_text())
        rows = [(i, c, p, o) for b in report["batches"]
                for i, c, p, o in zip(b["ids"], b["categories"], b["prompt_ids"], b["plain_outputs"])]
        return [{"id": i, "category": c} for i, c, _, _ in rows], rows
    tok = target.tokenizer
    records = [prompt_record(q) for q in recipe_questions(args.split, args.per_category,
                                                          max_prompt_tokens=args.max_prompt_tokens, tokenizer=tok)]
    rows = []
    for r in tqdm(records, desc="plain runs", unit="prompt"):  # one at a time: a batch pads every prompt
        p = encode(tok, r["prompt"], cfg.inputs.raw)
        rows.append((r["id"], r["category"], p, engine.generate(
            target, [p], None, gamma=0, max_new_tokens=cfg.inputs.max_new_tokens,
            stop_ids=stop_ids(cfg, tok)).tokens[0]))
    return records, rows


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--grid", nargs="*", default=["prior=0.3,0.5,0.7", "learn=0.25,0.5", "relax=0.003,0.01"])
    parser.add_argument("--fixed-gammas", type=int, nargs="*", default=[],
                        help="also replay these fixed gammas (of the calibrated shapes), beside the grid")
    parser.add_argument("--split", choices=("train", "heldout"), default="train",
                        help="tune on training-split questions; check on the held-out ones")
    parser.add_argument("--per-category", type=int, default=2)
    parser.add_argument("--batch-sizes", "--batch-size", type=int, nargs="+", default=[1], dest="batch_sizes",
                        help="rows per batch, in file order (as bench); one replay per batch size")
    parser.add_argument("--max-prompt-tokens", type=int, default=None, help="as experiments/auto_shape.py")
    parser.add_argument("--bench", type=pathlib.Path, default=None,
                        help="an auto bench report of the same prompts and batch size: its verify widths are kept "
                             "beside the replay's (they agree when the replay is exact)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--model", default=None, help="the target (default the project's default model)")
    parser.add_argument("--draft-model", default=None, help="a draft model instead of the n-gram drafter")
    parser.add_argument("--draft-vocab", type=int, default=0, help="the draft's output ids (0: all)")
    parser.add_argument("--draft-confidence", type=float, default=0.0,
                        help="the draft model's chains stop after a draft of confidence below this (0: never)")
    parser.add_argument("--catch-up-cost", type=float, default=0.47,
                        help="T1 per catch-up pass of the draft model (default: the Qwen pair's on a 2-core CPU, "
                             "about 1.6 of the 0.5B's 4-token pass)")
    parser.add_argument("--rows-from", type=pathlib.Path, default=None,
                        help="a bench report whose prompts and plain outputs to replay (no plain runs)")
    parser.add_argument("--out", type=pathlib.Path, default=RESULTS / "policy_replay")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    model_fields = {} if args.model is None else {"model": args.model}
    if args.draft_model:
        model_fields.update(drafter="draft-model", draft_model=args.draft_model, draft_vocab=args.draft_vocab)
    cfg = run_config(max_new_tokens=args.max_new_tokens, **model_fields)
    target = load_model(cfg.model)
    drafter = build_drafter(cfg, target)
    catch_up_cost = args.catch_up_cost if args.draft_model else 0.0
    records, rows = plain_rows(args, cfg, target)
    bench_widths = {}
    if args.bench:
        bench_widths = {tuple(map(str, b["ids"])): b["width_rounds"]
                        for b in json.loads(args.bench.read_text())["batches"]}
    gamma, tables, lengths = max(engine.AUTO_GAMMAS), {}, {}
    guesses = draft_guesses(args.draft_model, rows, args.draft_vocab) if args.draft_model else [None] * len(rows)
    for (qid, _, p, out), guess in zip(rows, guesses):
        tables[qid] = (chain_tables(guess[0], gamma, guess[1], args.draft_confidence) if args.draft_model
                       else proposals(drafter, p + out, len(p), gamma))
        lengths[qid] = len(p)
    for batch_size in args.batch_sizes:
        batches = [records[i : i + batch_size] for i in range(0, len(records), batch_size)]
        rows, results = [], []
        for setting in parse_grid(args.grid) + [{"gamma": g} for g in args.fixed_gammas]:
            per_batch = []
            for chunk in batches:
                size = 1 << (len(chunk) - 1).bit_length()
                longest_prompt = max(lengths[r["id"]] for r in chunk)
                capacity = engine.default_capacity(longest_prompt, cfg.inputs.max_new_tokens, gamma)
                costs = engine.calibrated_costs(target, drafter, size, capacity)
                cost, widths = replay(setting_policy(costs, setting), [tables[r["id"]] for r in chunk],
                                      cfg.inputs.max_new_tokens, size, catch_up_cost, args.draft_confidence > 0)
                longest = max(len(tables[r["id"]][0]) for r in chunk)
                per_batch.append({"ids": [r["id"] for r in chunk], "name": batch_name(chunk),
                                  "plain_rounds": longest, "cost": cost, "speedup": longest / cost, "widths": widths,
                                  "bench_widths": bench_widths.get(tuple(str(r["id"]) for r in chunk))})
            overall = sum(b["plain_rounds"] for b in per_batch) / sum(b["cost"] for b in per_batch)
            worst = min(per_batch, key=lambda b: b["speedup"])
            results.append({"setting": setting, "overall": overall, "batches": per_batch})
            rows.append([json.dumps(setting), overall, worst["name"], worst["speedup"]]
                        + [b["speedup"] for b in per_batch])
        header = ["setting", "overall", "worst", "worst speedup"] + [b["name"] for b in per_batch]
        payload = {"split": args.split, "batch_size": batch_size, "records": [r["id"] for r in records],
                   "results": results}
        save(args.out / f"{args.split}_b{batch_size}", payload, markdown_table(header, rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
