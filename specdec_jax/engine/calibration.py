"""The costs the shape policy decides with, measured on the running device (docs/design.md sections 8 and 11).

`measure_costs` times whole rounds of the shape policy's own program, each at
one forced shape (`DecodeState.forced_shape`), on the shapes of a batch (batch
size, KV capacity, the drafter's hidden layers), and splits each round's seconds
into the drafter's proposal and the rest (target pass, law, acceptance, commit).
It times them the way the loop runs them: several rounds in a loop per timed
call, each call donating its state, so no timing includes a copy, and one
program (the forced shape is loop state) serves every shape. `calibrated_costs`
caches the costs on disk, one JSON file per device, target, drafter, batch,
capacity (the run's own: at a large batch every pass reads the whole cache, so
a width's cost in T1 depends on the capacity; docs/shape_policy.md) and gammas, under
`$SPECDEC_CACHE/calibration/` (`refresh=True` measures again), and
`shape_policy` turns them into a `engine.shape.ShapePolicy` (units of T1, one
plain round).

`time_target_pass` and `time_draft_step` time the pieces alone (`bench`'s cost
model for a fixed gamma). Measuring is mostly a compile per draft length and
one for the rounds (docs/shape_policy.md has its time); the cache makes the
next run free.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import json
import math
import time

import jax
import jax.numpy as jnp
import numpy as np

from specdec_jax import cache
from specdec_jax.cache import cache_dir
from specdec_jax.engine.batching import prepare
from specdec_jax.engine.request import GenerateRequest
from specdec_jax.engine.round import decode_round, draft_step
from specdec_jax.engine.shape import AUTO_GAMMAS, FREE_DRAFTS, ShapePolicy, auto_shapes
from specdec_jax.files import write_text_atomic
from specdec_jax.kv_cache import ordered_read
from specdec_jax.sampling import first_argmax
from specdec_jax.sharding import same_on_every_process
from specdec_jax.target import chain_positions, resolve_target


CALIBRATION_PROMPT = 64  # tokens per row of the timed batch
CALIBRATION_ROUNDS = 8  # rounds per timed call of `time_rounds` (fewer where the capacity has no room)
# Timed calls of each shape unless a caller gives its own count: REPEATS, or fewer (never under MIN_REPEATS) once the
# calls of one measurement have taken BUDGET_S seconds. The Qwen2.5-Coder 1.5B / 0.5B pair's rounds at 5 shapes take
# 14 s a repeat on a 2-core CPU; a target of several billion parameters would spend minutes on 7 (docs/shape_policy.md).
REPEATS, MIN_REPEATS, BUDGET_S = 7, 3, 60.0


def fed_back(step, carry):
    """A call for `least_in_turn`: one timed ``carry = step(carry)``, its result fed to the next call (``step``
    donates its carry, the caches, as the loop does: nothing is copied). Compiles and warms up first,
    untimed."""
    carry = jax.block_until_ready(step(carry))

    def call():
        nonlocal carry
        start = time.perf_counter()
        carry = jax.block_until_ready(step(carry))
        return time.perf_counter() - start

    return call


def least_in_turn(calls, repeats: int | None = None) -> list[float]:
    """The least seconds of each of ``calls`` (functions that each time one call and return its seconds;
    least: a shared machine's memory bandwidth drops for seconds at a time, docs/shape_policy.md),
    called in turn, one call of each per repeat, so that a change in the machine's load reaches all of
    them alike: ``repeats`` times; None: REPEATS times, or fewer, but at least MIN_REPEATS, once the
    calls have taken BUDGET_S seconds in all."""
    times = [[] for _ in calls]
    spent = 0.0
    for repeat in range(REPEATS if repeats is None else repeats):
        if repeats is None and repeat >= MIN_REPEATS and spent >= BUDGET_S:
            break
        for call, samples in zip(calls, times):
            samples.append(call())
            spent += samples[-1]
    return [min(t) for t in times]


def target_pass_step(spec, width: int):
    """``(target params, (cache, tokens i32[B,width])) -> (cache, tokens)``: one target pass of ``width``
    tokens per row of ``spec``'s target as the loop runs it (reading the cache in a conditional, then
    writing its block), with the hidden states the drafter reads, its logits reduced on device to the
    greedy tokens it returns (the loop never returns logits either). Not jitted: a caller loops it."""
    def step(params, carry):
        def read(cache):
            tokens = jnp.ones((cache.lengths.shape[0], width), jnp.int32)
            logits, _, block = spec.target.apply(params, tokens, cache, chain_positions(cache.lengths, width), None,
                                                 spec.hidden_layers, defer_writes=True)
            return first_argmax(logits), block

        cache = carry[0]
        top, block = ordered_read(read, cache)
        return cache.write_block(block), top

    return step


def time_target_pass(run, width: int, repeats: int | None = None) -> float:
    """Seconds of one target pass of ``width`` tokens per row of ``run`` (an `engine.Prepared`):
    `target_pass_step`, its cache donated and fed back (`fed_back`)."""
    step = jax.jit(target_pass_step(run.spec, width), donate_argnums=1)
    batch = run.state.cache.lengths.shape[0]
    carry = (jax.tree.map(jnp.copy, run.state.cache), jnp.zeros((batch, width), jnp.int32))
    return least_in_turn([fed_back(lambda c: step(run.params.target, c), carry)], repeats)[0]


def time_draft_step(run, gamma: int | None = None, repeats: int | None = None) -> float:
    """Seconds of one `draft_step` at a fixed ``gamma`` (default the run's; at most its gamma): the
    drafter's whole proposal, a copy of the loop state donated and fed back. gamma 0 times the
    round of a shape policy that does not speculate (the drafter keeping its state in step, or
    letting it fall behind)."""
    return time_draft_steps(run, [run.spec.gamma if gamma is None else gamma], repeats)[0]


def time_draft_steps(run, gammas, repeats: int | None = None) -> list[float]:
    """`time_draft_step` at each of ``gammas``, timed in turn (one call of each per repeat), so that a
    change in the machine's load reaches all of them alike (timed one after another they can be priced
    out of order: docs/shape_policy.md); the least time of each (`least_in_turn`)."""
    calls = []
    for gamma in gammas:
        spec = dataclasses.replace(run.spec, gamma=gamma, policy=None)
        state = jax.tree.map(jnp.copy, run.state)
        if gamma == 0:  # a policy whose only other shape costs too much to be chosen
            never = ShapePolicy((0, run.spec.gamma), (1.0, 1e9), (0.0, 1e9))
            spec = dataclasses.replace(run.spec, policy=never)
            state = state.replace(acceptance=jnp.zeros(state.proposal.drafts.shape, jnp.float32))
        step = jax.jit(functools.partial(draft_step, spec), donate_argnums=1)
        calls.append(fed_back(functools.partial(step, run.params), state))  # every length compiled before timing
    return least_in_turn(calls, repeats)


def loop_of_rounds(run, rounds: int):
    """A jitted ``(params, state) -> state``: ``rounds`` rounds of ``run``'s program in a `fori_loop`, the
    state donated, as the decoding loop runs them."""
    return jax.jit(lambda params, state: jax.lax.fori_loop(
        0, rounds, lambda _, s: decode_round(run.spec, params, s), state), donate_argnums=1)


def time_rounds(run, shapes, repeats: int | None = None, rounds: int = 1) -> list[float]:
    """The least seconds of one whole round (`draft_step` then `verify_step`) of ``run``'s batch (prepared
    with a shape policy) at each forced shape of ``shapes``, (draft index, verify index)
    pairs (`DecodeState.forced_shape`: every live row verifies that many drafts, found or not).
    Each timed call runs ``rounds`` rounds in a loop, as the decoding loop runs them (a round
    called alone costs more, and not alike at every width: docs/shape_policy.md), and its time is
    divided by ``rounds``; the state needs room for them. One program serves every shape; every
    timed call starts from a copy of the post-prefill state (copied before the clock starts) and
    donates it; the shapes are timed in turn, so a change in the machine's load reaches all of
    them alike."""
    policy = run.spec.policy
    options = range(len(policy.gammas)) if not policy.tree else (0, len(policy.gammas) - 1)
    for d, v in shapes:
        if d not in options or not 0 <= v <= (d if not policy.tree else len(policy.gammas) - 1):
            raise ValueError(f"forced shape ({d}, {v}) is not a round the policy over {policy.gammas} can run")
    step = loop_of_rounds(run, rounds)
    fresh = lambda d, v: jax.block_until_ready(
        jax.tree.map(jnp.copy, run.state.replace(forced_shape=jnp.array([d, v], jnp.int32))))
    jax.block_until_ready(step(run.params, fresh(0, 0)))  # compile and warm up

    def timed(d, v):
        def call():
            state = fresh(d, v)
            start = time.perf_counter()
            jax.block_until_ready(step(run.params, state))
            return time.perf_counter() - start
        return call

    return [t / rounds for t in least_in_turn([timed(d, v) for d, v in shapes], repeats)]


def measure_costs(target, drafter, batch: int, capacity: int, gammas=AUTO_GAMMAS, tree: bool = False,
                  repeats: int | None = None) -> dict:
    """Seconds of T1, of each shape's round past its drafting and of that drafting, on a batch of
    ``batch`` rows of (at most) CALIBRATION_PROMPT random tokens at KV capacity ``capacity``,
    rounds timed CALIBRATION_ROUNDS at a time in a loop (`time_rounds`):

    - draft_s[i]: the drafter's proposal of gammas[i] tokens (`time_draft_steps`, all timed in turn) less a draft step
      that proposes nothing (the jitted call's own overhead, which the loop does not pay and which
      could push a free drafter over FREE_DRAFTS: docs/shape_policy.md); a tree
      (``tree``: gammas are node counts, drafted whole or not at all) costs its whole drafting for
      every i > 0;
    - verify_s[i] = R(d_i, i) - draft_s[d_i]: a whole round of the shape policy's own program
      drafting gammas[d_i] and verifying gammas[i] (`time_rounds`), its drafting taken out, so
      the rest of the round (target pass in its `lax.switch`, law, acceptance, commit, the
      drafter's commit hook) is priced as the program runs it, not as a target pass alone.
      d_i = i for a chain, G for a tree; a free drafter (its proposal under FREE_DRAFTS of a
      target pass: the n-gram lookup) always drafts G, so its rounds are R(G, i);
    - T1 = verify_s[0], a plain decoding round.

    ``rounds`` keeps every R(d, v) measured, by "d,v".
    """
    model, _ = resolve_target(target)
    gammas, last = tuple(gammas), len(gammas) - 1
    policy = lambda free: ShapePolicy(gammas, (1.0,) * len(gammas), (0.0,) + (0.0 if free else 1.0,) * last,
                                      tree=tree)
    rng = np.random.default_rng(0)
    width = max(gammas) + 1  # tokens a round may emit
    loop = max(1, min(CALIBRATION_ROUNDS, (capacity - 16 - 2 * width) // width))
    length = max(2, min(CALIBRATION_PROMPT, capacity - loop * width - width - 1))
    prompts = rng.integers(0, model.vocab_size, (batch, length)).tolist()
    run = prepare(GenerateRequest(target, prompts, drafter, policy=policy(False),
                                  max_new_tokens=loop * width + width + 1, capacity=capacity))
    # Less a draft step that proposes nothing: the call's own overhead, which the loop does not pay.
    if tree:
        idle, whole = time_draft_steps(run, [0, max(gammas)])
        draft = [0.0] + [max(0.0, whole - idle)] * last
    else:
        idle, *timed = time_draft_steps(run, [0, *gammas[1:]])
        draft = [0.0] + [max(0.0, t - idle) for t in timed]
    # Decisions from timings are process 0's: every process of a multi-host run must run the same programs.
    free = same_on_every_process(draft[-1] <= FREE_DRAFTS * time_target_pass(run, 1))
    for _ in range(2):  # again under the other program if the policy's own test (by T1) says otherwise
        run = dataclasses.replace(run, spec=dataclasses.replace(run.spec, policy=policy(free)))
        pairs = [(last, v) for v in range(last + 1)] if free else (
            [(0, 0)] + [(last if tree else v, v) for v in range(1, last + 1)])
        rounds = time_rounds(run, pairs, repeats, rounds=loop)
        verify = [t - draft[d] for (d, _), t in zip(pairs, rounds)]
        if same_on_every_process(free == (draft[-1] <= FREE_DRAFTS * verify[0])):
            break
        free = not free
    return {"T1": verify[0], "verify_s": verify, "draft_s": draft, "gammas": list(gammas),
            "rounds": {f"{d},{v}": t for (d, v), t in zip(pairs, rounds)}}


def calibrated_costs(target, drafter, batch: int, capacity: int, gammas=None, refresh: bool = False) -> dict:
    """`measure_costs` of `gammas` (default `auto_shapes`; for a tree drafter, node counts), read
    from the disk cache unless `refresh` (or measured and cached); adds ``tree`` and ``drafter_prior``
    (the drafter's `acceptance_prior`, None where it names none): what `policy_from_costs` needs
    beside the seconds. Process 0 holds the entry's lock (`cache.locked`) from reading to writing:
    another run waits for these costs rather than measuring beside them (the other processes of this
    run measure with it, unlocked)."""
    default, tree = auto_shapes(drafter)
    gammas = tuple(sorted({0, *map(int, default if gammas is None else gammas)}))
    key = calibration_key(target, drafter, batch, capacity, gammas)
    path = cache_dir() / "calibration" / f"{hashlib.sha256(key.encode()).hexdigest()[:20]}.json"
    first = jax.process_index() == 0
    with cache.locked(path, f"the calibration in {path}") if first else contextlib.nullcontext():
        costs = _read_costs(path, key, gammas) if path.is_file() and not refresh else None
        # A multi-host run takes process 0's costs (cached or measured): one policy, one program everywhere.
        costs = same_on_every_process(costs)
        if costs is None:
            print(f"calibrating shapes {list(gammas)} on {jax.devices()[0].device_kind} (batch {batch}, capacity "
                  f"{capacity}; cached in {path.parent})", flush=True)
            costs = same_on_every_process(measure_costs(target, drafter, batch, capacity, gammas, tree))
            if first:
                write_text_atomic(path, json.dumps({"key": key, "costs": costs}, indent=1))
    return {**costs, "tree": tree, "drafter_prior": getattr(drafter, "acceptance_prior", None)}


def _read_costs(path, key: str, gammas) -> dict | None:
    """The costs cached in ``path`` for ``key``; None (measure again) when it holds another key, and when it
    is unreadable or holds a cost that is not a finite positive number (NaN would turn speculation off),
    which is said in one line."""
    try:
        saved = json.loads(path.read_text())
        if saved.get("key") != key:
            return None
        costs = saved["costs"]
        numbers = [costs["T1"], *costs["verify_s"], *costs["draft_s"]]
        if len(costs["verify_s"]) != len(gammas) or len(costs["draft_s"]) != len(gammas):
            raise ValueError(f"{len(costs['verify_s'])} costs for {len(gammas)} shapes")
        if not all(isinstance(x, (int, float)) and math.isfinite(x) and x >= 0 for x in numbers) or costs["T1"] <= 0:
            raise ValueError("a cost that is not a finite number >= 0")
        return costs
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
        print(f"{path}: a corrupt calibration ({err.__class__.__name__}: {err}); measuring again", flush=True)
        return None


def shape_policy(target, drafter, batch: int, capacity: int, gammas=None, refresh: bool = False,
                 **estimator) -> ShapePolicy:
    """The `ShapePolicy` of `calibrated_costs` (this device's, cached on disk); `estimator`:
    ShapePolicy's prior / learn / relax / follow."""
    return policy_from_costs(calibrated_costs(target, drafter, batch, capacity, gammas, refresh), **estimator)


def policy_from_costs(costs: dict, **estimator) -> ShapePolicy:
    """A ShapePolicy from `measure_costs`'s seconds, normalised by T1. A wider shape may cost less
    than a narrower one (docs/design.md section 8) and is then kept so: the narrower shape is never
    the better choice and the policy skips it. No verify shape is priced under one plain round,
    which a draft timing measured apart from its round could otherwise imply. ``tree`` and
    ``drafter_prior`` come from `calibrated_costs`'s entries of those names where ``estimator`` does
    not name them."""
    t1 = costs["T1"]
    verify = tuple(np.maximum(np.asarray(costs["verify_s"], float) / t1, 1.0).tolist())
    draft = tuple(np.maximum(np.asarray(costs["draft_s"], float) / t1, 0.0).tolist())
    fields = {"tree": costs.get("tree", False), "drafter_prior": costs.get("drafter_prior"), **estimator}
    return ShapePolicy(tuple(costs["gammas"]), verify, draft, **fields)


# How costs are measured, and the revision of the forward pass they were measured on: changing
# either makes every cached calibration stale.
METHOD = ("rounds in a loop, drafting less an idle step, draft lengths timed in turn; forward pass r3 (layer "
          "matrices [out, in]); greedy rounds reduce logits inside the width branch; the run's capacity; a "
          "drafter's cache written after the per-size switch; least of the repeats")


def calibration_key(target, drafter, batch: int, capacity: int, gammas) -> str:
    """What the costs depend on: how they are measured, device, target architecture, drafter, batch,
    capacity, gammas."""
    model, _ = resolve_target(target)
    device = jax.devices()[0]
    return json.dumps({"method": METHOD,
                       "device": f"{device.platform}:{device.device_kind}:{jax.device_count()}",
                       "jax": jax.__version__, "target": repr(model), "drafter": repr(drafter), "batch": batch,
                       "capacity": capacity, "gammas": list(gammas)})
