"""`generate`, the public entry point (prepare, run the loop, unpack), and `prepare`, the batch it runs.

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
from specdec_jax.engine.round import decode_round, run_loop
from specdec_jax.engine.shape import ShapePolicy
from specdec_jax.engine.state import STOP_REASONS, GenerationResult
from specdec_jax.metrics import Metrics
from specdec_jax.sampling import SamplingParams


# Seconds of rounds per device call of the decoding loop: between calls the host sees a stop
# (Ctrl-C, SIGTERM; `specdec_jax.interrupts`). None: one call for the whole generation.
CHUNK_S: float | None = 1.0
FIRST_CHUNK_ROUNDS = 2  # the first call's rounds; later calls are sized from its time


def prepare(target, prompts: Sequence[Sequence[int]], drafter: Drafter | None = None, **options) -> Prepared:
    """`batching.prepare` (validate, bucket, place, prefill; keyword arguments as in `generate`), with
    gamma "auto" priced by this device's calibrated costs (`calibration.shape_policy`, cached on disk)."""
    return batching.prepare(target, prompts, drafter, policy_for=functools.partial(shape_policy, target, drafter),
                            **options)


def generate(
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
    python_loop: bool = False,
    mesh: Mesh | None = None,
    grammars=None,
) -> GenerationResult:
    """Speculative decoding of a ragged batch of token-id prompts.

    Args:
      target: the target model: anything with ``as_target() -> (TargetModel, params)``
        (`specdec_jax.target`), e.g. a `Llama` or a `LoadedModel`.
      prompts: one list of token ids per row (ragged lengths, each >= 1 token).
      drafter: an `NgramDrafter`, `ModelDrafter`, `oracle_drafter(...)`, any object of
        the drafter protocol (`specdec_jax.drafters.base`), or None for plain decoding.
      gamma: drafts per round (an int, for ablations), or "auto", the default with a
        drafter: each round chooses its draft length among `AUTO_GAMMAS` (0 included) and
        its verify width on device, from this device's measured costs (calibrated once
        per device, model, drafter, batch and capacity, and cached on disk;
        `engine.calibration`) and each row's running acceptance (`engine.shape`).
        gamma = 0 (the default without a drafter) is plain autoregressive decoding
        through the same code.
      policy: a `ShapePolicy` to use instead of the calibrated one (implies "auto").
      sampling: one `SamplingParams` for all rows or one per row (greedy and
        sampled rows may mix).
      max_new_tokens: per-row token budget (>= 1). With the model's context length
        known (`TargetModel.max_positions`), longest prompt + max_new_tokens must fit it.
      eos_id, stop_ids: tokens that end a row (kept in the output): `eos_id` (one id or
        None) and every id of `stop_ids` (e.g. a tokenizer's `stop_ids`).
      seed, row_ids: a row's randomness depends only on (seed, its row id, the
        position of each token; `specdec_jax.rng`), so a row's output does not depend
        on its batch neighbours. Row ids default to 0..B-1; pass the same id to
        reproduce a row alone.
      capacity: KV slots per row; default fits the prompt bucket + max_new_tokens
        + gamma + 1, rounded up to a multiple of 64. Rows that run out stop with
        reason "capacity".
      record_top_k: if > 0, also return the target's top-k tokens and log-probs
        at every emitted token (`GenerationResult.target_top`; distillation data).
      python_loop: run the same `draft_step` / `verify_step` from a Python loop
        instead of `lax.while_loop` (for debugging; identical results; `run_loop` is not
        compiled, so only the shapes' floor and prefill's memory are checked).
      mesh: a `(data, model)` mesh (`specdec_jax.sharding.make_mesh`): weights, KV
        caches and loop state are sharded over it and the same loop runs
        partitioned. The batch is padded to a multiple of the `data` axis; the
        `model` axis must divide the head counts and MLP width. None, or one
        device: the single-device path.
      grammars: grammar constraints (docs/constraints.md): one `constraints.GrammarTables`
        (`compile_constraint(Constraint(regex=...), tokenizer)`) for every row, or one per row
        (None: no constraint). Each row's output then matches its constraint: the target's
        and the drafter's laws allow only the tokens the grammar allows along each
        candidate's own path, within the row's budget; a row that reaches a whole match
        nothing may follow stops with reason "grammar".

    Returns:
      GenerationResult: emitted tokens and stop reason per row, batch metrics.
    """
    start = time.perf_counter()
    run = prepare(  # the loop is compiled, and its memory checked, before prefill runs
        target, prompts, drafter, gamma=gamma, policy=policy, sampling=sampling, max_new_tokens=max_new_tokens,
        eos_id=eos_id, stop_ids=stop_ids, seed=seed, row_ids=row_ids, capacity=capacity, record_top_k=record_top_k,
        mesh=mesh, grammars=grammars, compile_loop=not python_loop,
    )
    state = jax.block_until_ready(run.state)
    loop_start = time.perf_counter()
    if python_loop:
        while bool(jnp.any(~state.done)) and int(state.step) < max_new_tokens:
            state = decode_round(run.spec, run.params, state)
    else:
        state = run_chunks(run, state, max_new_tokens)
    tokens, num_tokens, reasons, counters, step, top = sharding.to_host(
        (state.tokens, state.num_tokens, state.stop_reason, state.counters, state.step, state.target_top))
    end = time.perf_counter()
    wall, decode = end - start, end - loop_start
    lens, num_rows = run.prompt_lens, run.num_rows
    if top is not None:
        top = [(top[0][b, lens[b] : num_tokens[b]], top[1][b, lens[b] : num_tokens[b]]) for b in range(num_rows)]
    outputs = [tokens[b, lens[b] : num_tokens[b]].tolist() for b in range(num_rows)]
    if drafter is not None:
        drafter.observe(outputs)  # after the call: no row drafts from its own future
    return GenerationResult(
        tokens=outputs,
        stop_reasons=[STOP_REASONS.get(int(r), "running") for r in reasons[:num_rows]],
        metrics=Metrics.from_counters(counters, num_rows),
        wall_s=wall,
        loop_rounds=int(step),
        decode_s=decode,
        target_top=top,
        policy=run.spec.policy,
        row_counts=[{"rounds": int(counters.rounds[b]), "draft_tokens": int(counters.drafted[b]),
                     "accepted_tokens": int(counters.accepted[b]), "emitted_tokens": int(counters.emitted[b])}
                    for b in range(num_rows)],
    )


def run_chunks(run: Prepared, state, max_new_tokens: int):
    """`run_loop` to the end in calls of about CHUNK_S seconds each (the first of FIRST_CHUNK_ROUNDS
    rounds, each next one sized from the last one's rate, at most 8 times longer), so that a
    KeyboardInterrupt reaches the caller within about a second while the rounds of a call stay on
    device. The round count of each call is a traced argument (one program for every size, the one
    `prepare` compiled and checked); a multi-host run takes process 0's sizes. Between calls only
    ``done`` and ``step`` reach the host."""
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
