"""Logits -> processed, normalized probability law (docs/design.md section 6).

One function, `process_logits`, turns raw logits into the law a decoder samples
from. The target's `p` and the drafter's `q` both go through it, so the
exactness claim of speculative decoding holds for the target decoder *after*
these transforms. Order (as HF transformers):

    logit bias -> penalties -> temperature -> top-k -> top-p -> min-p -> softmax

Temperature 0 means greedy: the law is a one-hot at the argmax of the penalized
logits. A batch may mix greedy and sampled rows.

Penalties follow the semantics users know: the repetition penalty (CTRL, as in
transformers) counts the whole context, prompt and generated tokens; presence
and frequency penalties (vLLM, the OpenAI API) count generated tokens only.
`PenaltyCounts` carries both counts.

Per-row settings live in `RowSampling` as arrays; its static flags (computed on
the host) say which transforms any sampled row uses, so a transform nobody in
the batch uses is not compiled in (e.g. no vocab sort without top-k / top-p).
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Mapping, Sequence
from typing import NamedTuple

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np


def finite32(x: float) -> bool:
    """``x`` is finite in float32 (1e39 is finite in Python but inf on device)."""
    return math.isfinite(x) and abs(x) <= float(np.finfo(np.float32).max)


def _float_or_text(text: str) -> float | str:
    """``text`` as a float where it is one ("-inf", "2.5"), else itself (refused by the caller)."""
    try:
        return float(text)
    except ValueError:
        return text


def logit_bias_pairs(bias) -> tuple[tuple[int, float], ...]:
    """A logit bias ({id: bias}, or (id, bias) pairs; ids and biases may be strings, as JSON keys and
    its "-inf" are) as pairs sorted by id; ValueError for an id that is not an int >= 0, an id given twice, or a bias
    that is NaN, +inf or beyond float32 (-inf is a ban)."""
    items = list(bias.items() if isinstance(bias, Mapping) else bias)
    pairs = {}
    for item in items:
        if isinstance(item, (str, bytes)) or not isinstance(item, Sequence) or len(item) != 2:
            raise ValueError(f"logit_bias must map token ids to biases, got {bias!r}")
        token, value = item
        if isinstance(token, str) and token.strip().isdigit():
            token = int(token)
        if isinstance(value, str):  # "-inf": how JSON, which has no infinity, carries a ban
            value = _float_or_text(value)
        if not isinstance(token, numbers.Integral) or isinstance(token, bool) or token < 0:
            raise ValueError(f"logit_bias: token ids must be ints >= 0, got {token!r}")
        if not isinstance(value, numbers.Real) or isinstance(value, bool) or not (
                value == -math.inf or abs(value) < 2**128 and finite32(float(value))):
            raise ValueError(f"logit_bias: the bias of token {token} must be finite in float32 or -inf, got {value!r}")
        if int(token) in pairs:
            raise ValueError(f"logit_bias: token {token} is given twice")
        pairs[int(token)] = float(value)
    return tuple(sorted(pairs.items()))


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """Sampling settings of one row (hashable, so usable as a static argument).

    temperature: 0 means greedy (argmax after penalties); > 0 divides logits.
    top_k: keep the k highest logits; 0 = off.
    top_p: keep the smallest set of top tokens whose mass is >= top_p; 1 = off.
    min_p: keep tokens with prob >= min_p * max prob; 0 = off.
    repetition_penalty: CTRL/HF penalty on tokens already in the context (prompt and
      generated); 1 = off.
    presence_penalty: subtracted once from the logit of every token generated so far.
    frequency_penalty: subtracted once per occurrence of a token generated so far.
    logit_bias: ((token id, bias), ...) added to the raw logits before everything else; -inf bans
      the token. Given as a mapping {id: bias} or pairs; kept as pairs sorted by id (hashable).
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple = ()  # tuple[tuple[int, float], ...]; bare `tuple` so a YAML mapping passes `typed.coerce`

    def __post_init__(self):
        object.__setattr__(self, "logit_bias", logit_bias_pairs(self.logit_bias))
        is_int = isinstance(self.top_k, numbers.Integral) and not isinstance(self.top_k, bool)
        finite_temperature = self.temperature >= 0 and finite32(self.temperature)
        checks = (
            ("temperature", finite_temperature, "finite in float32 and >= 0"),
            ("top_k", is_int and self.top_k >= 0, "an int >= 0"),
            ("top_p", 0 < self.top_p <= 1, "in (0, 1]"),
            ("min_p", 0 <= self.min_p <= 1, "in [0, 1]"),
            (
                "repetition_penalty",
                self.repetition_penalty > 0 and finite32(self.repetition_penalty),
                "finite in float32 and > 0",
            ),
            ("presence_penalty", finite32(self.presence_penalty), "finite in float32"),
            ("frequency_penalty", finite32(self.frequency_penalty), "finite in float32"),
        )
        for name, ok, requirement in checks:
            if not ok:
                raise ValueError(f"{name} must be {requirement}, got {getattr(self, name)!r}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0

    @property
    def has_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1
            or self.presence_penalty != 0
            or self.frequency_penalty != 0
        )


