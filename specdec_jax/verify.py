"""Verification rules of speculative decoding (docs/design.md section 2).

A round verifies, per row b, `k = num_draft[b] <= G` drafted tokens against the
target's laws at the `G + 1` verified positions. Row i of the target's output
predicts the token after verify input i (input 0 is the last committed token,
input i >= 1 is draft i). Verification keeps the longest acceptable prefix of
`m` drafts and appends one target token read at position `m`: the correction
at the first rejection, or the bonus after a full match (position `k`, the
row's own count, never `G`). A stop token (EOS) and the per-row budget truncate the run
exactly where plain decoding would stop.

Randomness (`specdec_jax.rng`): `keys[b, i]` is row b's key of verified position
i, the absolute position of draft i+1 and of a correction or bonus emitted
there. The accept-uniform of draft i+1 folds in `Purpose.ACCEPT`, the
correction/bonus draw `Purpose.RESIDUAL`. No key is split over the batch, so a
row's draws never depend on its neighbours.

Everything is fixed-shape and vectorized; `num_draft`, `budget` and the keys
may be traced. Both rules return a `VerifyResult`; row b emits
`tokens[b, :n_emit[b]]`. Entries of `tokens` at or past `n_emit` are 0.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp

from specdec_jax.rng import Purpose, accept_uniforms, check_keys, for_purpose
from specdec_jax.sampling import sample


class VerifyResult(NamedTuple):
    tokens: jax.Array  # i32[B,G+1] emitted run, 0 past n_emit
    n_emit: jax.Array  # i32[B] tokens emitted, 1 <= n_emit <= num_draft + 1
    n_accepted: jax.Array  # i32[B] drafts accepted, counted before EOS/budget truncation
    path: jax.Array | None = None  # i32[B,N] trees only (`verify_tree`): node accepted at depth j+1, -1 past


def verify_greedy(draft, target_argmax, num_draft, *, stop_ids: Sequence[int] = (), budget=None) -> VerifyResult:
    """Greedy verification: draft i is kept while it equals the target's argmax.

    Args:
      draft: i32[B,G] drafted tokens, padded past `num_draft`.
      target_argmax: i32[B,G+1] argmax of the target law at each verified position.
      num_draft: i32[B] real drafts per row, in 0..G.
      stop_ids: token ids (static); the first one inside the emitted run ends it (kept).
      budget: i32[B] or None; tokens row b may still emit (>= 1).
    """
    draft, target_argmax, num_draft = _check_shapes(draft, target_argmax, num_draft)
    matches = draft == target_argmax[:, :-1]
    n_accepted = _leading_accepted(matches, num_draft)
    # Accepted drafts equal the argmax, and the correction/bonus is the argmax at
    # position n_accepted: the whole emitted run is a prefix of target_argmax.
    return truncate_run(target_argmax, n_accepted, stop_ids, budget)


def verify_stochastic(
    keys, draft, draft_probs, target_probs, num_draft, *, stop_ids: Sequence[int] = (), budget=None
) -> VerifyResult:
    """Speculative sampling: accept draft i with probability min(1, p_i(d_i) / q_i(d_i)).

    At the first rejection the correction is drawn from normalize(max(p_m - q_m, 0))
    (falling back to p_m if that residual is all zero after rounding); after a
    full match the bonus is drawn from p_k. The emitted tokens then follow the
    target law exactly (Leviathan et al. 2023, Chen et al. 2023).

    Args:
      keys: key[B,G+1] typed PRNG keys, one per row and verified position
        (`specdec_jax.rng.position_keys`; see the module docstring).
      draft: i32[B,G] drafted tokens, padded past `num_draft`.
      draft_probs: f32[B,G,V] the law each draft was sampled from, or None for a
        deterministic drafter (a point mass on the draft: accept iff u < p(d)).
      target_probs: f32[B,G+1,V] processed target law at each verified position.
      num_draft: i32[B] real drafts per row, in 0..G.
      stop_ids, budget: as in `verify_greedy`.
    """
    draft, target_probs, num_draft = _check_shapes(draft, target_probs, num_draft)
    batch, gamma = draft.shape
    keys = check_keys(keys, (batch, gamma + 1))
    u = accept_uniforms(for_purpose(keys[:, :gamma], Purpose.ACCEPT))  # f32[B,G] in [tiny, 1)

    p_draft = _take_token(target_probs[:, :-1], draft)  # f32[B,G]
    if draft_probs is None:
        q_draft = jnp.ones_like(p_draft)
    else:
        q_draft = _take_token(draft_probs, draft)
    accepted = (q_draft > 0) & (u * q_draft < p_draft)
    n_accepted = _leading_accepted(accepted, num_draft)

    p_last = _take_position(target_probs, n_accepted)  # f32[B,V]
    q_last = _draft_law_at(draft, draft_probs, jnp.minimum(n_accepted, gamma - 1), p_last)
    rejected_at_m = (n_accepted < num_draft)[:, None]
    residual = jnp.where(rejected_at_m, jnp.maximum(p_last - q_last, 0.0), p_last)
    residual = jnp.where(residual.sum(-1, keepdims=True) > 0, residual, p_last)
    residual_keys = for_purpose(jnp.take_along_axis(keys, n_accepted[:, None], axis=1)[:, 0], Purpose.RESIDUAL)
    last = sample(residual_keys, residual)

    positions = jnp.arange(gamma + 1)
    padded_draft = jnp.pad(draft, ((0, 0), (0, 1)))
    tokens = jnp.where(positions[None, :] == n_accepted[:, None], last[:, None], padded_draft)
    return truncate_run(tokens.astype(jnp.int32), n_accepted, stop_ids, budget)


def _check_shapes(draft, target, num_draft):
    draft = jnp.asarray(draft, jnp.int32)
    target = jnp.asarray(target)
    num_draft = jnp.asarray(num_draft, jnp.int32)
    if draft.ndim != 2:
        raise ValueError(f"draft must be i32[B,G], got shape {draft.shape}")
    batch, gamma = draft.shape
    if target.shape[:2] != (batch, gamma + 1):
        raise ValueError(f"target must have leading shape (B, G+1) = {(batch, gamma + 1)}, got {target.shape}")
    if num_draft.shape != (batch,):
        raise ValueError(f"num_draft must be i32[B] = ({batch},), got {num_draft.shape}")
    return draft, target, num_draft


def _leading_accepted(accepted, num_draft):
    """Length of the all-True prefix of `accepted` (bool[B,G]) within the real drafts."""
    real = jnp.arange(accepted.shape[1])[None, :] < num_draft[:, None]
    return jnp.sum(jnp.cumprod(accepted & real, axis=1), axis=1).astype(jnp.int32)


def truncate_run(tokens, n_accepted, stop_ids, budget, path=None) -> VerifyResult:
    """Cut the run tokens[:, :n_accepted+1] at the first stop token (kept) and at `budget`."""
    n_emit = n_accepted + 1
    positions = jnp.arange(tokens.shape[1])[None, :]
    if stop_ids:
        is_stop = jnp.isin(tokens, jnp.asarray(tuple(stop_ids), jnp.int32)) & (positions < n_emit[:, None])
        first_stop = jnp.argmax(is_stop, axis=1)
        n_emit = jnp.where(is_stop.any(axis=1), first_stop + 1, n_emit)
    if budget is not None:
        n_emit = jnp.minimum(n_emit, jnp.maximum(jnp.asarray(budget, jnp.int32), 1))
    tokens = jnp.where(positions < n_emit[:, None], tokens, 0)
    return VerifyResult(tokens.astype(jnp.int32), n_emit.astype(jnp.int32), n_accepted, path)


def _draft_law_at(draft, draft_probs, index, like):
    """The drafter's law f32[B,V] at position `index` i32[B] (zeros when G == 0).

    Only read where the draft at `index` was rejected; a deterministic drafter's
    law is the point mass on its draft.
    """
    if draft.shape[1] == 0:
        return jnp.zeros_like(like)
    if draft_probs is None:
        rejected = jnp.take_along_axis(draft, index[:, None], axis=1)[:, 0]
        return jax.nn.one_hot(rejected, like.shape[-1], dtype=like.dtype)
    return _take_position(draft_probs, index)


def _take_token(probs, tokens):
    """probs f32[B,G,V], tokens i32[B,G] -> f32[B,G] probability of each token."""
    return jnp.take_along_axis(probs, tokens[..., None], axis=-1)[..., 0]


def _take_position(probs, index):
    """probs f32[B,P,V], index i32[B] -> f32[B,V] the law at each row's position."""
    return jnp.take_along_axis(probs, index[:, None, None], axis=1)[:, 0]
