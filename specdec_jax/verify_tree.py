"""Verification of token trees (docs/design.md section 10; a chain is the tree ``parents = c - 1``).

Row b proposes nodes ``tokens[b, c]`` with ``parents[b, c]`` (`specdec_jax.token_tree`);
``valid[b, c]`` says which nodes count (padding, and nodes deeper than the row's
room, do not). The target's law at verify input u (0 = t0, c + 1 = node c) is
the law of the token after u. Verification walks down from t0 and accepts at
most one child per node; the accepted path ends at a node m of depth n, and the
row emits the path's n tokens plus one target token at m (the correction after
m's children were all rejected, or the bonus at a leaf). Stop tokens and the
budget cut the run as for chains (`verify.truncate_run`).

Greedy (`verify_tree_greedy`): a node is good iff its token is the target's
argmax at its parent and its parent is good; the path ends at the deepest good
node (ties: the lowest index), followed by the argmax there.

Sampling (`verify_tree_stochastic`): recursive rejection at each node on the
path, over its children in index order, with r the target's law at the node:

- point-mass children (`draft_probs=None`: top-k, tries, static trees, any
  children fixed by the context): accept child x with probability
  r(x) / sum(r), else r(x) <- 0;
- children drawn i.i.d. from s (`draft_probs[b, c]`, the law of node c's
  sibling group): accept with probability min(1, r(x) / s(x)), else
  r <- normalize(max(r - s, 0));
- children drawn without replacement from s (``without_replacement=True``): as
  i.i.d., and then s(x) <- 0, s <- normalize(s).

If no child is accepted the row emits y ~ r. Each rule keeps the emitted token
at the node distributed as the target's law, so the emitted run follows the
target's sequence law exactly (SpecInfer, Miao et al. 2024; recursive
rejection sampling, Jeon et al. 2024). Duplicate siblings are handled by the
rules themselves: a token once rejected has r(x) = 0 afterwards (for point
masses by construction, for sampled children because a rejection needs
r(x) < s(x)), so it is never accepted later.

Keys: node c's accept-uniform uses ``keys[b, depth - 1]`` (its absolute
position, as a chain draft at that depth) with `Purpose.ACCEPT`, and its
sibling rank folded in (`rng.with_sub_index`: rank 0 uses the key itself, so a
chain verifies with the chain rule's draws); the final draw uses
``keys[b, n]`` with `Purpose.RESIDUAL`.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp

from specdec_jax import token_tree
from specdec_jax.rng import Purpose, accept_uniforms, check_keys, for_purpose, with_sub_index
from specdec_jax.sampling import sample
from specdec_jax.verify import VerifyResult, truncate_run


def verify_tree_greedy(tokens, parents, valid, target_argmax, *, stop_ids: Sequence[int] = (),
                       budget=None) -> VerifyResult:
    """Greedy tree verification.

    Args:
      tokens, parents: i32[B,N] the nodes (`specdec_jax.token_tree`).
      valid: bool[B,N] nodes that may be accepted (a valid node's parent must be valid).
      target_argmax: i32[B,N+1] the target's argmax at each verify input ``[t0, nodes]``.
      stop_ids, budget: as in `verify.verify_greedy`.
    """
    tokens, parents, valid, target_argmax = _check(tokens, parents, valid, target_argmax)
    batch, nodes = tokens.shape
    depth = token_tree.structure(parents)[0][:, 1:]
    matches = valid & (tokens == jnp.take_along_axis(target_argmax, parents + 1, axis=1))

    def mark(c, good):
        parent_good = jnp.take_along_axis(good, jnp.maximum(parents[:, c], 0)[:, None], axis=1)[:, 0]
        return good.at[:, c].set(matches[:, c] & ((parents[:, c] < 0) | parent_good))

    good = jax.lax.fori_loop(0, nodes, mark, jnp.zeros((batch, nodes), bool))
    score = jnp.where(good, depth, 0)
    last, n_accepted = jnp.argmax(score, axis=1).astype(jnp.int32), jnp.max(score, axis=1, initial=0)
    path = token_tree.path_to(last, n_accepted, parents, nodes)
    last_input = jnp.where(n_accepted > 0, last + 1, 0)
    final = jnp.take_along_axis(target_argmax, last_input[:, None], axis=1)
    return truncate_run(_emitted(tokens, path, n_accepted, final), n_accepted.astype(jnp.int32), stop_ids, budget,
                        path)


def verify_tree_stochastic(keys, tokens, parents, valid, draft_probs, target_probs, *,
                           without_replacement: bool = False, stop_ids: Sequence[int] = (),
                           budget=None) -> VerifyResult:
    """Recursive rejection sampling over a token tree (module docstring).

    Args:
      keys: key[B,N+1] row keys of the absolute positions ``num_tokens + 0..N``
        (as `verify.verify_stochastic`'s, one per depth).
      tokens, parents, valid: as in `verify_tree_greedy`.
      draft_probs: f32[B,N,V] the law node c was drawn from (shared by its siblings), or None for
        point-mass children.
      target_probs: f32[B,N+1,V] the processed target law at each verify input.
      without_replacement: siblings were drawn without replacement from their law.
      stop_ids, budget: as in `verify.verify_greedy`.
    """
    tokens, parents, valid, target_probs = _check(tokens, parents, valid, target_probs)
    batch, nodes = tokens.shape
    keys = check_keys(keys, (batch, nodes + 1))
    depth = token_tree.structure(parents)[0][:, 1:]
    node_keys = jnp.take_along_axis(keys, jnp.maximum(depth - 1, 0), axis=1)
    uniforms = accept_uniforms(with_sub_index(for_purpose(node_keys, Purpose.ACCEPT), token_tree.sibling_rank(parents)))
    batch_index = jnp.arange(batch)

    def visit(carry, c):
        current, r, s, fresh, n, path = carry
        x = tokens[:, c]
        is_child = valid[:, c] & (parents[:, c] + 1 == current)
        r_x = r[batch_index, x]
        if draft_probs is None:
            accepted = uniforms[:, c] * r.sum(-1) < r_x
            r_rejected = r.at[batch_index, x].set(0.0)
        else:
            law = draft_probs[:, c]
            if without_replacement:
                law = jnp.where(fresh[:, None], law, s)
            s_x = law[batch_index, x]
            accepted = (s_x > 0) & (uniforms[:, c] * s_x < r_x)
            r_rejected = _normalized(jnp.maximum(r - law, 0.0), fallback=r)
            if without_replacement:
                s = jnp.where(is_child[:, None], _normalized(law.at[batch_index, x].set(0.0), fallback=law), s)
        take, drop = is_child & accepted, is_child & ~accepted
        r = jnp.where(take[:, None], target_probs[:, c + 1], jnp.where(drop[:, None], r_rejected, r))
        path = jnp.where(take[:, None] & (jnp.arange(nodes)[None, :] == n[:, None]), c, path)
        fresh = jnp.where(take, True, jnp.where(drop, False, fresh))
        return (jnp.where(take, c + 1, current), r, s, fresh, n + take, path), None

    start = (jnp.zeros((batch,), jnp.int32), target_probs[:, 0], jnp.zeros_like(target_probs[:, 0]),
             jnp.ones((batch,), bool), jnp.zeros((batch,), jnp.int32), jnp.full((batch, nodes), -1, jnp.int32))
    (_, r, _, _, n_accepted, path), _ = jax.lax.scan(visit, start, jnp.arange(nodes))
    residual_keys = for_purpose(jnp.take_along_axis(keys, n_accepted[:, None], axis=1)[:, 0], Purpose.RESIDUAL)
    final = sample(residual_keys, r)
    return truncate_run(_emitted(tokens, path, n_accepted, final[:, None]), n_accepted, stop_ids, budget, path)


def _normalized(law, fallback):
    """``law`` (f32[B,V]) scaled to sum 1, or ``fallback`` where it is all zero."""
    total = law.sum(-1, keepdims=True)
    return jnp.where(total > 0, law / jnp.where(total > 0, total, 1.0), fallback)


def _emitted(tokens, path, n_accepted, final):
    """i32[B,N+1]: the path's tokens, then ``final`` i32[B,1] at column ``n_accepted``."""
    path_tokens = jnp.take_along_axis(tokens, jnp.maximum(path, 0), axis=1)
    run = jnp.pad(path_tokens, ((0, 0), (0, 1)))
    column = jnp.arange(run.shape[1])[None, :]
    return jnp.where(column == n_accepted[:, None], final, run).astype(jnp.int32)


def _check(tokens, parents, valid, target):
    tokens, parents = jnp.asarray(tokens, jnp.int32), jnp.asarray(parents, jnp.int32)
    valid, target = jnp.asarray(valid, bool), jnp.asarray(target)
    if tokens.ndim != 2 or parents.shape != tokens.shape or valid.shape != tokens.shape:
        raise ValueError(f"tokens, parents and valid must all be [B,N]; got {tokens.shape}, {parents.shape}, "
                         f"{valid.shape}")
    batch, nodes = tokens.shape
    if target.shape[:2] != (batch, nodes + 1):
        raise ValueError(f"the target's outputs must have leading shape (B, N+1) = {(batch, nodes + 1)}, "
                         f"got {target.shape}")
    return tokens, parents, valid, target