@flax.struct.dataclass
class RowSampling:
    """Per-row sampling settings of a batch, as a pytree of arrays.

    The static flags are upper bounds computed on the host by `from_params`:
    a transform whose flag is False is left out of the compiled program; where
    it is True, rows that do not use it (top_k 0, top_p 1, min_p 0, penalties
    neutral) pass through it unchanged. The top-k / top-p / min-p flags only
    consider sampled rows, since greedy rows ignore those settings.
    """

    temperature: jax.Array  # f32[B], 0 = greedy
    top_k: jax.Array  # i32[B], 0 = off
    top_p: jax.Array  # f32[B], 1 = off
    min_p: jax.Array  # f32[B], 0 = off
    repetition_penalty: jax.Array  # f32[B], 1 = off
    presence_penalty: jax.Array  # f32[B], 0 = off
    frequency_penalty: jax.Array  # f32[B], 0 = off
    use_top_k: bool = flax.struct.field(pytree_node=False)
    use_top_p: bool = flax.struct.field(pytree_node=False)
    use_min_p: bool = flax.struct.field(pytree_node=False)
    use_penalties: bool = flax.struct.field(pytree_node=False)
    any_sampled: bool = flax.struct.field(pytree_node=False)
    # Each row's logit bias as K (id, bias) pairs, padded with (0, 0.0): i32[B,K], f32[B,K]; None when
    # no row has one (nothing compiled in).
    bias_ids: jax.Array | None = None
    bias: jax.Array | None = None

    @classmethod
    def from_params(
        cls, params: SamplingParams | Sequence[SamplingParams], batch_size: int
    ) -> RowSampling:
        """Build from one `SamplingParams` (broadcast) or one per row."""
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size!r}")
        if isinstance(params, SamplingParams):
            params = [params] * batch_size
        params = list(params)
        if len(params) != batch_size:
            raise ValueError(f"got {len(params)} SamplingParams for batch_size {batch_size}")
        sampled = [p for p in params if not p.is_greedy]

        def column(name, dtype):
            return jnp.asarray(np.array([getattr(p, name) for p in params], dtype=dtype))

        return cls(
            temperature=column("temperature", np.float32),
            top_k=column("top_k", np.int32),
            top_p=column("top_p", np.float32),
            min_p=column("min_p", np.float32),
            repetition_penalty=column("repetition_penalty", np.float32),
            presence_penalty=column("presence_penalty", np.float32),
            frequency_penalty=column("frequency_penalty", np.float32),
            use_top_k=any(p.top_k > 0 for p in sampled),
            use_top_p=any(p.top_p < 1 for p in sampled),
            use_min_p=any(p.min_p > 0 for p in sampled),
            use_penalties=any(p.has_penalties for p in params),
            any_sampled=bool(sampled),
            **_bias_columns(params),
        )

    def take(self, ids: jax.Array, vocab_size: int) -> RowSampling:
        """These settings over a reduced vocabulary, the target ids ``ids`` i32[Vo] of V = ``vocab_size``:
        each bias moved to its id's index in ``ids`` (dropped where ``ids`` lacks the id)."""
        if self.bias_ids is None:
            return self
        index = jnp.full((vocab_size,), -1, jnp.int32).at[ids].set(jnp.arange(ids.shape[0], dtype=jnp.int32))
        moved = index[self.bias_ids]  # i32[B,K], -1 outside the reduced vocabulary
        return self.replace(bias_ids=jnp.maximum(moved, 0), bias=jnp.where(moved >= 0, self.bias, 0.0))


