"""From a request to the loop's first state: validation, shape buckets, placement and prefill.

`prepare` checks every input before anything is compiled (one clear ValueError
each), pads the batch to a power of two (and to a multiple of the mesh's data
axis) and the prompts to a power-of-two bucket, so that a new prompt length or
batch size does not recompile; then `prefill` writes the prompts into the
target's (and the drafter's) caches in one pass and builds the `DecodeState`
that `run_loop` starts from.

Memory is checked before anything runs, against the device memory free now
(`free_device_bytes`), in three steps, each a one-line ValueError with the sizes:
`memory_floor` (arithmetic, before compiling: the KV cache and the widest verify
pass's largest array), `compiled_prefill` (the prefill program's own accounting)
and, for `generate`, `compiled_loop` (the decoding loop's: its state and one
round's working memory).
"""

from __future__ import annotations

import dataclasses
import functools
import pathlib
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from specdec_jax import sharding
from specdec_jax.drafters.base import Drafter, PrefillContext, Proposal
from specdec_jax.engine.round import draft_step, run_loop
from specdec_jax.engine.shape import AUTO_GAMMAS, ShapePolicy
from specdec_jax.engine.state import DecodeState, EngineParams, EngineSpec
from specdec_jax.grammar import DeviceGrammar, finished, stack_grammars
from specdec_jax.metrics import Counters
from specdec_jax.rng import seed_key
from specdec_jax.sampling import RowSampling, SamplingParams
from specdec_jax.target import TargetModel, resolve_target

AUTO = "auto"  # gamma chosen per round by a ShapePolicy (engine.shape) from this device's measured costs
PolicyFor = Callable[[int, int], ShapePolicy]  # (bucketed batch, KV capacity) -> the policy for those shapes

MAX_NEW_TOKENS = 2**31 - 2**20  # exclusive bound: positions and lengths are int32 on device


@functools.partial(jax.jit, static_argnums=0)
def prefill(spec: EngineSpec, params: EngineParams, prompts, prompt_lens, max_new, live, row_ids,
            sampling: RowSampling, key, grammar_state=None) -> DecodeState:
    """Writes padded prompts i32[B,P] into the caches in one pass; lengths = prompt_lens - 1. ``spec`` has
    no shape policy (`start_policy` adds its state), so that one program serves every policy.
    ``grammar_state``: i32[B] each row's initial grammar state (with ``params.grammar``), or None."""
    batch, width = prompts.shape
    kept = min(width, spec.buffer_len)  # a bucket wider than the buffer is padding past it
    tokens = jnp.zeros((batch, spec.buffer_len), jnp.int32).at[:, :kept].set(prompts[:, :kept])
    positions = jnp.broadcast_to(jnp.arange(width, dtype=jnp.int32)[None, :], (batch, width))
    _, hidden, cache = spec.target.apply(params.target, prompts, spec.target.init_cache(batch, spec.capacity),
                                         positions, None, spec.hidden_layers, compute_logits=False)
    drafter_state, features = None, None
    if spec.gamma > 0:
        prompt_features = None if hidden is None else hidden.transpose(1, 2, 0, 3)  # f32[B,P,k,H]
        drafter_state = spec.drafter.init(params.drafter, PrefillContext(
            prompts=prompts, prompt_lens=prompt_lens, features=prompt_features, target_params=params.target,
            capacity=spec.capacity, target=spec.target))
        if hidden is not None:
            features = jnp.zeros((batch, spec.gamma + 1) + prompt_features.shape[2:], jnp.float32)
    zeros = jnp.zeros((batch,), jnp.int32)
    state = DecodeState(
        tokens=tokens,
        num_tokens=prompt_lens,
        prompt_lens=prompt_lens,
        max_new=max_new,
        done=~live,
        stop_reason=zeros,
        row_ids=row_ids,
        key=key,
        sampling=sampling,
        cache=cache.with_lengths(prompt_lens - 1),
        drafter_state=drafter_state,
        proposal=Proposal(jnp.zeros((batch, spec.gamma), jnp.int32), zeros, None),
        last_emit=zeros,
        last_accepted=zeros,
        features=features,
        counters=Counters.zeros(batch, spec.gamma, len(spec.verify_widths)),
        step=jnp.zeros((), jnp.int32),
        target_top=(jnp.zeros((batch, spec.buffer_len, spec.record_top_k), jnp.int32),
                    jnp.zeros((batch, spec.buffer_len, spec.record_top_k), jnp.float32))
        if spec.record_top_k else None,
        grammar_state=grammar_state,
    )
    if spec.gamma > 0:  # the proposal's structure (with or without q) is the drafter's
        shapes = jax.eval_shape(lambda s: draft_step(spec, params, s).proposal, state)
        state = state.replace(proposal=jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), shapes))
    return sharding.constrain_state(state, spec.mesh)


