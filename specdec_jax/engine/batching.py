"""From a validated request to the loop's first state: buckets, the program, placement and prefill.

`prepare` runs a `GenerateRequest` (validated when it was built) in named
steps: `bucket` pads the batch to a power of two (and to a multiple of the
mesh's data axis) and the prompts to a power-of-two bucket, so that a new
prompt length or batch size does not recompile, and checks the shapes' memory
floor; `build_program` makes the `EngineSpec`, the weights and prefill's inputs
(placed on the mesh) and compiles `prefill`, checking its memory; `with_policy`
adds the shape policy (gamma "auto"); then `prefill` writes the prompts into the
target's (and the drafter's) caches in one pass and builds the `DecodeState`
that `run_loop` starts from. The memory checks are `engine.memory`'s.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from specdec_jax import sharding
from specdec_jax.drafters.base import PrefillContext, Proposal
from specdec_jax.engine.memory import (
    MEMORY_FIX,
    check_memory_floor,
    compile_once,
    compiled_loop,
    describe_shapes,
    format_size,
    free_device_bytes,
)
from specdec_jax.engine.request import (
    GenerateRequest,
    default_capacity,
    next_power_of_two,
    padded_prompts,
    round_up,
    row_grammars,
    row_ids_and_sampling,
)
from specdec_jax.engine.round import draft_step
from specdec_jax.engine.shape import ShapePolicy
from specdec_jax.engine.state import DecodeState, EngineParams, EngineSpec
from specdec_jax.metrics import Counters
from specdec_jax.rng import seed_key
from specdec_jax.sampling import RowSampling

PolicyFor = Callable[[int, int], ShapePolicy]  # (bucketed batch, KV capacity) -> the policy for those shapes


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
        if spec.record_top_k or spec.record_mode else None,
        target_chosen=None if spec.record_mode is None else jnp.zeros((batch, spec.buffer_len), jnp.float32),
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


@dataclasses.dataclass(frozen=True)
class Batch:
    """A request's batch as the program is built for it (`bucket`), on the host."""

    prompts: np.ndarray  # i32[B,P] padded with 0; B and P are the batch's and the prompts' buckets
    prompt_lens: np.ndarray  # i32[B] (padding rows: 1)
    capacity: int  # T, KV slots per row
    free: int | None  # bytes free per device (the least over processes), measured once; None: unknown


def prepare(request: GenerateRequest, policy_for: PolicyFor | None = None, compile_loop: bool = False) -> Prepared:
    """``request`` bucketed, built, placed on its mesh and prefilled. Under gamma "auto" without a
    ``request.policy``, ``policy_for(batch, capacity)`` builds one for the bucketed shapes
    (`engine.prepare` passes the calibrated one, `calibration.shape_policy`). ``compile_loop``: also
    compile `run_loop` for this batch (with a traced round count, as `generate` calls it) and check its
    memory before prefill runs (`memory.compiled_loop`)."""
    if request.auto and request.policy is None and policy_for is None:
        raise ValueError("gamma 'auto' needs a ShapePolicy (policy=) or a builder of one (policy_for=); "
                         "engine.prepare and engine.generate use this device's calibrated costs")
    batch = bucket(request)
    spec, params, inputs = build_program(request, batch)
    run_prefill = compiled_prefill(spec, params, inputs, batch.prompt_lens, batch.free)  # refuses before calibrating
    policy = request.policy
    if request.auto and policy is None:
        policy = policy_for(batch.prompts.shape[0], batch.capacity)
    loop_spec = with_policy(spec, policy, request.drafter)
    if compile_loop:
        compiled_loop(loop_spec, params, loop_state_shapes(spec, loop_spec, params, inputs), batch.prompt_lens,
                      batch.free)
    state = run_prefill(params, *inputs)
    if loop_spec is not spec:
        state = start_policy(loop_spec, state)
    return Prepared(loop_spec, params, state, batch.prompt_lens, len(request.prompts))