def _bias_columns(params: Sequence[SamplingParams]) -> dict:
    """RowSampling's ``bias_ids`` i32[B,K] and ``bias`` f32[B,K] (K the most pairs of a row), or {}."""
    width = max(len(p.logit_bias) for p in params)
    if width == 0:
        return {}
    ids, bias = np.zeros((len(params), width), np.int32), np.zeros((len(params), width), np.float32)
    for row, p in enumerate(params):
        for column, (token, value) in enumerate(p.logit_bias):
            ids[row, column], bias[row, column] = token, value
    return {"bias_ids": jnp.asarray(ids), "bias": jnp.asarray(bias)}


class PenaltyCounts(NamedTuple):
    """How often each token occurs in what a position conditions on; arrays f32[B,V] or f32[B,S,V]."""

    context: jax.Array  # prompt + generated tokens (+ candidates before the position): repetition penalty
    generated: jax.Array  # generated tokens only (+ candidates): presence and frequency penalties

    @classmethod
    def of_history(cls, tokens: jax.Array, num_tokens: jax.Array, prompt_lens: jax.Array,
                   vocab_size: int) -> PenaltyCounts:
        """f32[B,V] counts of the committed ``tokens[b, :num_tokens[b]]`` i32[B,Tbuf], whose first
        ``prompt_lens[b]`` are the prompt."""
        return cls(token_counts(tokens, num_tokens, vocab_size),
                   token_counts(tokens, num_tokens, vocab_size, start=prompt_lens))

    def at_positions(self, drafts: jax.Array, ancestors: jax.Array | None = None) -> PenaltyCounts:
        """f32[B,S,V] counts of a verify pass over [t0, drafts i32[B,S-1]] (`position_counts`)."""
        return PenaltyCounts(position_counts(self.context, drafts, ancestors),
                             position_counts(self.generated, drafts, ancestors))

    def add(self, ids: jax.Array) -> PenaltyCounts:
        """One more occurrence of token ``ids[b]`` i32[B] in both counts (f32[B,V] counts)."""
        batch_index = jnp.arange(ids.shape[0])
        return PenaltyCounts(self.context.at[batch_index, ids].add(1.0),
                             self.generated.at[batch_index, ids].add(1.0))

    def take(self, ids: jax.Array) -> PenaltyCounts:
        """The counts of the tokens ``ids`` i32[Vo] only (a reduced draft vocabulary), f32[B,Vo]."""
        return PenaltyCounts(self.context[:, ids], self.generated[:, ids])


def first_argmax(x: jax.Array) -> jax.Array:
    """i32[...]: the first index of the largest entry along the last axis, as ``jnp.argmax``
    (NaN aside). Computed as a max, then the least index holding it: two plain reductions, where
    XLA CPU's one-pass argmax (a variadic reduce) is slower (docs/design.md section 6)."""
    top = jnp.max(x, axis=-1, keepdims=True)
    index = jax.lax.broadcasted_iota(jnp.int32, x.shape, x.ndim - 1)
    return jnp.min(jnp.where(x == top, index, x.shape[-1] - 1), axis=-1)


