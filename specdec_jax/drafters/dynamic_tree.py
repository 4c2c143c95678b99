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

from collections.abc import Callable

import jax
import jax.numpy as jnp

from specdec_jax import tree as trees
from specdec_jax.drafters.base import Proposal
from specdec_jax.grammar import RowGrammar, advance
from specdec_jax.tree import TreeShape

Expand = Callable[[jax.Array, jax.Array, jax.Array, jax.Array | None], tuple[jax.Array, jax.Array | None]]


def grow_dynamic_tree(shape: TreeShape, nodes: int, first_logits: jax.Array, root_output: jax.Array | None,
                      expand: Expand, vocab_map: jax.Array | None = None,
                      grammar: RowGrammar | None = None) -> Proposal:
    """A `Proposal` of ``nodes`` nodes (point masses, all counted: the caller masks rows that
    cannot draft).

    first_logits: f32[B,Vo] the drafter's logits of the first draft; root_output: f32[B,...] the
    input of depth-1 nodes besides their token (None if the drafter needs none); vocab_map:
    i32[Vo] target id of each logit (a reduced vocabulary), None: Vo = V; grammar: the rows'
    grammar (module docstring), None: unconstrained.
    """
    k = shape.topk
    batch = first_logits.shape[0]
    if nodes == 0:  # a round without speculation
        return Proposal(jnp.zeros((batch, 0), jnp.int32), jnp.zeros((batch,), jnp.int32), None,
                        jnp.zeros((batch, 0), jnp.int32))

    def best_children(logits, states, depth):
        """f32[B,M,Vo] logits of M nodes' children at ``depth``, i32[B,M] the nodes' grammar states (None
        unconstrained) -> (log-probs f32[B,M,K], target ids i32[B,M,K], the children's states or None)."""
        if grammar is not None:
            logits = grammar.constrain(logits, states, depth - 1, vocab_map)
        logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
        logp, ids = jax.lax.top_k(jnp.maximum(logp, -1e4), k)  # finite: a child always ranks below its parent
        ids = ids if vocab_map is None else vocab_map[ids]
        return logp, ids, None if grammar is None else advance(grammar.tables, states[..., None], ids)

    root = None if grammar is None else grammar.states[:, None]
    logp, ids, child_states = best_children(first_logits[:, None], root, 1)
    frontier_states = None if grammar is None else child_states[:, 0]  # i32[B,K]
    tokens, scores, parents = [ids[:, 0]], [logp[:, 0]], [jnp.full((batch, k), trees.ROOT, jnp.int32)]
    depths = [jnp.ones((batch, k), jnp.int32)]
    frontier, frontier_score = jnp.broadcast_to(jnp.arange(k), (batch, k)), logp[:, 0]  # candidate ids
    fed_tokens, fed_depth = ids[:, 0], jnp.ones((batch, k), jnp.int32)
    fed_parents = jnp.full((batch, k), trees.ROOT, jnp.int32)  # index in the fed block
    fed_inputs = None if root_output is None else jnp.broadcast_to(root_output[:, None], (batch, k) + root_output.shape[1:])
    first = k  # candidate id of the next depth's first candidate
    for depth in range(2, shape.depth + 1):
        mask = trees.structure(fed_parents)[1][:, 1:, 1:]
        logits, outputs = expand(fed_tokens, mask, fed_depth, fed_inputs)
        logp, ids, child_states = best_children(logits, frontier_states, depth)  # [B,K,K]
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
    tokens, scores = jnp.concatenate(tokens, axis=1), jnp.concatenate(scores, axis=1)
    parents, depths = jnp.concatenate(parents, axis=1), jnp.concatenate(depths, axis=1)
    _, chosen = jax.lax.top_k(scores - 1e-3 * depths, nodes)  # the best N, best first: a parent outranks its children
    rows = jnp.arange(batch)[:, None]
    renumber = jnp.full(tokens.shape, trees.ROOT, jnp.int32).at[rows, chosen].set(jnp.arange(nodes, dtype=jnp.int32))
    old_parents = jnp.take_along_axis(parents, chosen, axis=1)
    new_parents = jnp.where(old_parents >= 0, jnp.take_along_axis(renumber, jnp.maximum(old_parents, 0), axis=1),
                            trees.ROOT)
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