@functools.partial(jax.jit, static_argnums=0)
def start_policy(spec: EngineSpec, state: DecodeState) -> DecodeState:
    """`prefill`'s state (of ``spec`` without its policy) with the state of ``spec.policy``: the acceptance
    estimates before any round and counters of its verify widths."""
    batch = state.done.shape[0]
    state = state.replace(acceptance=spec.policy.initial(batch), draft_found=jnp.ones((batch,), jnp.float32),
                          counters=Counters.zeros(batch, spec.gamma, len(spec.verify_widths)))
    return sharding.constrain_state(state, spec.mesh)


@dataclasses.dataclass(frozen=True)
class Prepared:
    """A validated, bucketed, prefilled batch: what `generate` runs the loop on."""

    spec: EngineSpec
    params: EngineParams  # target and drafter weights (placed on the mesh, if any)
    state: DecodeState  # right after prefill
    prompt_lens: np.ndarray  # i32[B] (padding rows: 1)
    num_rows: int  # real prompts (B is bucketed up to a power of two)


def prepare(
    target,
    prompts: Sequence[Sequence[int]],
    drafter: Drafter | None = None,
    *,
    gamma: int | str | None = None,
    policy: ShapePolicy | None = None,
    sampling: SamplingParams | Sequence[SamplingParams] = SamplingParams(),
    max_new_tokens: int = 128,
    eos_id: int | None = None,
    stop_ids: Sequence[int] = (),
    seed: int = 0,
    row_ids: Sequence[int] | None = None,
    capacity: int | None = None,
    record_top_k: int = 0,
    mesh: Mesh | None = None,
    grammars=None,
    policy_for: PolicyFor | None = None,
    compile_loop: bool = False,
) -> Prepared:
    """Validates the inputs, buckets shapes, places them on the mesh and prefills; arguments as in
    `generate`. Under gamma "auto" without a ``policy``, ``policy_for(batch, capacity)`` builds one for
    the bucketed shapes (`engine.prepare` passes the calibrated one, `calibration.shape_policy`).
    ``compile_loop``: also compile `run_loop` for this batch (with a traced round count, as `generate`
    calls it) and check its memory before prefill runs (`compiled_loop`)."""
    model, target_params = resolve_target(target)
    gamma, auto = _widest_gamma(drafter, gamma, policy, policy_for)
    prompts = [list(map(int, p)) for p in prompts]
    mesh = mesh if mesh is not None and mesh.size > 1 else None
    stops = tuple(sorted({int(t) for t in stop_ids} | ({int(eos_id)} if eos_id is not None else set())))
    validate(model, prompts, drafter, gamma, max_new_tokens, stops, capacity, record_top_k, mesh)
    num_rows = len(prompts)
    data = 1 if mesh is None else mesh.shape[sharding.DATA]
    batch = _round_up(_next_power_of_two(num_rows), data)  # the data axis divides the batch
    longest = max(map(len, prompts))
    capacity = capacity or default_capacity(longest, max_new_tokens, gamma)
    padded, lens = _padded(prompts, batch)
    free = sharding.least_over_processes(free_device_bytes())  # one decision, or a process waits alone in a collective
    check_memory_floor(model, lens, capacity, gamma, 1 if mesh is None else mesh.size, free)
    ids, rows = _row_ids_and_sampling(row_ids, sampling, num_rows, batch)
    tables, grammar_state = row_grammars(grammars, num_rows, batch, model.vocab_size, max_new_tokens)

    spec = EngineSpec(model, drafter if gamma > 0 else None, gamma, capacity, stops, record_top_k, mesh, None)
    params = EngineParams(target=target_params, drafter=drafter.params if gamma > 0 else None, grammar=tables)
    inputs = (padded, lens, np.full((batch,), max_new_tokens, np.int32), np.arange(batch) < num_rows, ids, rows,
              seed_key(seed), grammar_state)
    if mesh is not None:
        params = sharding.shard_params(params, mesh)
        inputs = sharding.shard_state(inputs, mesh)
    run_prefill = compiled_prefill(spec, params, inputs, lens, free)  # refuses what does not fit before calibrating
    if auto and policy is None:
        policy = policy_for(batch, capacity)
    _check_policy_kind(policy, drafter)
    loop_spec = dataclasses.replace(spec, policy=policy) if policy is not None and gamma > 0 else spec
    if compile_loop:
        compiled_loop(loop_spec, params, loop_state_shapes(spec, loop_spec, params, inputs), lens, free)
    state = run_prefill(params, *inputs)
    if loop_spec is not spec:
        state = start_policy(loop_spec, state)
    return Prepared(loop_spec, params, state, lens, num_rows)


