"""`generate`, the public entry point, and `prepare`, the batch it runs (docs/design.md section 4).

`generate` builds a `GenerateRequest` (validated once) and runs it:
`prepare_request` (bucket, build the program, prefill), then `run_chunks` (the
compiled loop in calls of about CHUNK_S seconds: between calls only each row's
``done`` and the round count reach the host, so that a stop is seen; the cost
is measured in the entry "What does running the decoding loop in chunks cost?"
of experiments/README.md), then `unpack` (the tokens to the host, once).

`prepare` sits above both `batching` and `calibration`: gamma "auto" is priced
by this device's calibrated costs, which are measured on batches that
`batching.prepare` builds with a fixed policy.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from specdec_jax import sharding
from specdec_jax.drafters.base import Drafter
from specdec_jax.engine import batching
from specdec_jax.engine.batching import Prepared
from specdec_jax.engine.calibration import shape_policy
from specdec_jax.engine.request import GenerateRequest
from specdec_jax.engine.round import decode_round, run_loop
from specdec_jax.engine.shape import ShapePolicy
from specdec_jax.engine.state import STOP_REASONS, DecodeState, GenerationResult
from specdec_jax.metrics import Metrics
from specdec_jax.sampling import SamplingParams


# Seconds of rounds per device call of the decoding loop: between calls the host sees a stop
# (Ctrl-C, SIGTERM; `specdec_jax.interrupts`). None: one call for the whole generation.
CHUNK_S: float | None = 1.0
FIRST_CHUNK_ROUNDS = 2  # the first call's rounds; later calls are sized from its time


def prepare(target, prompts: Sequence[Sequence[int]], drafter: Drafter | None = None, **options) -> Prepared:
    """The batch `generate` runs the loop on, for driving rounds by hand: `prepare_request` of
    `GenerateRequest(target, prompts, drafter, **options)` (keyword arguments as in `generate`)."""
    return prepare_request(GenerateRequest(target, prompts, drafter, **options))


def prepare_request(request: GenerateRequest, compile_loop: bool = False) -> Prepared:
    """`batching.prepare` (bucket, build, place, prefill), with gamma "auto" priced by this device's
    calibrated costs (`calibration.shape_policy`, cached on disk)."""
    policy_for = functools.partial(shape_policy, request.target, request.drafter)
    return batching.prepare(request, policy_for=policy_for, compile_loop=compile_loop)


def generate(target, prompts: Sequence[Sequence[int]], drafter: Drafter | None = None, *,
             gamma: int | str | None = None, policy: ShapePolicy | None = None,
             sampling: SamplingParams | Sequence[SamplingParams] = SamplingParams(), max_new_tokens: int = 128,
             eos_id: int | None = None, stop_ids: Sequence[int] = (), seed: int = 0,
             row_ids: Sequence[int] | None = None, capacity: int | None = None, record_top_k: int = 0,
             logprobs: int | None = None, logprobs_mode: str = "raw", python_loop: bool = False,
             mesh: Mesh | None = None, grammars=None) -> GenerationResult:
    """Speculative decoding of a ragged batch of token-id prompts.

    Every argument but ``python_loop`` is the `GenerateRequest` attribute of its name (validated
    before anything is compiled: one ValueError each). A drafter is an `NgramDrafter`,
    `ModelDrafter`, `oracle_drafter(...)` or any object of the drafter protocol
    (`specdec_jax.drafters.base`); gamma "auto", the default with a chain drafter, chooses each
    round's draft length and verify width on device from this device's measured costs (calibrated
    once per device, model, drafter, batch and capacity and cached on disk, `engine.calibration`)
    and each row's running acceptance (`engine.shape`). Under a grammar constraint each row's
    output matches it, and a row that reaches a whole match nothing may follow stops with reason
    "grammar" (docs/constraints.md). With ``logprobs`` K each emitted token's log-prob and its K
    most likely alternatives are read from the verify pass that scored it (`round.record`): the
    same numbers plain decoding gives the same tokens. With a mesh (`specdec_jax.sharding.make_mesh`) weights, caches
    and loop state are sharded over it and the same loop runs partitioned: the batch is padded to
    a multiple of its ``data`` axis, and its ``model`` axis must divide the head counts and the MLP
    width.

    python_loop: run the same `decode_round` from a Python loop instead of `lax.while_loop` (for
      debugging; identical results; `run_loop` is not compiled, so only the shapes' floor and
      prefill's memory are checked).

    Returns:
      GenerationResult: emitted tokens and stop reason per row, batch metrics.
    """
    request = GenerateRequest(target, prompts, drafter, gamma=gamma, policy=policy, sampling=sampling,
                              max_new_tokens=max_new_tokens, eos_id=eos_id, stop_ids=stop_ids, seed=seed,
                              row_ids=row_ids, capacity=capacity, record_top_k=record_top_k, logprobs=logprobs,
                              logprobs_mode=logprobs_mode, mesh=mesh, grammars=grammars)
    return run_request(request, python_loop)


def run_request(request: GenerateRequest, python_loop: bool = False) -> GenerationResult:
    """`generate` of a built request: prepare (the loop compiled, and its memory checked, before prefill
    runs), run the loop to the end, unpack; the drafter then observes the outputs."""
    start = time.perf_counter()
    run = prepare_request(request, compile_loop=not python_loop)
    state = jax.block_until_ready(run.state)
    loop_start = time.perf_counter()
    if python_loop:
        while bool(jnp.any(~state.done)) and int(state.step) < request.max_new_tokens:
            state = decode_round(run.spec, run.params, state)
    else:
        state = run_chunks(run, state, request.max_new_tokens)
    result = unpack(run, state, start, loop_start)
    if request.drafter is not None:
        request.drafter.observe(result.tokens)  # after the call: no row drafts from its own future
    return result


def unpack(run: Prepared, state: DecodeState, start: float, loop_start: float) -> GenerationResult:
    """The finished ``state`` on the host as a `GenerationResult` of ``run``'s real rows; ``start`` and
    ``loop_start``: `time.perf_counter` at the call's start and at the loop's."""
    tokens, num_tokens, reasons, counters, step, top, chosen = sharding.to_host(
        (state.tokens, state.num_tokens, state.stop_reason, state.counters, state.step, state.target_top,
         state.target_chosen))
    end = time.perf_counter()
    lens, num_rows = run.prompt_lens, run.num_rows
    if top is not None:
        top = [(top[0][b, lens[b] : num_tokens[b]], top[1][b, lens[b] : num_tokens[b]]) for b in range(num_rows)]
    if chosen is not None:
        chosen = [chosen[b, lens[b] : num_tokens[b]] for b in range(num_rows)]
    return GenerationResult(
        tokens=[tokens[b, lens[b] : num_tokens[b]].tolist() for b in range(num_rows)],
        stop_reasons=[STOP_REASONS.get(int(r), "running") for r in reasons[:num_rows]],
        metrics=Metrics.from_counters(counters, num_rows),
        wall_s=end - start,
        loop_rounds=int(step),
        decode_s=end - loop_start,
        target_top=top,
        logprobs=chosen,
        policy=run.spec.policy,
        row_counts=[{"rounds": int(counters.rounds[b]), "draft_tokens": int(counters.drafted[b]),
                     "accepted_tokens": int(counters.accepted[b]), "emitted_tokens": int(counters.emitted[b])}
                    for b in range(num_rows)],
    )


def run_chunks(run: Prepared, state: DecodeState, max_new_tokens: int) -> DecodeState:
    """`run_loop` to the end in calls of about CHUNK_S seconds each (the first of FIRST_CHUNK_ROUNDS
    rounds, each next one sized from the last one's rate, at most 8 times longer), so that a
    KeyboardInterrupt reaches the caller within about a second while the rounds of a call stay on
    device. The round count of each call is a traced argument (one program for every size, the one
    `prepare` compiled and checked); a multi-host run takes process 0's sizes. Between calls only
    ``done`` (bool[B]) and ``step`` (i32[]) reach the host."""
    if CHUNK_S is None:  # one call of the same program, with rounds enough for every row's budget
        return run_loop(run.spec, run.params, state, jnp.int32(max_new_tokens))
    rounds = FIRST_CHUNK_ROUNDS
    while True:
        start = time.perf_counter()
        state = run_loop(run.spec, run.params, state, jnp.int32(rounds))
        done, step = sharding.to_host((state.done, state.step))
        if done.all() or int(step) >= max_new_tokens:
            return state
        rate = rounds / max(time.perf_counter() - start, 1e-6)
        rounds = sharding.same_on_every_process(int(min(max(1, rate * CHUNK_S), 8 * rounds, max_new_tokens)))