def penalize(logits: jax.Array, sampling: RowSampling, counts: PenaltyCounts | None = None) -> jax.Array:
    """f32 logits plus each row's logit bias, then after the repetition, presence and frequency
    penalties (the first steps of `process_logits`; its argmax is a greedy row's token); arguments
    as there."""
    x = add_bias(logits.astype(jnp.float32), sampling)
    if not sampling.use_penalties:
        return x
    if counts is None:
        raise ValueError("rows use penalties, so process_logits needs counts")
    rp = _per_row(sampling.repetition_penalty, x.ndim)
    x = jnp.where(counts.context > 0, jnp.where(x > 0, x / rp, x * rp), x)
    return (x - _per_row(sampling.presence_penalty, x.ndim) * (counts.generated > 0)
            - _per_row(sampling.frequency_penalty, x.ndim) * counts.generated)


def add_bias(x: jax.Array, sampling: RowSampling) -> jax.Array:
    """``x`` f32[B,...,V] plus each row's logit bias (``sampling.bias`` at ``sampling.bias_ids``)."""
    if sampling.bias_ids is None:
        return x
    batch = x.shape[0]
    dense = jnp.zeros((batch, x.shape[-1]), jnp.float32).at[jnp.arange(batch)[:, None], sampling.bias_ids].add(
        sampling.bias, mode="drop")  # f32[B,V]; ids past V (a bias id the caller did not check) dropped
    return x + dense.reshape((batch,) + (1,) * (x.ndim - 2) + (x.shape[-1],))


def _per_row(a: jax.Array, ndim: int) -> jax.Array:
    """[B] -> [B,1,...,1] (``ndim`` axes), broadcasting against logits."""
    return a.reshape(a.shape + (1,) * (ndim - 1))


def process_logits(
    logits: jax.Array, sampling: RowSampling, counts: PenaltyCounts | None = None
) -> jax.Array:
    """Turn logits into the processed law; each row sums to 1.

    Args:
      logits: f32[B,S,V] (any float dtype; computed in f32). Middle axes are
        free: f32[B,V] works too, with `counts` of the same shape.
      sampling: per-row settings, `RowSampling` with batch B.
      counts: `PenaltyCounts` of arrays shaped like `logits`: how often each
        token occurs in the context (and among generated tokens) that position
        s conditions on. Needed only when `sampling.use_penalties`.

    Returns:
      f32[B,S,V] probabilities. Masked tokens are exactly 0. Greedy rows
      (temperature 0) are a one-hot at the first argmax of the penalized logits.

    Tie rules: top-k keeps every token whose logit equals the k-th largest, and
    top-p likewise keeps every token tied with the last token it needs, so a tie
    at a threshold can keep more than k tokens / more mass than needed. This
    makes the mask a function of the values alone, independent of sort order.
    """
    x = penalize(logits, sampling, counts)
    greedy = jax.nn.one_hot(first_argmax(x), x.shape[-1], dtype=jnp.float32)
    if not sampling.any_sampled:
        return greedy

    # Shift so the max is 0 before dividing: tiny temperatures then underflow
    # to -inf (probability 0) instead of overflowing to inf - inf = nan.
    is_greedy = _per_row(sampling.temperature == 0, x.ndim)
    x = (x - jnp.max(x, axis=-1, keepdims=True)) / jnp.where(
        is_greedy, 1.0, _per_row(sampling.temperature, x.ndim)
    )
    x = _top_k_top_p(x, sampling)
    if sampling.use_min_p:
        # The top token survives top-k and top-p and x's max is 0, so
        # exp(x) = prob / max prob.
        x = jnp.where(jnp.exp(x) >= _per_row(sampling.min_p, x.ndim), x, -jnp.inf)

    return jnp.where(is_greedy, greedy, jax.nn.softmax(x, axis=-1))