def _widest_gamma(drafter: Drafter | None, gamma, policy: ShapePolicy | None,
                  policy_for: PolicyFor | None) -> tuple[int, bool]:
    """(G, whether a shape policy chooses each round's shape): under a policy, G is its widest shape
    (`AUTO_GAMMAS`' or the tree's node count before calibration); gamma None without a drafter is 0."""
    gamma = _tree_gamma(drafter, gamma, policy)
    auto = gamma == AUTO or (gamma is None and drafter is not None) or policy is not None
    if not auto:
        return (0 if gamma is None else gamma), False
    if drafter is None:
        raise ValueError("gamma 'auto' (a shape policy) needs a drafter")
    if gamma not in (None, AUTO):
        raise ValueError(f"gamma = {gamma!r} and a shape policy exclude each other: pass one of them")
    if policy is None and policy_for is None:
        raise ValueError("gamma 'auto' needs a ShapePolicy (policy=) or a builder of one (policy_for=); "
                         "engine.prepare and engine.generate use this device's calibrated costs")
    tree = getattr(drafter, "tree", None)
    return (policy.max_gamma if policy is not None else max(AUTO_GAMMAS) if tree is None else tree.nodes), True


def _row_ids_and_sampling(row_ids, sampling, num_rows: int, batch: int) -> tuple[np.ndarray, RowSampling]:
    """(i32[batch] row ids: the given ones or 0..batch-1, padding rows 0; each row's sampling, padding
    rows copying row 0's)."""
    ids = np.arange(batch, dtype=np.int32)
    if row_ids is not None:
        if len(row_ids) != num_rows:
            raise ValueError(f"row_ids must have one id per prompt ({num_rows}), got {len(row_ids)}")
        ids[:num_rows] = list(row_ids)
        ids[num_rows:] = 0
    per_row = [sampling] * num_rows if isinstance(sampling, SamplingParams) else list(sampling)
    if len(per_row) != num_rows:
        raise ValueError(f"got {len(per_row)} SamplingParams for {num_rows} prompts")
    return ids, RowSampling.from_params(per_row + [per_row[0]] * (batch - num_rows), batch)


def _check_policy_kind(policy: ShapePolicy | None, drafter: Drafter | None) -> None:
    """A tree drafter's policy chooses node counts, a chain drafter's chain lengths."""
    if policy is not None and policy.tree != (getattr(drafter, "tree", None) is not None):
        raise ValueError("a tree drafter needs a shape policy over node counts (ShapePolicy(tree=True)), a chain "
                         "drafter one over chain lengths")