def bucket(request: GenerateRequest) -> Batch:
    """The request's prompts padded to the batch bucket (a power of two, a multiple of the mesh's data
    axis) and the prompt bucket, its KV capacity, and the free memory, measured once; refuses a shape
    whose memory floor does not fit (`memory.check_memory_floor`) before anything is compiled."""
    mesh, num_rows = request.mesh, len(request.prompts)
    data = 1 if mesh is None else mesh.shape[sharding.DATA]
    padded, lens = padded_prompts(request.prompts, round_up(next_power_of_two(num_rows), data))
    capacity = request.capacity or default_capacity(request.longest, request.max_new_tokens, request.max_gamma)
    free = sharding.least_over_processes(free_device_bytes())  # one decision, or a process waits alone in a collective
    check_memory_floor(request.model, lens, capacity, request.max_gamma, 1 if mesh is None else mesh.size, free)
    return Batch(padded, lens, capacity, free)


def build_program(request: GenerateRequest, batch: Batch) -> tuple[EngineSpec, EngineParams, tuple]:
    """``(spec, params, inputs)``: the `EngineSpec` without a shape policy (one prefill program serves every
    policy), the weights and grammar tables, and `prefill`'s arguments after them, placed on the mesh."""
    num_rows, bucketed = len(request.prompts), batch.prompts.shape[0]
    drafter = request.drafter if request.max_gamma > 0 else None
    ids, sampling = row_ids_and_sampling(request, bucketed)
    tables, grammar_state = row_grammars(request.grammars, num_rows, bucketed, request.model.vocab_size,
                                         request.max_new_tokens)
    spec = EngineSpec(request.model, drafter, request.max_gamma, batch.capacity, request.stops,
                      request.recorded_top_k, request.mesh, None, request.record_mode)
    params = EngineParams(target=request.target_params, drafter=None if drafter is None else drafter.params,
                          grammar=tables)
    inputs = (batch.prompts, batch.prompt_lens, np.full((bucketed,), request.max_new_tokens, np.int32),
              np.arange(bucketed) < num_rows, ids, sampling, seed_key(request.seed), grammar_state)
    if request.mesh is not None:
        params = sharding.shard_params(params, request.mesh)
        inputs = sharding.shard_state(inputs, request.mesh)
    return spec, params, inputs


def with_policy(spec: EngineSpec, policy: ShapePolicy | None, drafter) -> EngineSpec:
    """``spec`` deciding each round's shape with ``policy`` (``spec`` itself without one, or for plain
    decoding); a tree drafter's policy chooses node counts, a chain drafter's chain lengths."""
    if policy is None:
        return spec
    if policy.tree != (getattr(drafter, "tree", None) is not None):
        raise ValueError("a tree drafter needs a shape policy over node counts (ShapePolicy(tree=True)), a chain "
                         "drafter one over chain lengths")
    return dataclasses.replace(spec, policy=policy) if spec.gamma > 0 else spec


def compiled_prefill(spec: EngineSpec, params: EngineParams, inputs, lens: np.ndarray, free: int | None = None
                     ) -> Callable:
    """`prefill` compiled for ``inputs`` (the call runs this executable: nothing is compiled twice), after a
    ValueError with the numbers when its memory (the loop state it returns, KV caches, token buffer, the
    drafter's state, and its working memory: a long prompt's attention scores) exceeds ``free`` bytes
    (per device of a mesh, from the compiled program's own accounting; None: unknown, no check)."""
    compiled, stats = compile_once(prefill, spec, params, *inputs)
    if stats is not None and free is not None:
        need = stats.output_size_in_bytes + stats.temp_size_in_bytes
        if need > free:
            raise ValueError(f"prefill and the decoding state need {format_size(need)} "
                             f"({describe_shapes(lens, spec.capacity, spec.gamma)}) but the device has "
                             f"{format_size(free)} free: {MEMORY_FIX}")
    return compiled


def loop_state_shapes(spec: EngineSpec, loop_spec: EngineSpec, params: EngineParams, inputs):
    """The `DecodeState` that `run_loop` of ``loop_spec`` will be given (`prefill` of ``spec``, then
    `start_policy` under a shape policy), as shapes and dtypes, without running anything; under a mesh,
    with the shardings `sharding.constrain_state` gives it (a call then finds the same program)."""
    state = jax.eval_shape(functools.partial(prefill, spec), params, *inputs)
    if loop_spec is not spec:
        state = jax.eval_shape(functools.partial(start_policy, loop_spec), state)
    if spec.mesh is None:
        return state
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s, weak_type=x.weak_type),
                        state, sharding.state_shardings(state, spec.mesh))
