"""Speculative decoding as one jitted `lax.while_loop` (DESIGN sections 2-4).

A round is two pure functions over one state pytree:

    draft_step(spec, drafter_params, state) -> state    # the drafter proposes
    verify_step(spec, target_params, state) -> state    # target pass, acceptance, commit, metrics

`run_loop` is `jax.jit` around `lax.while_loop(cond, draft_step then
verify_step)` with the state donated, so caches update in place and nothing
crosses to the host until every row is done. `generate` is the public entry
point: it validates, buckets shapes, prefills, runs the loop and unpacks.
gamma = 0 is plain autoregressive decoding through the same code. Given a
device mesh (`specdec_jax.sharding`), weights, caches and state are sharded
over it and the same program runs partitioned; output reaches the host after
the loop only.

Invariant per row b (DESIGN section 3): `num_tokens[b]` tokens are committed;
the target cache holds the first `num_tokens[b] - 1` of them and the newest,
t0, is fed at slot `num_tokens[b] - 1` by the next verify pass. Committing
`n_emit` tokens is `num_tokens += n_emit`: that is also the rollback.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Sequence
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from specdec_jax import sharding
from specdec_jax.drafters.base import VERIFY_TAG, DraftContext, Drafter, Proposal
from specdec_jax.kv_cache import KVCache
from specdec_jax.metrics import Counters, Metrics
from specdec_jax.models.llama import Llama, LlamaConfig, forward
from specdec_jax.sampling import RowSampling, SamplingParams, position_counts, process_logits, token_counts
from specdec_jax.verify import verify_greedy, verify_stochastic

RUNNING, EOS, LENGTH, CAPACITY = 0, 1, 2, 3
STOP_REASONS = {EOS: "eos", LENGTH: "length", CAPACITY: "capacity"}


@dataclasses.dataclass(frozen=True)
class EngineSpec:
    """Static settings of a compiled generation program (hashable)."""

    target: LlamaConfig
    drafter: Drafter | None  # None (or gamma 0): plain decoding
    gamma: int  # drafts per round
    capacity: int  # T, KV slots per row
    eos_id: int | None
    record_top_k: int = 0  # > 0: keep the target's k most likely tokens and log-probs at every emitted token
    mesh: Mesh | None = None  # devices the state is sharded over (specdec_jax.sharding); None: one device

    @property
    def verify_widths(self) -> tuple[int, ...]:
        """Widths the verify pass is compiled at: 1 (no row has a draft) and gamma + 1.

        A round where the drafter found nothing then costs one plain decoding step.
        Intermediate widths were measured to add nothing for the n-gram drafter
        (its drafts are almost always gamma long) and cost a compile each.
        """
        return (1,) if self.gamma == 0 else (1, self.gamma + 1)

    @property
    def buffer_len(self) -> int:
        """Length of the committed-token buffer: T committed slots + t0 + one verify run."""
        return self.capacity + self.gamma + 2


@flax.struct.dataclass
class DecodeState:
    tokens: jax.Array  # i32[B,Tbuf] committed tokens (prompt, then generated)
    num_tokens: jax.Array  # i32[B] committed count; the cache holds num_tokens - 1
    prompt_lens: jax.Array  # i32[B]
    max_new: jax.Array  # i32[B] token budget per row
    done: jax.Array  # bool[B]
    stop_reason: jax.Array  # i32[B] RUNNING / EOS / LENGTH / CAPACITY
    row_ids: jax.Array  # i32[B] a row's randomness depends on (seed, row id, position) only
    key: jax.Array  # key[] from the seed
    sampling: RowSampling  # per-row sampling settings, [B] arrays
    cache: KVCache  # target cache, [L,B,T,Hkv,D]
    drafter_state: Any  # the drafter's own state (e.g. its KV cache)
    proposal: Proposal  # drafts for the next verify pass: i32[B,G], i32[B], f32[B,G,V] | None
    counters: Counters
    step: jax.Array  # i32[] loop iterations so far
    target_top: tuple[jax.Array, jax.Array] | None = None  # (i32, f32)[B,Tbuf,k] record_top_k's buffers


@dataclasses.dataclass(frozen=True)
class GenerationResult:
    tokens: list[list[int]]  # emitted token ids per prompt
    stop_reasons: list[str]  # "eos" | "length" | "capacity" per prompt
    metrics: Metrics
    wall_s: float  # whole call, compile included on a first call
    loop_rounds: int  # while_loop iterations
    # record_top_k > 0: per prompt, (ids i32[n,k], log-probs f32[n,k]) of the target's law (temperature 1,
    # no filters) that each of its n emitted tokens was chosen under
    target_top: list[tuple[np.ndarray, np.ndarray]] | None = None


def row_keys(state: DecodeState) -> jax.Array:
    """key[B]: fold_in(fold_in(seed key, row id), committed count), fresh every round."""
    fold = lambda row, pos: jax.random.fold_in(jax.random.fold_in(state.key, row), pos)  # noqa: E731
    return jax.vmap(fold)(state.row_ids, state.num_tokens)


@functools.partial(jax.jit, static_argnums=0)
def draft_step(spec: EngineSpec, drafter_params, state: DecodeState) -> DecodeState:
    """The drafter proposes up to gamma tokens per live row, capped by budget and capacity."""
    if spec.gamma == 0:
        return state
    ctx = DraftContext(state.tokens, state.num_tokens, row_keys(state), state.sampling)
    proposal, drafter_state = spec.drafter.propose(drafter_params, state.drafter_state, ctx, spec.gamma)
    generated = state.num_tokens - state.prompt_lens
    # Drafts past the budget are never emitted; drafts past slot T-1 could not be verified.
    room = jnp.minimum(state.max_new - generated - 1, spec.capacity - state.num_tokens)
    num_draft = jnp.where(state.done, 0, jnp.clip(proposal.num_draft, 0, jnp.maximum(room, 0)))
    return state.replace(proposal=proposal._replace(num_draft=num_draft.astype(jnp.int32)), drafter_state=drafter_state)


def target_pass(spec: EngineSpec, target_params, inputs, cache: KVCache, max_draft):
    """``(logits f32[B,G+1,V], cache, width index i32[])`` of ``inputs = [t0, drafts]: i32[B,G+1]``,
    run at the narrowest of ``spec.verify_widths`` that is > ``max_draft`` (the most drafts
    any row has); the logits of columns past that width are zeros and are never read."""
    def at_width(width: int):
        def run(cache: KVCache):
            logits, cache = forward(spec.target, target_params, inputs[:, :width], cache)
            return jnp.pad(logits, ((0, 0), (0, inputs.shape[1] - width), (0, 0))), cache
        return run

    widths = spec.verify_widths
    if len(widths) == 1:
        return (*at_width(widths[0])(cache), jnp.zeros((), jnp.int32))
    branch = jnp.searchsorted(jnp.asarray(widths), max_draft + 1).astype(jnp.int32)
    return (*jax.lax.switch(branch, [at_width(w) for w in widths], cache), branch)


@functools.partial(jax.jit, static_argnums=0)
def verify_step(spec: EngineSpec, target_params, state: DecodeState) -> DecodeState:
    """One target pass over [t0, drafts], verification, commit, stop reasons and metrics."""
    drafts, num_draft, draft_probs = state.proposal
    t0 = jnp.take_along_axis(state.tokens, state.num_tokens[:, None] - 1, axis=1)
    inputs = jnp.concatenate([t0, drafts], axis=1)  # i32[B,G+1]
    logits, cache, width_index = target_pass(spec, target_params, inputs, state.cache, jnp.max(num_draft))
    counts = None
    if state.sampling.use_penalties:
        history = token_counts(state.tokens, state.num_tokens, spec.target.vocab_size)
        counts = position_counts(history, drafts)
    target_probs = process_logits(logits, state.sampling, counts)  # f32[B,G+1,V]
    budget = state.max_new - (state.num_tokens - state.prompt_lens)
    if state.sampling.any_sampled:
        keys = jax.vmap(lambda k: jax.random.fold_in(k, VERIFY_TAG))(row_keys(state))
        result = verify_stochastic(
            keys, drafts, draft_probs, target_probs, num_draft, eos_id=spec.eos_id, budget=budget
        )
    else:
        result = verify_greedy(
            drafts, jnp.argmax(target_probs, axis=-1), num_draft, eos_id=spec.eos_id, budget=budget
        )
    live = ~state.done
    n_emit = jnp.where(live, result.n_emit, 0)

    positions = state.num_tokens[:, None] + jnp.arange(spec.gamma + 1)[None, :]
    positions = jnp.where(jnp.arange(spec.gamma + 1)[None, :] < n_emit[:, None], positions, spec.buffer_len)
    rows = jnp.arange(inputs.shape[0])[:, None]
    tokens = state.tokens.at[rows, positions].set(result.tokens, mode="drop")
    num_tokens = state.num_tokens + n_emit
    target_top = state.target_top
    if spec.record_top_k:
        logp, ids = jax.lax.top_k(jax.nn.log_softmax(logits, axis=-1), spec.record_top_k)  # [B,G+1,k]
        target_top = (state.target_top[0].at[rows, positions].set(ids, mode="drop"),
                      state.target_top[1].at[rows, positions].set(logp, mode="drop"))

    last = jnp.take_along_axis(tokens, num_tokens[:, None] - 1, axis=1)[:, 0]
    hit_eos = live & (last == spec.eos_id) if spec.eos_id is not None else jnp.zeros_like(live)
    hit_length = live & (num_tokens - state.prompt_lens >= state.max_new)
    hit_capacity = live & (num_tokens - 1 >= spec.capacity)  # no slot left for the next t0
    reason = jnp.select([hit_eos, hit_length, hit_capacity], [EOS, LENGTH, CAPACITY], state.stop_reason)
    return state.replace(
        tokens=tokens,
        num_tokens=num_tokens,
        cache=cache.with_lengths(num_tokens - 1),
        done=state.done | hit_eos | hit_length | hit_capacity,
        stop_reason=reason.astype(jnp.int32),
        counters=state.counters.add_round(live, num_draft, result.n_accepted, n_emit, width_index),
        step=state.step + 1,
        target_top=target_top,
    )


def decode_round(spec: EngineSpec, target_params, drafter_params, state: DecodeState) -> DecodeState:
    """One round: the loop body, also driven step by step by the Python debug path."""
    return verify_step(spec, target_params, draft_step(spec, drafter_params, state))


@functools.partial(jax.jit, static_argnums=0, donate_argnums=3)
def run_loop(spec: EngineSpec, target_params, drafter_params, state: DecodeState) -> DecodeState:
    """Rounds until every row is done; each live row emits >= 1 token a round, so at most max(max_new)."""

    def cond(s: DecodeState):
        # Some row is still running, and the round limit (a safety net) is not reached.
        return jnp.any(~s.done) & (s.step < jnp.max(s.max_new))

    return jax.lax.while_loop(cond, lambda s: decode_round(spec, target_params, drafter_params, s), state)


@functools.partial(jax.jit, static_argnums=0)
def prefill(spec: EngineSpec, target_params, drafter_params, prompts, prompt_lens, max_new, live, row_ids,
            sampling: RowSampling, key) -> DecodeState:
    """Writes padded prompts i32[B,P] into the caches in one pass; lengths = prompt_lens - 1."""
    batch = prompts.shape[0]
    width = min(prompts.shape[1], spec.buffer_len)  # a bucket wider than the buffer is padding past it
    tokens = jnp.zeros((batch, spec.buffer_len), jnp.int32).at[:, :width].set(prompts[:, :width])
    cache = spec.target.init_cache(batch, spec.capacity)
    _, cache = forward(spec.target, target_params, prompts, cache, compute_logits=False)
    drafter_state = None
    if spec.gamma > 0:
        drafter_state = spec.drafter.init(drafter_params, prompts, prompt_lens, spec.capacity)
    state = DecodeState(
        tokens=tokens,
        num_tokens=prompt_lens,
        prompt_lens=prompt_lens,
        max_new=max_new,
        done=~live,
        stop_reason=jnp.zeros((batch,), jnp.int32),
        row_ids=row_ids,
        key=key,
        sampling=sampling,
        cache=cache.with_lengths(prompt_lens - 1),
        drafter_state=drafter_state,
        proposal=Proposal(jnp.zeros((batch, spec.gamma), jnp.int32), jnp.zeros((batch,), jnp.int32), None),
        counters=Counters.zeros(batch, spec.gamma, len(spec.verify_widths)),
        step=jnp.zeros((), jnp.int32),
        target_top=(jnp.zeros((batch, spec.buffer_len, spec.record_top_k), jnp.int32),
                    jnp.zeros((batch, spec.buffer_len, spec.record_top_k), jnp.float32))
        if spec.record_top_k else None,
    )
    if spec.gamma > 0:  # the proposal's structure (with or without q) is the drafter's
        shapes = jax.eval_shape(lambda s: draft_step(spec, drafter_params, s).proposal, state)
        state = state.replace(proposal=jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), shapes))
    return sharding.constrain_state(state, spec.mesh)


@dataclasses.dataclass(frozen=True)
class Prepared:
    """A validated, bucketed, prefilled batch: what `generate` runs the loop on."""

    spec: EngineSpec
    params: Any  # target weights
    drafter_params: Any
    state: DecodeState  # right after prefill
    prompt_lens: np.ndarray  # i32[B] (padding rows: 1)
    num_rows: int  # real prompts (B is bucketed up to a power of two)


def prepare(
    target,
    prompts: Sequence[Sequence[int]],
    drafter: Drafter | None = None,
    *,
    gamma: int | None = None,
    sampling: SamplingParams | Sequence[SamplingParams] = SamplingParams(),
    max_new_tokens: int = 128,
    eos_id: int | None = None,
    seed: int = 0,
    row_ids: Sequence[int] | None = None,
    capacity: int | None = None,
    record_top_k: int = 0,
    mesh: Mesh | None = None,
) -> Prepared:
    """Validates the inputs, buckets shapes, places them on the mesh and prefills; arguments as in `generate`."""
    model = target if isinstance(target, Llama) else target.model
    config, params = model.config, model.params()
    gamma = (0 if drafter is None else 4) if gamma is None else gamma
    prompts = [list(map(int, p)) for p in prompts]
    mesh = mesh if mesh is not None and mesh.size > 1 else None
    _validate(config, prompts, drafter, gamma, max_new_tokens, eos_id, capacity, mesh)
    num_rows = len(prompts)
    data = 1 if mesh is None else mesh.shape[sharding.DATA]
    batch = _round_up(_next_power_of_two(num_rows), data)  # the data axis divides the batch
    prompt_width = prompt_bucket(max(map(len, prompts)))
    capacity = capacity or default_capacity(max(map(len, prompts)), max_new_tokens, gamma)
    padded = np.zeros((batch, prompt_width), np.int32)
    lens = np.ones((batch,), np.int32)
    for b, p in enumerate(prompts):
        padded[b, : len(p)] = p
        lens[b] = len(p)
    ids = np.arange(batch, dtype=np.int32) if row_ids is None else np.array(list(row_ids) + [0] * (batch - num_rows), np.int32)
    if len(ids) != batch:
        raise ValueError(f"row_ids must have one id per prompt ({num_rows}), got {len(ids) - batch + num_rows}")
    per_row = [sampling] * num_rows if isinstance(sampling, SamplingParams) else list(sampling)
    if len(per_row) != num_rows:
        raise ValueError(f"got {len(per_row)} SamplingParams for {num_rows} prompts")
    rows = RowSampling.from_params(per_row + [per_row[0]] * (batch - num_rows), batch)

    if not 0 <= record_top_k <= config.vocab_size:
        raise ValueError(f"record_top_k must be in [0, {config.vocab_size}], got {record_top_k}")
    spec = EngineSpec(config, drafter if gamma > 0 else None, gamma, capacity, eos_id, record_top_k, mesh)
    drafter_params = drafter.params if gamma > 0 else None
    inputs = (padded, lens, np.full((batch,), max_new_tokens, np.int32), np.arange(batch) < num_rows, ids, rows,
              jax.random.key(seed))
    if mesh is not None:
        params, drafter_params = sharding.shard_params((params, drafter_params), mesh)
        inputs = sharding.shard_state(inputs, mesh)
    state = prefill(spec, params, drafter_params, *inputs)
    return Prepared(spec, params, drafter_params, state, lens, num_rows)


def generate(
    target,
    prompts: Sequence[Sequence[int]],
    drafter: Drafter | None = None,
    *,
    gamma: int | None = None,
    sampling: SamplingParams | Sequence[SamplingParams] = SamplingParams(),
    max_new_tokens: int = 128,
    eos_id: int | None = None,
    seed: int = 0,
    row_ids: Sequence[int] | None = None,
    capacity: int | None = None,
    record_top_k: int = 0,
    python_loop: bool = False,
    mesh: Mesh | None = None,
) -> GenerationResult:
    """Speculative decoding of a ragged batch of token-id prompts.

    Args:
      target: the target model: a `Llama`, or anything with a `.model` that is one
        (e.g. `LoadedModel`).
      prompts: one list of token ids per row (ragged lengths, each >= 1 token).
      drafter: an `NgramDrafter`, `ModelDrafter`, `oracle_drafter(...)`, or None
        for plain decoding.
      gamma: drafts per round; default 4 with a drafter, 0 without. gamma = 0 is
        plain autoregressive decoding through the same code.
      sampling: one `SamplingParams` for all rows or one per row (greedy and
        sampled rows may mix).
      max_new_tokens: per-row token budget (>= 1).
      eos_id: token that ends a row (kept in the output), or None.
      seed, row_ids: a row's randomness depends only on (seed, its row id, its
        position), so a row's output does not depend on its batch neighbours.
        Row ids default to 0..B-1; pass the same id to reproduce a row alone.
      capacity: KV slots per row; default fits the prompt bucket + max_new_tokens
        + gamma + 1, rounded up to a multiple of 64. Rows that run out stop with
        reason "capacity".
      record_top_k: if > 0, also return the target's top-k tokens and log-probs
        at every emitted token (`GenerationResult.target_top`; distillation data).
      python_loop: run the same `draft_step` / `verify_step` from a Python loop
        instead of `lax.while_loop` (for debugging; identical results).
      mesh: a `(data, model)` mesh (`specdec_jax.sharding.make_mesh`): weights, KV
        caches and loop state are sharded over it and the same loop runs
        partitioned. The batch is padded to a multiple of the `data` axis; the
        `model` axis must divide the head counts and MLP width. None, or one
        device: the single-device path.

    Returns:
      GenerationResult: emitted tokens and stop reason per row, batch metrics.
    """
    start = time.perf_counter()
    run = prepare(
        target, prompts, drafter, gamma=gamma, sampling=sampling, max_new_tokens=max_new_tokens, eos_id=eos_id,
        seed=seed, row_ids=row_ids, capacity=capacity, record_top_k=record_top_k, mesh=mesh,
    )
    spec, params, drafter_params, state = run.spec, run.params, run.drafter_params, run.state
    if python_loop:
        while bool(jnp.any(~state.done)) and int(state.step) < max_new_tokens:
            state = decode_round(spec, params, drafter_params, state)
    else:
        state = run_loop(spec, params, drafter_params, state)
    tokens, num_tokens, reasons, counters, step, top = sharding.to_host(
        (state.tokens, state.num_tokens, state.stop_reason, state.counters, state.step, state.target_top))
    wall = time.perf_counter() - start
    lens, num_rows = run.prompt_lens, run.num_rows
    if top is not None:
        top = [(top[0][b, lens[b] : num_tokens[b]], top[1][b, lens[b] : num_tokens[b]]) for b in range(num_rows)]
    return GenerationResult(
        tokens=[tokens[b, lens[b] : num_tokens[b]].tolist() for b in range(num_rows)],
        stop_reasons=[STOP_REASONS.get(int(r), "running") for r in reasons[:num_rows]],
        metrics=Metrics.from_counters(counters, num_rows),
        wall_s=wall,
        loop_rounds=int(step),
        target_top=top,
    )


def _validate(config: LlamaConfig, prompts, drafter, gamma, max_new_tokens, eos_id, capacity, mesh) -> None:
    """Every bad input raises ValueError here, before anything is compiled."""
    if not prompts:
        raise ValueError("no prompts given")
    for i, p in enumerate(prompts):
        if not p:
            raise ValueError(f"prompt {i} is empty (each prompt needs >= 1 token)")
        bad = [t for t in p if not 0 <= t < config.vocab_size]
        if bad:
            raise ValueError(f"prompt {i} has token id {bad[0]} outside the vocabulary [0, {config.vocab_size})")
    if gamma < 0:
        raise ValueError(f"gamma must be >= 0, got {gamma}")
    if gamma > 0 and drafter is None:
        raise ValueError(f"gamma = {gamma} needs a drafter (use gamma 0 for plain decoding)")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if eos_id is not None and not 0 <= eos_id < config.vocab_size:
        raise ValueError(f"eos_id {eos_id} is outside the vocabulary [0, {config.vocab_size})")
    longest = max(map(len, prompts))
    if capacity is not None and capacity < longest + gamma + 1:
        raise ValueError(
            f"capacity {capacity} is too small: the longest prompt ({longest} tokens) plus one verify pass "
            f"(gamma + 1 = {gamma + 1}) needs at least {longest + gamma + 1} slots"
        )
    draft_config = getattr(drafter, "config", None)
    if gamma > 0 and draft_config is not None and draft_config.vocab_size != config.vocab_size:
        raise ValueError(
            f"the draft model's vocabulary ({draft_config.vocab_size}) differs from the target's ({config.vocab_size})"
        )
    if mesh is not None:
        sharding.check_model_axis(mesh, config, "the target")
        if gamma > 0 and draft_config is not None:
            sharding.check_model_axis(mesh, draft_config, "the draft model")


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