def _padded(prompts: list[list[int]], batch: int) -> tuple[np.ndarray, np.ndarray]:
    """(i32[batch, bucket] prompts padded with 0, i32[batch] lengths; padding rows have length 1)."""
    padded = np.zeros((batch, prompt_bucket(max(map(len, prompts)))), np.int32)
    lens = np.ones((batch,), np.int32)
    for b, p in enumerate(prompts):
        padded[b, : len(p)] = p
        lens[b] = len(p)
    return padded, lens


def row_grammars(grammars, num_rows: int, batch: int, vocab_size: int, max_new_tokens: int
                 ) -> tuple[DeviceGrammar | None, np.ndarray | None]:
    """The batch's stacked grammar tables and each row's initial state, i32[batch] (padding rows: the
    free grammar), from ``grammars``: None, one `constraints.GrammarTables` for every row, or one per
    row (None: no constraint); (None, None) when no row has one. A constraint whose shortest match
    is longer than ``max_new_tokens`` is a ValueError, and so is one that matches only the empty text."""
    if grammars is None:
        return None, None
    per_row = list(grammars) if isinstance(grammars, (list, tuple)) else [grammars] * num_rows
    if len(per_row) != num_rows:
        raise ValueError(f"got {len(per_row)} grammars for {num_rows} prompts")
    distinct = list({id(t): t for t in per_row if t is not None}.values())
    if not distinct:
        return None, None
    tables = _stacked(tuple(distinct), vocab_size)
    initial, distance = np.asarray(tables.initial), np.asarray(tables.distance)
    empty_only = np.asarray(finished(tables, tables.initial, jnp.full(initial.shape, max_new_tokens)))
    for k in range(1, len(distinct) + 1):
        start = initial[k]
        if empty_only[k]:
            raise ValueError("the constraint matches only the empty text (within max_new_tokens): there is nothing "
                             "to generate")
        if distance[start] > max_new_tokens:
            raise ValueError(f"the constraint's shortest match is {distance[start]} tokens, more than max_new_tokens "
                             f"({max_new_tokens}): raise --max-new-tokens")
    kind = {id(t): k for k, t in enumerate(distinct, start=1)}
    state = np.full((batch,), initial[0], np.int32)
    state[:num_rows] = [initial[kind[id(t)]] if t is not None else initial[0] for t in per_row]
    return tables, state


@functools.lru_cache(maxsize=8)
def _stacked(tables: tuple, vocab_size: int) -> DeviceGrammar:
    """`stack_grammars`, once per set of tables (by identity: `GrammarTables` compare so): 0.1 s for Qwen's
    vocabulary, which a bench would otherwise pay on every call."""
    return stack_grammars(tables, vocab_size)


def check_memory_floor(model: TargetModel, lens: np.ndarray, capacity: int, gamma: int, devices: int,
                       free: int | None) -> None:
    """ValueError with the sizes when `memory_floor` exceeds ``free`` bytes (None: unknown, no check): a
    shape that cannot fit is refused in milliseconds, before any program is compiled."""
    state, work = memory_floor(model, lens.shape[0], capacity, gamma, devices)
    if free is not None and state + work > free:
        raise ValueError(f"the decoding state needs {_size(state)} and the widest verify pass at least {_size(work)} "
                         f"more ({_shapes(lens, capacity, gamma)}) but the device has {_size(free)} free: {MEMORY_FIX}")


