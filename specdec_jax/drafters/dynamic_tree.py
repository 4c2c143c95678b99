"""EAGLE-2's dynamic token tree, grown from any drafter that scores children (docs/design.md section 10).

Depth 1 holds the K most likely first tokens. At each next depth the K best
candidates of the previous depth (by cumulative log-probability, the frontier)
are expanded: the drafter scores the children of every fed node at once, and
each frontier node proposes its K most likely children. The N best candidates
overall become the tree (a parent always outranks its children, so every kept
node's parent is kept), best first: parents come before their children, and
the first n nodes are the n best, EAGLE-2's tree of n nodes (what a shape
policy verifies when it truncates the tree, `engine.shape`). The tokens are fixed by the
context, so verification treats them as point masses (rule (a) of
`specdec_jax.verify_tree`), under greedy decoding and sampling alike.

The drafter supplies `expand(tokens, mask, depth, inputs) -> (logits, outputs)`
over the fed block of every frontier so far (M = d K nodes at depth step d,
frontiers in order, the newest last): ``tokens i32[B,M]``, ``mask
bool[B,M,M]`` (ancestor-or-self among the fed nodes), ``depth i32[B,M]``
(1-based) and ``inputs f32[B,M,...] | None`` (what each node was fed with
besides its token: for EAGLE its parent's output feature); it returns the
logits ``f32[B,K,Vo]`` of the newest K nodes' children and their outputs
``f32[B,K,...] | None`` (the inputs of their children). It must not write
its cache: the next round rebuilds it from the committed tokens.

Under a grammar constraint (``grammar``, the context's `grammar.RowGrammar`) every node's children
are ranked by the drafter's law masked with the grammar state along the node's path, so the tree
holds no refused token while the grammar allows K children.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp

from specdec_jax import token_tree
from specdec_jax.drafters.base import Proposal
from specdec_jax.drafters.chain import empty_proposal
from specdec_jax.grammar import RowGrammar, advance
from specdec_jax.sampling import RowSampling, add_bias
from specdec_jax.token_tree import TreeShape

Expand = Callable[[jax.Array, jax.Array, jax.Array, jax.Array | None], tuple[jax.Array, jax.Array | None]]


def grow_dynamic_tree(shape: TreeShape, nodes: int, first_logits: jax.Array, root_output: jax.Array | None,
                      expand: Expand, vocab_map: jax.Array | None = None,
                      grammar: RowGrammar | None = None, sampling: RowSampling | None = None) -> Proposal:
    """A `Proposal` of ``nodes`` nodes (point masses, all counted: the caller masks rows that
    cannot draft): the best of `_candidates`, best first (`_best_tree`).

    first_logits: f32[B,Vo] the drafter's logits of the first draft; root_output: f32[B,...] the
    input of depth-1 nodes besides their token (None if the drafter needs none); vocab_map:
    i32[Vo] target id of each logit (a reduced vocabulary), None: Vo = V; grammar: the rows'
    grammar (module docstring), None: unconstrained; sampling: the rows' settings over the drafter's
    ids (`chain.drafter_sampling`), whose logit bias the ranking of children includes (a banned token
    takes no node), None: none.
    """
    if nodes == 0:  # a round without speculation
        return empty_proposal(first_logits.shape[0], tree=True)
    children = functools.partial(_best_children, k=shape.topk, vocab_map=vocab_map, grammar=grammar,
                                 sampling=sampling)
    return _best_tree(*_candidates(shape, first_logits, root_output, expand, children, grammar), nodes)


def _best_children(logits, states, depth: int, k: int, vocab_map, grammar: RowGrammar | None,
                   sampling: RowSampling | None):
    """f32[B,M,Vo] logits of M nodes' children at ``depth``, i32[B,M] the nodes' grammar states (None
    unconstrained) -> (log-probs f32[B,M,K], target ids i32[B,M,K], the children's states or None),
    ranked after the rows' logit bias."""
    if sampling is not None:
        logits = add_bias(logits.astype(jnp.float32), sampling)
    if grammar is not None:
        logits = grammar.constrain(logits, states, depth - 1, vocab_map)
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    logp, ids = jax.lax.top_k(jnp.maximum(logp, -1e4), k)  # finite: a child always ranks below its parent
    ids = ids if vocab_map is None else vocab_map[ids]
    return logp, ids, None if grammar is None else advance(grammar.tables, states[..., None], ids)


def _candidates(shape: TreeShape, first_logits, root_output, expand: Expand, children, grammar):
    """Every candidate, depth by depth: (tokens i32[B,C], cumulative log-probs f32[B,C], parents i32[B,C]
    (candidate ids, ROOT at depth 1), depths i32[B,C]), C = K + (D - 1) K^2; ``children`` is
    `_best_children` with its K, vocabulary map and grammar."""
    k, batch = shape.topk, first_logits.shape[0]
    logp, ids, child_states = children(first_logits[:, None], None if grammar is None else grammar.states[:, None], 1)
    frontier_states = None if grammar is None else child_states[:, 0]  # i32[B,K]
    tokens, scores, parents = [ids[:, 0]], [logp[:, 0]], [jnp.full((batch, k), token_tree.ROOT, jnp.int32)]
    depths = [jnp.ones((batch, k), jnp.int32)]
    frontier, frontier_score = jnp.broadcast_to(jnp.arange(k), (batch, k)), logp[:, 0]  # candidate ids
    fed_tokens, fed_depth = ids[:, 0], jnp.ones((batch, k), jnp.int32)
    fed_parents = jnp.full((batch, k), token_tree.ROOT, jnp.int32)  # index in the fed block
    fed_inputs = (None if root_output is None
                  else jnp.broadcast_to(root_output[:, None], (batch, k) + root_output.shape[1:]))
    first = k  # candidate id of the next depth's first candidate
    for depth in range(2, shape.depth + 1):
        mask = token_tree.structure(fed_parents)[1][:, 1:, 1:]
        logits, outputs = expand(fed_tokens, mask, fed_depth, fed_inputs)
        logp, ids, child_states = children(logits, frontier_states, depth)  # [B,K,K]
        score = (frontier_score[:, :, None] + logp).reshape(batch, k * k)
        tokens.append(ids.reshape(batch, k * k))
        scores.append(score)
        parents.append(jnp.repeat(frontier, k, axis=1))
        depths.append(jnp.full((batch, k * k), depth, jnp.int32))
        if depth < shape.depth:  # expand the K best of this depth next
            frontier_score, best = jax.lax.top_k(score, k)
            frontier, parent = first + best, best // k  # parent: which of the newest K fed nodes
            if grammar is not None:
                frontier_states = jnp.take_along_axis(child_states.reshape(batch, k * k), best, axis=1)
            fed_parents = jnp.concatenate([fed_parents, fed_tokens.shape[1] - k + parent], axis=1)
            fed_tokens = jnp.concatenate([fed_tokens, jnp.take_along_axis(tokens[-1], best, axis=1)], axis=1)
            fed_depth = jnp.concatenate([fed_depth, jnp.full((batch, k), depth, jnp.int32)], axis=1)
            if fed_inputs is not None:
                chosen = jnp.take_along_axis(outputs, parent.reshape(parent.shape + (1,) * (outputs.ndim - 2)), axis=1)
                fed_inputs = jnp.concatenate([fed_inputs, chosen], axis=1)
        first += k * k
    return tuple(jnp.concatenate(x, axis=1) for x in (tokens, scores, parents, depths))


def _best_tree(tokens, scores, parents, depths, nodes: int) -> Proposal:
    """The ``nodes`` best candidates (arrays as `_candidates`' [B,C]), best first, renumbered as a tree:
    a parent outranks its children (the depth term breaks a tie of equal scores toward the parent)."""
    batch = tokens.shape[0]
    _, chosen = jax.lax.top_k(scores - 1e-3 * depths, nodes)
    batch_index = jnp.arange(batch)[:, None]
    renumber = jnp.full(tokens.shape, token_tree.ROOT, jnp.int32).at[batch_index, chosen].set(
        jnp.arange(nodes, dtype=jnp.int32))
    old_parents = jnp.take_along_axis(parents, chosen, axis=1)
    new_parents = jnp.where(old_parents >= 0, jnp.take_along_axis(renumber, jnp.maximum(old_parents, 0), axis=1),
                            token_tree.ROOT)
    return Proposal(jnp.take_along_axis(tokens, chosen, axis=1).astype(jnp.int32), jnp.full((batch,), nodes, jnp.int32),
                    None, new_parents)


def check_dynamic_shape(shape: TreeShape | None) -> None:
    """ValueError unless ``shape`` is a dynamic tree whose node count its candidates can fill."""
    if shape is None:
        return
    if shape.choices is not None:
        raise ValueError("this drafter grows a dynamic tree (--tree-nodes/--tree-depth/--tree-topk); static tree "
                         "choices are for Medusa heads")
    most = shape.topk + (shape.depth - 1) * shape.topk ** 2
    if shape.nodes > most:
        raise ValueError(f"a dynamic tree of depth {shape.depth} and top-{shape.topk} has at most {most} candidates, "
                         f"fewer than {shape.nodes} nodes")