def _top_k_top_p(x: jax.Array, sampling: RowSampling) -> jax.Array:
    """``x`` f32[B,S,V] (tempered logits, max 0) with -inf outside each row's top-k and top-p sets
    (the tie rules of `process_logits`); unchanged when no row uses either."""
    if not (sampling.use_top_k or sampling.use_top_p):
        return x
    vocab = x.shape[-1]
    desc = jnp.sort(x, axis=-1, descending=True)  # f32[B,S,V]
    index_shape = desc.shape[:-1] + (1,)

    def nth_largest(n):  # n: i32[B,S,1] (1-based) -> f32[B,S,1]
        return jnp.take_along_axis(desc, jnp.clip(n - 1, 0, vocab - 1), axis=-1)

    if sampling.use_top_k:
        k = _per_row(sampling.top_k, x.ndim)
        kth = nth_largest(jnp.broadcast_to(k, index_shape))
        x = jnp.where((k <= 0) | (x >= kth), x, -jnp.inf)
        desc = jnp.where((k <= 0) | (desc >= kth), desc, -jnp.inf)

    if sampling.use_top_p:
        top_p = _per_row(sampling.top_p, x.ndim)
        sorted_probs = jax.nn.softmax(desc, axis=-1)
        mass_before = jnp.cumsum(sorted_probs, axis=-1) - sorted_probs
        n_keep = jnp.sum(mass_before < top_p, axis=-1, keepdims=True)  # >= 1
        # top_p == 1 must keep everything even where the f32 cumsum reaches
        # 1 before the tail does.
        x = jnp.where((top_p >= 1) | (x >= nth_largest(n_keep)), x, -jnp.inf)
    return x


def token_counts(tokens: jax.Array, length: jax.Array, vocab_size: int, start: jax.Array | None = None) -> jax.Array:
    """Occurrences of each token in tokens[b, start[b]:length[b]].

    Args:
      tokens: i32[B,L], values in [0, vocab_size) where valid; entries outside
        [start, length) may hold anything.
      length: i32[B], end of the counted span per row.
      vocab_size: V.
      start: i32[B], start of the counted span per row; None = 0.

    Returns:
      f32[B,V] counts (a scatter-add; no [B,L,V] one-hot is built).
    """
    batch, max_len = tokens.shape
    index = jnp.arange(max_len)[None, :]
    valid = index < length[:, None]  # bool[B,L]
    if start is not None:
        valid &= index >= start[:, None]
    batch_index = jnp.broadcast_to(jnp.arange(batch)[:, None], tokens.shape)
    return (
        jnp.zeros((batch, vocab_size), jnp.float32)
        .at[batch_index, jnp.where(valid, tokens, 0)]
        .add(valid.astype(jnp.float32))
    )


def position_counts(history_counts: jax.Array, drafts: jax.Array, ancestors: jax.Array | None = None) -> jax.Array:
    """Context counts for each position of a verify pass.

    Position 0 conditions on the committed history (including the newest
    committed token t0); position s also sees the candidates drafts[:, :s]
    (a chain), or with ``ancestors`` the tree nodes on its path.

    Args:
      history_counts: f32[B,V], counts of the committed tokens.
      drafts: i32[B,S-1], candidate tokens (padding rows beyond a row's
        num_draft only affect positions whose output is never used).
      ancestors: bool[B,S,S] or None; a token tree's ancestor-or-self mask over
        the verify inputs [t0, drafts] (`specdec_jax.token_tree.structure`).

    Returns:
      f32[B,S,V] counts.
    """
    vocab = history_counts.shape[-1]
    one_hot = jax.nn.one_hot(drafts, vocab, dtype=jnp.float32)  # f32[B,S-1,V]
    if ancestors is None:
        seen = jnp.pad(jnp.cumsum(one_hot, axis=1), ((0, 0), (1, 0), (0, 0)))  # f32[B,S,V]
    else:
        seen = jnp.einsum("bsn,bnv->bsv", ancestors[:, :, 1:].astype(jnp.float32), one_hot)
    return history_counts[:, None, :] + seen


def sample(keys: jax.Array, probs: jax.Array) -> jax.Array:
    """One draw per row from a law: the categorical draw of every sampler in the package (drafts,
    corrections, bonus tokens), so that a row's key decides its token the same way everywhere.

    Args:
      keys: key[B], one key per row (e.g. `specdec_jax.rng.for_purpose` of its position's key).
      probs: f32[B,V], a law (`process_logits`, or a verification residual); zero entries are
        never drawn.

    Returns:
      i32[B] token ids.
    """
    return jax.vmap(jax.random.categorical)(keys, jnp.log(probs)).astype(jnp.int32)
