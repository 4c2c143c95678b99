"""A generation request, validated once (`GenerateRequest`), and the host-side shapes it resolves to.

Every bad input is one ValueError when the request is built, before anything
is compiled. The request resolves G, the most drafts a round verifies
(`GenerateRequest.max_gamma`: a fixed gamma, a tree drafter's node count, or
the widest shape a shape policy chooses among), and this module holds the
buckets a batch is padded to (`prompt_bucket`, `default_capacity`) and the
host arrays `batching.prepare` builds from a request: padded prompts, row ids
and sampling, grammar tables.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from specdec_jax.drafters.base import Drafter
from specdec_jax.engine.shape import ShapePolicy, auto_shapes
from specdec_jax.grammar import DeviceGrammar, finished, stack_grammars
from specdec_jax.sampling import RowSampling, SamplingParams
from specdec_jax.target import TargetModel, resolve_target

AUTO = "auto"  # gamma chosen per round by a ShapePolicy (engine.shape) from this device's measured costs
MAX_NEW_TOKENS = 2**31 - 2**20  # exclusive bound: positions and lengths are int32 on device
MAX_LOGPROBS = 20  # the most alternatives `logprobs` reports per token (vLLM's and the OpenAI API's bound)
LOGPROBS_MODES = ("raw", "processed")  # the target's logits' log_softmax, or its law as the run declared it


@dataclasses.dataclass(frozen=True)
class GenerateRequest:
    """One `engine.generate` call's inputs, normalized and validated when built (ValueError).

    Attributes:
      target: the target model: anything with ``as_target() -> (TargetModel, params)``
        (`specdec_jax.target`), e.g. a `Llama` or a `LoadedModel`.
      prompts: one sequence of token ids per row (ragged, each >= 1 token); kept as tuples.
      drafter: any object of the drafter protocol (`specdec_jax.drafters.base`), or None
        for plain decoding.
      gamma: drafts per round: an int (ablations; 0 is plain decoding), or "auto": each
        round chooses among `auto_shapes` (`AUTO_GAMMAS`; a tree drafter: `tree_sizes` of its nodes) from
        this device's measured costs and each row's acceptance (`engine.shape`). None: "auto"
        for a chain drafter, a tree drafter's node count, 0 without a drafter.
      policy: a `ShapePolicy` to decide with instead of the calibrated one (implies "auto").
      sampling: one `SamplingParams` for every row, or one per row (greedy and sampled rows mix).
      max_new_tokens: each row's token budget, in [1, MAX_NEW_TOKENS); with the model's
        context length known (`TargetModel.max_positions`), the longest prompt plus it must fit.
      eos_id: a token that ends a row (kept in its output), or None.
      stop_ids: more tokens that end a row (e.g. a tokenizer's `stop_ids`).
      seed: a row's randomness depends only on (seed, its row id, each token's position).
      row_ids: one id per prompt (None: 0..B-1); the same id reproduces a row alone.
      capacity: KV slots per row (None: `default_capacity`); rows that run out stop with
        reason "capacity".
      record_top_k: > 0: the target's top-k tokens and log-probs at every emitted token.
      logprobs: None, or K in [0, MAX_LOGPROBS]: each emitted token's log-prob and the K most likely
        tokens with theirs, read from the verify pass (excludes record_top_k).
      logprobs_mode: "raw": under the target's raw law (log_softmax of its logits); "processed": under
        the law each row samples from (logit bias, penalties, temperature, filters, grammar mask).
      mesh: a `(data, model)` mesh (`specdec_jax.sharding`); None, or one device: one device.
      grammars: one `constraints.GrammarTables` for every row, or one per row (None: no
        constraint); docs/constraints.md.
      model: the target's `TargetModel` (derived). target_params: its weights (derived).
      max_gamma: G, the most drafts (a tree's nodes) a round verifies (derived).
      auto: whether a shape policy chooses each round's gamma (derived).
    """

    target: Any = dataclasses.field(repr=False)
    prompts: Sequence[Sequence[int]]
    drafter: Drafter | None = None
    gamma: int | str | None = None
    policy: ShapePolicy | None = None
    sampling: SamplingParams | Sequence[SamplingParams] = SamplingParams()
    max_new_tokens: int = 128
    eos_id: int | None = None
    stop_ids: Sequence[int] = ()
    seed: int = 0
    row_ids: Sequence[int] | None = None
    capacity: int | None = None
    record_top_k: int = 0
    logprobs: int | None = None
    logprobs_mode: str = "raw"
    mesh: Mesh | None = None
    grammars: Any = dataclasses.field(default=None, repr=False)
    model: TargetModel = dataclasses.field(init=False, repr=False, compare=False)
    target_params: Any = dataclasses.field(init=False, repr=False, compare=False)
    max_gamma: int = dataclasses.field(init=False)
    auto: bool = dataclasses.field(init=False)

    def __post_init__(self):
        put = functools.partial(object.__setattr__, self)
        model, params = resolve_target(self.target)
        put("model", model)
        put("target_params", params)
        put("prompts", tuple(tuple(map(int, p)) for p in self.prompts))
        put("stop_ids", tuple(int(t) for t in self.stop_ids))
        if not isinstance(self.sampling, SamplingParams):
            put("sampling", tuple(self.sampling))
        if self.row_ids is not None:
            put("row_ids", tuple(self.row_ids))
        put("mesh", self.mesh if self.mesh is not None and self.mesh.size > 1 else None)
        max_gamma, auto = resolve_gamma(self.drafter, self.gamma, self.policy)
        put("max_gamma", max_gamma)
        put("auto", auto)
        _check_prompts(model, self.prompts)
        _check_settings(self)
        _check_rows(self)

    @property
    def stops(self) -> tuple[int, ...]:
        """Every token that ends a row: ``stop_ids`` and ``eos_id``, sorted."""
        return tuple(sorted(set(self.stop_ids) | ({int(self.eos_id)} if self.eos_id is not None else set())))

    @property
    def recorded_top_k(self) -> int:
        """The engine's `EngineSpec.record_top_k`: ``logprobs`` where given, else ``record_top_k``."""
        return self.record_top_k if self.logprobs is None else self.logprobs

    @property
    def record_mode(self) -> str | None:
        """The engine's `EngineSpec.record_mode`: ``logprobs_mode`` with ``logprobs``, else None."""
        return None if self.logprobs is None else self.logprobs_mode

    @property
    def longest(self) -> int:
        """Tokens in the longest prompt."""
        return max(map(len, self.prompts))


def resolve_gamma(drafter: Drafter | None, gamma, policy: ShapePolicy | None) -> tuple[Any, bool]:
    """``(G, auto)``: whether a shape policy chooses each round's gamma, and G, the most drafts a round
    verifies: under a policy its widest shape (before calibration the widest of `auto_shapes`);
    else a fixed gamma (at most the drafter's ``max_drafts``), a tree drafter's node count (``gamma`` None
    or equal to it; 0 is plain decoding), or 0 without a drafter. A fixed gamma that is not an int >= 0 is
    returned for `_check_settings`."""
    tree, most = getattr(drafter, "tree", None), getattr(drafter, "max_drafts", None)
    asked = policy.max_gamma if policy is not None else gamma
    if most is not None and isinstance(asked, int) and asked > most:
        raise ValueError(f"the {drafter.name} drafter proposes at most {most} drafts a round; gamma = {asked} "
                         f"asks for more")
    if tree is not None and policy is None and gamma != AUTO:
        if gamma not in (None, 0, tree.nodes):
            raise ValueError(f"the {drafter.name} drafter proposes a tree of {tree.nodes} nodes; gamma = {gamma} "
                             f"must be left unset or equal {tree.nodes}")
        return (tree.nodes if gamma is None else gamma), False
    if not (gamma == AUTO or (gamma is None and drafter is not None) or policy is not None):
        return (0 if gamma is None else gamma), False
    if drafter is None:
        raise ValueError("gamma 'auto' (a shape policy) needs a drafter")
    if gamma not in (None, AUTO):
        raise ValueError(f"gamma = {gamma!r} and a shape policy exclude each other: pass one of them")
    return (policy.max_gamma if policy is not None else max(auto_shapes(drafter)[0])), True


def widest_gamma(drafter: Drafter | None, gamma) -> int:
    """The most drafts (tree nodes) a round of ``drafter`` at ``gamma`` (an int, "auto" or None, as
    `GenerateRequest` takes them) can verify: what a KV capacity shared by several runs is sized for."""
    return 0 if drafter is None else resolve_gamma(drafter, gamma, None)[0]


def _check_prompts(model: TargetModel, prompts: tuple[tuple[int, ...], ...]) -> None:
    """ValueError unless there are prompts, each of >= 1 token id in the vocabulary."""
    if not prompts:
        raise ValueError("no prompts given")
    for i, p in enumerate(prompts):
        if not p:
            raise ValueError(f"prompt {i} is empty (each prompt needs >= 1 token)")
        bad = [t for t in p if not 0 <= t < model.vocab_size]
        if bad:
            raise ValueError(f"prompt {i} has token id {bad[0]} outside the vocabulary [0, {model.vocab_size})")


def _check_settings(request: GenerateRequest) -> None:
    """ValueError unless gamma, the budget, the stop tokens, the capacity and record_top_k fit the model,
    the mesh its axes and the drafter the target."""
    model, gamma, vocab, longest = request.model, request.max_gamma, request.model.vocab_size, request.longest
    if not isinstance(gamma, int) or gamma < 0:
        raise ValueError(f"gamma must be an int >= 0 or 'auto', got {gamma!r}")
    if gamma > 0 and request.drafter is None:
        raise ValueError(f"gamma = {gamma} needs a drafter (use gamma 0 for plain decoding)")
    if not 1 <= request.max_new_tokens < MAX_NEW_TOKENS:
        raise ValueError(f"max_new_tokens must be in [1, {MAX_NEW_TOKENS}), got {request.max_new_tokens}")
    for t in request.stops:
        if not 0 <= t < vocab:
            raise ValueError(f"stop token id {t} is outside the vocabulary [0, {vocab})")
    if model.max_positions is not None and longest + request.max_new_tokens > model.max_positions:
        raise ValueError(
            f"the longest prompt ({longest} tokens) plus max_new_tokens ({request.max_new_tokens}) exceeds the "
            f"model's context length ({model.max_positions} positions): shorten the prompt or lower max_new_tokens")
    if request.capacity is not None and request.capacity < longest + gamma + 1:
        raise ValueError(
            f"capacity {request.capacity} is too small: the longest prompt ({longest} tokens) plus one verify pass "
            f"(gamma + 1 = {gamma + 1}) needs at least {longest + gamma + 1} slots")
    if not 0 <= request.record_top_k <= vocab:
        raise ValueError(f"record_top_k must be in [0, {vocab}], got {request.record_top_k}")
    _check_logprobs(request)
    if request.mesh is not None:
        model.check_mesh(request.mesh)
    if gamma > 0:
        request.drafter.check(model, request.mesh)


def _check_rows(request: GenerateRequest) -> None:
    """ValueError unless ``row_ids`` and a list of ``sampling`` settings have one entry per prompt, and
    every logit bias names token ids of the vocabulary."""
    num_rows = len(request.prompts)
    if request.row_ids is not None and len(request.row_ids) != num_rows:
        raise ValueError(f"row_ids must have one id per prompt ({num_rows}), got {len(request.row_ids)}")
    if not isinstance(request.sampling, SamplingParams) and len(request.sampling) != num_rows:
        raise ValueError(f"got {len(request.sampling)} SamplingParams for {num_rows} prompts")
    vocab = request.model.vocab_size
    for params in (request.sampling,) if isinstance(request.sampling, SamplingParams) else request.sampling:
        bad = [token for token, _ in params.logit_bias if token >= vocab]
        if bad:
            raise ValueError(f"logit_bias token id {bad[0]} is outside the vocabulary [0, {vocab})")


def _check_logprobs(request: GenerateRequest) -> None:
    """ValueError unless ``logprobs`` is None or in [0, MAX_LOGPROBS] (and then without record_top_k)
    and ``logprobs_mode`` is one of LOGPROBS_MODES."""
    logprobs, mode = request.logprobs, request.logprobs_mode
    if logprobs is not None and (isinstance(logprobs, bool) or not isinstance(logprobs, int)
                                 or not 0 <= logprobs <= MAX_LOGPROBS):
        raise ValueError(f"logprobs must be None or an int in [0, {MAX_LOGPROBS}], got {logprobs!r}")
    if logprobs is not None and request.record_top_k:
        raise ValueError("logprobs and record_top_k exclude each other: logprobs reports the top K itself")
    if mode not in LOGPROBS_MODES:
        raise ValueError(f"logprobs_mode must be one of {', '.join(LOGPROBS_MODES)}, got {mode!r}")


def row_ids_and_sampling(request: GenerateRequest, batch: int) -> tuple[np.ndarray, RowSampling]:
    """(i32[batch] row ids: the request's or 0..batch-1, padding rows 0; each row's sampling, padding rows
    copying row 0's)."""
    num_rows = len(request.prompts)
    ids = np.arange(batch, dtype=np.int32)
    if request.row_ids is not None:
        ids[:num_rows] = list(request.row_ids)
        ids[num_rows:] = 0
    sampling = request.sampling
    per_row = [sampling] * num_rows if isinstance(sampling, SamplingParams) else list(sampling)
    return ids, RowSampling.from_params(per_row + [per_row[0]] * (batch - num_rows), batch)


def padded_prompts(prompts: Sequence[Sequence[int]], batch: int) -> tuple[np.ndarray, np.ndarray]:
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
    """`stack_grammars`, once per set of tables (by identity: `GrammarTables` compare so), so that a bench
    that passes the same tables on every call stacks them once."""
    return stack_grammars(tables, vocab_size)


def prompt_bucket(longest_prompt: int) -> int:
    """Padded prompt width: the next power of two, at least 16 (one compile per bucket)."""
    return max(16, next_power_of_two(longest_prompt))


def default_capacity(longest_prompt: int, max_new_tokens: int, gamma: int) -> int:
    """KV slots per row: prompt bucket + max_new_tokens + gamma + 1, rounded up to a multiple of 64."""
    return round_up(prompt_bucket(longest_prompt) + max_new_tokens + gamma + 1, 64)


def next_power_of_two(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple
