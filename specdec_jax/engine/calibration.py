"""The costs the shape policy decides with, measured on the running device (DESIGN sections 8 and 11).

`measure_costs` times, on the shapes of a batch (batch size, KV capacity, the
drafter's hidden layers), one target pass at each verify width g + 1 and the
drafter's whole proposal of g tokens, for each g of `gammas`, the way the loop
runs them: each jitted piece donates its caches (or the whole state), fed back
from call to call, so no timing includes a copy. `shape_policy` turns them into
a `engine.shape.ShapePolicy` (costs in units of T1) and caches them on disk,
one JSON file per device, target, drafter, batch, capacity (rounded up to a
power of two: attention over the slots is a small part of a step) and gammas,
under `$SPECDEC_CACHE/calibration/`; `refresh=True` measures again.

Measuring takes a few seconds plus one compile per shape; the cache makes the
next run free.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from specdec_jax.engine.shape import ShapePolicy
from specdec_jax.target import chain_positions, resolve_target

AUTO_GAMMAS = (0, 1, 2, 4)  # the shapes `gamma="auto"` compiles: widths 1, 2, 3, 5
AUTO_TREE_SIZES = (1, 2, 4, 8, 16)  # node counts `gamma="auto"` verifies of a tree drafter's nodes (below N)


def tree_sizes(nodes: int) -> tuple[int, ...]:
    """The node counts a shape policy chooses among for a tree of ``nodes`` nodes: 0 (plain
    decoding), the `AUTO_TREE_SIZES` below ``nodes``, and ``nodes``."""
    return tuple(sorted({0, nodes, *(n for n in AUTO_TREE_SIZES if n < nodes)}))


def auto_shapes(drafter) -> tuple[tuple[int, ...], bool]:
    """``(gammas, tree)`` that gamma "auto" chooses among for ``drafter``: `AUTO_GAMMAS` for a chain,
    `tree_sizes` of its node count for a tree drafter (tree True)."""
    shape = getattr(drafter, "tree", None)
    return (AUTO_GAMMAS, False) if shape is None else (tree_sizes(shape.nodes), True)
CALIBRATION_PROMPT = 64  # tokens per row of the timed batch


def median_time_fed_back(step, carry, repeats: int = 7) -> float:
    """Median seconds of ``carry = step(carry)`` after one warm-up call. ``step`` donates its carry
    (the caches), which is fed back between calls, as the loop runs them: nothing is copied."""
    carry = jax.block_until_ready(step(carry))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        carry = jax.block_until_ready(step(carry))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def time_target_pass(run, width: int, repeats: int = 7) -> float:
    """Seconds of one target pass of ``width`` tokens per row of ``run`` (an `engine.Prepared`): a
    verify pass at that width as the loop runs it (reading the cache, then writing its block),
    with the hidden states the drafter reads, its cache donated and fed back, its logits reduced
    on device to the argmax (the loop never returns logits either)."""
    spec = run.spec

    @functools.partial(jax.jit, donate_argnums=1)
    def step(params, carry):
        cache = carry[0]
        tokens = jnp.ones((cache.lengths.shape[0], width), jnp.int32)
        logits, _, block = spec.target.apply(params, tokens, cache, chain_positions(cache.lengths, width), None,
                                             spec.hidden_layers, defer_writes=True)
        return cache.write_block(block), jnp.argmax(logits, axis=-1)

    batch = run.state.cache.lengths.shape[0]
    carry = (jax.tree.map(jnp.copy, run.state.cache), jnp.zeros((batch, width), jnp.int32))
    return median_time_fed_back(lambda c: step(run.params.target, c), carry, repeats)


def time_draft_step(run, gamma: int | None = None, repeats: int = 7) -> float:
    """Seconds of one `draft_step` at a fixed ``gamma`` (default the run's; at most its gamma): the
    drafter's whole proposal, a copy of the loop state donated and fed back. gamma 0 times the
    round of a shape policy that does not speculate (the drafter keeping its state in step)."""
    from specdec_jax.engine.round import draft_step

    gamma = run.spec.gamma if gamma is None else gamma
    spec = dataclasses.replace(run.spec, gamma=gamma, policy=None)
    state = jax.tree.map(jnp.copy, run.state)
    if gamma == 0:  # a policy whose only other shape costs too much to be chosen
        never = ShapePolicy((0, run.spec.gamma), (1.0, 1e9), (0.0, 1e9))
        spec = dataclasses.replace(run.spec, policy=never)
        state = state.replace(acceptance=jnp.zeros(state.proposal.drafts.shape, jnp.float32))
    step = jax.jit(functools.partial(draft_step, spec), donate_argnums=1)
    return median_time_fed_back(lambda state: step(run.params, state), state, repeats)


def measure_costs(target, drafter, batch: int, capacity: int, gammas=AUTO_GAMMAS, tree: bool = False) -> dict:
    """Seconds of T1, of the verify pass at g + 1 and of drafting g tokens for each g of gammas, on a
    batch of `batch` rows of CALIBRATION_PROMPT tokens at KV capacity `capacity`. A tree (``tree``:
    gammas are node counts) is drafted whole or not at all (`engine.shape`): each g > 0 costs
    drafting the whole tree."""
    from specdec_jax.engine.batching import prepare

    model, _ = resolve_target(target)
    rng = np.random.default_rng(0)
    length = max(2, min(CALIBRATION_PROMPT, capacity - max(gammas) - 2))
    prompts = rng.integers(0, model.vocab_size, (batch, length)).tolist()
    run = prepare(target, prompts, drafter, gamma=max(gammas), max_new_tokens=1, capacity=capacity)
    verify = [time_target_pass(run, g + 1) for g in gammas]
    if tree:
        whole = time_draft_step(run, max(gammas))
        draft = [time_draft_step(run, 0)] + [whole] * (len(gammas) - 1)
    else:
        draft = [time_draft_step(run, g) for g in gammas]
    return {"T1": verify[0], "verify_s": verify, "draft_s": draft, "gammas": list(gammas)}


def shape_policy(target, drafter, batch: int, capacity: int, gammas=None, refresh: bool = False,
                 **estimator) -> ShapePolicy:
    """The `ShapePolicy` of `gammas` (default `auto_shapes`; for a tree drafter, node counts) with
    costs measured on this device (read from the disk cache unless `refresh`); `estimator`:
    ShapePolicy's prior / learn / relax / follow."""
    from specdec_jax.models.fetch import cache_dir

    default, tree = auto_shapes(drafter)
    gammas = tuple(sorted({0, *map(int, default if gammas is None else gammas)}))
    capacity = 1 << (capacity - 1).bit_length()  # one calibration per power-of-two capacity
    key = calibration_key(target, drafter, batch, capacity, gammas)
    path = cache_dir() / "calibration" / f"{hashlib.sha256(key.encode()).hexdigest()[:20]}.json"
    costs = None
    if path.is_file() and not refresh:
        saved = json.loads(path.read_text())
        costs = saved["costs"] if saved.get("key") == key else None
    if costs is None:
        print(f"calibrating shapes {list(gammas)} on {jax.devices()[0].device_kind} (batch {batch}, capacity "
              f"{capacity}; cached in {path.parent})", flush=True)
        costs = measure_costs(target, drafter, batch, capacity, gammas, tree)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"key": key, "costs": costs}, indent=1))
        tmp.replace(path)
    return policy_from_costs(costs, tree=tree, **estimator)


def policy_from_costs(costs: dict, **estimator) -> ShapePolicy:
    """A ShapePolicy from `measure_costs`'s seconds (normalised by T1), each made non-decreasing in
    the shape: a wider pass or a longer proposal never costs less, and a timing that says so is
    noise (seen here: a 3-token pass timed at 1.02 T1 beside a 2-token one at 1.14 T1, on a shared
    machine), which would make the policy verify more drafts than pay."""
    t1 = costs["T1"]
    monotone = lambda seconds: tuple(np.maximum.accumulate(np.asarray(seconds, float) / t1).tolist())  # noqa: E731
    return ShapePolicy(tuple(costs["gammas"]), monotone(costs["verify_s"]), monotone(costs["draft_s"]), **estimator)


def calibration_key(target, drafter, batch: int, capacity: int, gammas) -> str:
    """What the costs depend on: device, target architecture, drafter, batch, capacity, gammas."""
    model, _ = resolve_target(target)
    device = jax.devices()[0]
    return json.dumps({"device": f"{device.platform}:{device.device_kind}:{jax.device_count()}",
                       "jax": jax.__version__, "target": repr(model), "drafter": repr(drafter), "batch": batch,
                       "capacity": capacity, "gammas": list(gammas)})