def memory_floor(model: TargetModel, batch: int, capacity: int, gamma: int, devices: int = 1) -> tuple[int, int]:
    """``(state, work)``: bytes per device that decoding must hold at least, from the shapes alone: the
    target's KV cache (its ``init_cache``, traced abstractly), and the larger of two arrays that the
    widest verify pass (W = gamma + 1 tokens) materializes whatever XLA fuses: one attention head's
    float32 scores f32[B,W,T+W] (over the cache and the pass itself) and its float32 logits f32[B,W,V].
    Over ``devices`` devices, the even share (no device holds less than that of the largest)."""
    cache = jax.eval_shape(lambda: model.init_cache(batch, capacity))
    state = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(cache))
    width = gamma + 1
    work = 4 * batch * width * max(capacity + width, model.vocab_size)
    return -(-state // devices), -(-work // devices)


def compiled_prefill(spec: EngineSpec, params: EngineParams, inputs, lens: np.ndarray, free: int | None = None
                     ) -> Callable:
    """`prefill` compiled for ``inputs`` (the call runs this executable: nothing is compiled twice), after a
    ValueError with the numbers when its memory (the loop state it returns, KV caches, token buffer, the
    drafter's state, and its working memory: a long prompt's attention scores) exceeds ``free`` bytes
    (per device of a mesh, from the compiled program's own accounting; None: unknown, no check)."""
    compiled = prefill.lower(spec, params, *inputs).compile()
    stats = compiled.memory_analysis()
    if stats is not None and free is not None:
        need = stats.output_size_in_bytes + stats.temp_size_in_bytes
        if need > free:
            raise ValueError(f"prefill and the decoding state need {_size(need)} "
                             f"({_shapes(lens, spec.capacity, spec.gamma)}) but the device has {_size(free)} free: "
                             f"{MEMORY_FIX}")
    return compiled


def loop_state_shapes(spec: EngineSpec, loop_spec: EngineSpec, params: EngineParams, inputs):
    """The `DecodeState` that `run_loop` of ``loop_spec`` will be given (`prefill` of ``spec``, then
    `start_policy` under a shape policy), as shapes and dtypes, without running anything; under a mesh,
    with the shardings `sharding.constrain_state` gives it (a call then finds the same program)."""
    shapes = jax.eval_shape(functools.partial(prefill, spec), params, *inputs)
    if loop_spec is not spec:
        shapes = jax.eval_shape(functools.partial(start_policy, loop_spec), shapes)
    if spec.mesh is None:
        return shapes
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s, weak_type=x.weak_type),
                        shapes, sharding.state_shardings(shapes, spec.mesh))


def compiled_loop(spec: EngineSpec, params: EngineParams, state, lens: np.ndarray, free: int | None) -> Callable:
    """`run_loop` compiled for ``state`` (`loop_state_shapes`) and a traced round count, as `generate` calls
    it (the call finds this executable in jax's cache: nothing is compiled twice), after a ValueError with
    the numbers when the loop needs more than ``free`` bytes: the state it is given (donated: the loop
    writes its output in place of it), one round's working memory (temp: the verify pass's attention
    scores and logits at its widest, a tree's masks, the drafter's own) and any output not written in
    place (per device of a mesh, from the compiled program's own accounting; None: unknown, no check)."""
    compiled = run_loop.lower(spec, params, state, jax.ShapeDtypeStruct((), jnp.int32)).compile()
    stats = compiled.memory_analysis()
    if stats is not None and free is not None:
        held = _device_bytes(state)
        work = stats.temp_size_in_bytes + max(0, stats.output_size_in_bytes - stats.alias_size_in_bytes)
        if held + work > free:
            raise ValueError(f"the decoding loop needs {_size(held + work)} (the decoding state {_size(held)} and one "
                             f"round's working memory {_size(work)}: {_shapes(lens, spec.capacity, spec.gamma)}) but "
                             f"the device has {_size(free)} free: {MEMORY_FIX}")
    return compiled


MEMORY_FIX = "shorten the prompt, or lower max_new_tokens, gamma (a tree's nodes) or the batch size"


def _shapes(lens: np.ndarray, capacity: int, gamma: int) -> str:
    """The shapes a memory error names: batch, KV slots, the longest prompt, gamma and the verify width."""
    return (f"batch {lens.shape[0]}, {capacity} KV slots per row: the longest prompt, row {int(np.argmax(lens))}, has "
            f"{int(lens.max())} tokens; gamma {gamma}, verify passes of up to {gamma + 1} tokens")


def _size(nbytes: int) -> str:
    """Bytes as GiB (MiB below 1 GiB), one decimal."""
    return f"{nbytes / 2**30:.1f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.1f} MiB"


