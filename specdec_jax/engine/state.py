"""The engine's static settings, weights and loop state (docs/design.md section 3).

Invariant per row b: `num_tokens[b]` tokens are committed; the target cache
holds the first `num_tokens[b] - 1` of them and the newest, t0, is fed at slot
`num_tokens[b] - 1` by the next verify pass. Committing `n_emit` tokens is
`num_tokens += n_emit`: that is also the rollback.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.struct
import jax
import numpy as np
from jax.sharding import Mesh

from specdec_jax.drafters.base import Drafter, Proposal
from specdec_jax.engine.shape import ShapePolicy
from specdec_jax.grammar import DeviceGrammar
from specdec_jax.kv_cache import KVCache
from specdec_jax.metrics import Counters, Metrics
from specdec_jax.sampling import RowSampling
from specdec_jax.target import TargetModel

RUNNING, EOS, LENGTH, CAPACITY, GRAMMAR = 0, 1, 2, 3, 4  # EOS: any stop token; GRAMMAR: a whole match, nothing may follow
STOP_REASONS = {EOS: "eos", LENGTH: "length", CAPACITY: "capacity", GRAMMAR: "grammar"}


@dataclasses.dataclass(frozen=True)
class EngineSpec:
    """Static settings of a compiled generation program (hashable)."""

    target: TargetModel
    drafter: Drafter | None  # None (or gamma 0): plain decoding
    gamma: int  # drafts per round (with a policy: the most, policy.max_gamma)
    capacity: int  # T, KV slots per row
    stop_ids: tuple[int, ...] = ()  # tokens that end a row (kept in its output)
    record_top_k: int = 0  # > 0: keep the target's k most likely tokens and log-probs at every emitted token
    mesh: Mesh | None = None  # devices the state is sharded over (specdec_jax.sharding); None: one device
    policy: ShapePolicy | None = None  # None: every round drafts gamma; else the shape is chosen per round
    # "raw" | "processed": also keep each emitted token's own log-prob, it and the top record_top_k under the
    # target's raw law (log_softmax of its logits) or its processed law (`target_law`); None: neither
    record_mode: str | None = None

    def __post_init__(self):
        if self.policy is not None and self.policy.max_gamma != self.gamma:
            raise ValueError(f"the shape policy's largest gamma ({self.policy.max_gamma}) must be gamma ({self.gamma})")

    @property
    def verify_widths(self) -> tuple[int, ...]:
        """Widths the verify pass is compiled at: 1 (no row has a draft) and gamma + 1, or with a
        policy g + 1 for each of its gammas.

        A round where the drafter found nothing then costs one plain decoding step.
        Without a policy, intermediate widths were measured to add nothing for the
        n-gram drafter (its drafts are almost always gamma long) and cost a compile each.
        """
        if self.policy is not None:
            return tuple(g + 1 for g in self.policy.gammas)
        return (1,) if self.gamma == 0 else (1, self.gamma + 1)

    @property
    def buffer_len(self) -> int:
        """Length of the committed-token buffer: T committed slots + t0 + one verify run."""
        return self.capacity + self.gamma + 2

    @property
    def hidden_layers(self) -> tuple[int, ...]:
        """Target hidden states the engine keeps: exactly those the drafter reads."""
        return self.drafter.reads_hidden if self.gamma > 0 else ()


@flax.struct.dataclass
class EngineParams:
    """The weights a round reads (jit arguments, never constants)."""

    target: Any  # the target's weights, as its TargetModel.apply takes them
    drafter: Any  # the drafter's weights (Drafter.params), None for plain decoding
    grammar: DeviceGrammar | None = None  # the batch's grammar tables (docs/constraints.md); None: no row has one


@flax.struct.dataclass
class DecodeState:
    tokens: jax.Array  # i32[B,Tbuf] committed tokens (prompt, then generated)
    num_tokens: jax.Array  # i32[B] committed count; the cache holds num_tokens - 1
    prompt_lens: jax.Array  # i32[B]
    max_new: jax.Array  # i32[B] token budget per row
    done: jax.Array  # bool[B]
    stop_reason: jax.Array  # i32[B] RUNNING / EOS / LENGTH / CAPACITY / GRAMMAR
    row_ids: jax.Array  # i32[B] a row's randomness depends on (seed, row id, position) only
    key: jax.Array  # key[] from the seed
    sampling: RowSampling  # per-row sampling settings, [B] arrays
    cache: KVCache  # target cache, L x [B,Hkv,T,D] keys and L x [B,Hkv,D,T] values
    drafter_state: Any  # the drafter's own state (e.g. its KV cache)
    proposal: Proposal  # drafts for the next verify pass: i32[B,G], i32[B], f32[B,G,V] | None
    last_emit: jax.Array  # i32[B] tokens emitted by the last round (0 before the first)
    last_accepted: jax.Array  # i32[B] drafts accepted by the last round
    features: jax.Array | None  # f32[B,G+1,k,H] target hidden states (spec.hidden_layers) of the last verify inputs
    counters: Counters
    step: jax.Array  # i32[] loop iterations so far
    target_top: tuple[jax.Array, jax.Array] | None = None  # (i32, f32)[B,Tbuf,k] record_top_k's buffers
    target_chosen: jax.Array | None = None  # f32[B,Tbuf] each committed token's log-prob (with spec.record_mode)
    acceptance: jax.Array | None = None  # f32[B,G] per-row acceptance estimates (engine.shape); None without a policy
    draft_found: jax.Array | None = None  # f32[B] per-row share of rounds whose drafter found drafts (engine.shape)
    # i32[2] (draft index, verify index into policy.gammas) that every round takes, every live row verifying
    # that many drafts found or not (engine.calibration times whole rounds so); None: the policy chooses
    forced_shape: jax.Array | None = None
    grammar_state: jax.Array | None = None  # i32[B] each row's grammar state after its newest token (with EngineParams.grammar)


@dataclasses.dataclass(frozen=True)
class GenerationResult:
    tokens: list[list[int]]  # emitted token ids per prompt
    stop_reasons: list[str]  # "eos" | "length" | "capacity" | "grammar" per prompt
    metrics: Metrics
    wall_s: float  # whole call, compile included on a first call
    loop_rounds: int  # while_loop iterations
    decode_s: float  # the decoding loop alone (after prefill; its compile on a first call, output to the host)
    # record_top_k > 0: per prompt, (ids i32[n,k], log-probs f32[n,k]) of the target's law (temperature 1,
    # no filters) that each of its n emitted tokens was chosen under
    target_top: list[tuple[np.ndarray, np.ndarray]] | None = None
    # with logprobs: per prompt, f32[n] each emitted token's log-prob (target_top then holds its top
    # `logprobs` alternatives), under the law `logprobs_mode` names
    logprobs: list[np.ndarray] | None = None
    policy: ShapePolicy | None = None  # the shape policy the run decided with (gamma "auto"), else None
    # per prompt: {"rounds", "draft_tokens", "accepted_tokens", "emitted_tokens"} of that row alone (its tokens per
    # round is emitted / rounds; rows are independent, so a batch gives each row's solo counts)
    row_counts: list[dict[str, int]] | None = None