def _device_bytes(tree) -> int:
    """Bytes of the arrays (or shapes) of ``tree`` on one device: a sharded array's shard."""
    total = 0
    for x in jax.tree.leaves(tree):
        shape = x.shape if getattr(x, "sharding", None) is None else x.sharding.shard_shape(x.shape)
        total += int(np.prod(shape, dtype=np.int64)) * x.dtype.itemsize
    return total


def free_device_bytes(device=None) -> int | None:
    """Bytes free on ``device`` (default this process's first): its allocator's limit less its use on an
    accelerator, the host's available memory (/proc/meminfo MemAvailable) on CPU; None where unknown."""
    device = device or jax.local_devices()[0]  # another process's devices have no memory_stats here
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    if stats and "bytes_limit" in stats:
        return int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))
    try:
        for line in pathlib.Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _tree_gamma(drafter: Drafter | None, gamma, policy):
    """A tree drafter's G is its node count (``gamma`` None or equal to it; 0 is plain decoding), or
    "auto" (or a policy): each round verifies one of `tree_sizes` of its nodes (`engine.shape`)."""
    shape = getattr(drafter, "tree", None)
    if shape is None or policy is not None or gamma == AUTO:
        return gamma
    if gamma not in (None, 0, shape.nodes):
        raise ValueError(f"the {drafter.name} drafter proposes a tree of {shape.nodes} nodes; gamma = {gamma} "
                         f"must be left unset or equal {shape.nodes}")
    return shape.nodes if gamma is None else gamma


def validate(target: TargetModel, prompts, drafter, gamma, max_new_tokens, stop_ids, capacity, record_top_k,
             mesh) -> None:
    """Every bad input raises ValueError here, before anything is compiled."""
    vocab = target.vocab_size
    if not prompts:
        raise ValueError("no prompts given")
    for i, p in enumerate(prompts):
        if not p:
            raise ValueError(f"prompt {i} is empty (each prompt needs >= 1 token)")
        bad = [t for t in p if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt {i} has token id {bad[0]} outside the vocabulary [0, {vocab})")
    if not isinstance(gamma, int) or gamma < 0:
        raise ValueError(f"gamma must be an int >= 0 or 'auto', got {gamma!r}")
    if gamma > 0 and drafter is None:
        raise ValueError(f"gamma = {gamma} needs a drafter (use gamma 0 for plain decoding)")
    if not 1 <= max_new_tokens < MAX_NEW_TOKENS:
        raise ValueError(f"max_new_tokens must be in [1, {MAX_NEW_TOKENS}), got {max_new_tokens}")
    for t in stop_ids:
        if not 0 <= t < vocab:
            raise ValueError(f"stop token id {t} is outside the vocabulary [0, {vocab})")
    longest = max(map(len, prompts))
    if target.max_positions is not None and longest + max_new_tokens > target.max_positions:
        raise ValueError(
            f"the longest prompt ({longest} tokens) plus max_new_tokens ({max_new_tokens}) exceeds the model's "
            f"context length ({target.max_positions} positions): shorten the prompt or lower max_new_tokens")
    if capacity is not None and capacity < longest + gamma + 1:
        raise ValueError(
            f"capacity {capacity} is too small: the longest prompt ({longest} tokens) plus one verify pass "
            f"(gamma + 1 = {gamma + 1}) needs at least {longest + gamma + 1} slots"
        )
    if not 0 <= record_top_k <= vocab:
        raise ValueError(f"record_top_k must be in [0, {vocab}], got {record_top_k}")
    if mesh is not None:
        target.check_mesh(mesh)
    if gamma > 0:
        drafter.check(target, mesh)


def prompt_bucket(longest_prompt: int) -> int:
    """Padded prompt width: the next power of two, at least 16 (one compile per bucket)."""
    return max(16, _next_power_of_two(longest_prompt))


def default_capacity(longest_prompt: int, max_new_tokens: int, gamma: int) -> int:
    """KV slots per row: prompt bucket + max_new_tokens + gamma + 1, rounded up to a multiple of 64."""
    return _round_up(prompt_bucket(longest_prompt) + max_new_tokens + gamma + 1, 64)


def _next_power_of_two(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple
