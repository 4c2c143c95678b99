"""Token trees (docs/design.md section 10): the structure of a proposal of N nodes per row.

A tree proposal is `Proposal(drafts=tokens i32[B,N], num_draft, probs, parents=i32[B,N])`:
node c has token `tokens[b, c]` and parent `parents[b, c]` (-1: the root, the
last committed token t0; else an earlier node, `parents[b, c] < c`, so parents
come before their children). Nodes `c >= num_draft[b]` are padding. The verify
pass feeds `[t0, nodes]`, so node c is verify input c + 1; its depth is 1 for a
child of the root, and it sits at position `lengths + depth` and sees exactly
its ancestors (block mask = ancestor-or-self). A chain of G drafts is the tree
`parents[b, c] = c - 1`.

Everything here is fixed-shape and traceable (`check_parents` is the host-side
check of a static tree).
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

ROOT = -1  # parent of a child of t0
# The most nodes a tree may have: a round verifies all of them in one pass of nodes + 1 tokens and accepts at
# most depth + 1 of them. A wider tree is refused when its shape is made, before anything is compiled or calibrated.
MAX_TREE_NODES = 1024


@dataclasses.dataclass(frozen=True)
class TreeShape:
    """A tree drafter's shape: at most ``nodes`` nodes, at most ``depth`` deep, ``topk`` children
    per expanded node (for a drafter that ranks candidates), or a static tree of ``choices``
    (Medusa's format, `static_tree`), which fixes ``nodes`` and ``depth``."""

    nodes: int
    depth: int
    topk: int = 1
    choices: tuple[tuple[int, ...], ...] | None = None

    def __post_init__(self):
        if self.choices is not None:
            parents, depth, _ = static_tree(self.choices)
            if (self.nodes, self.depth) != (len(parents), int(depth.max())):
                raise ValueError(f"tree choices give {len(parents)} nodes of depth <= {int(depth.max())}, "
                                 f"not nodes={self.nodes}, depth={self.depth}")
        if self.nodes < 1 or self.depth < 1 or self.topk < 1:
            raise ValueError(f"tree nodes, depth and topk must be >= 1, got {self.nodes}, {self.depth}, {self.topk}")
        if self.depth > self.nodes:
            raise ValueError(f"a tree of {self.nodes} nodes cannot be {self.depth} deep (depth <= nodes)")
        if self.nodes > MAX_TREE_NODES:
            raise ValueError(f"a tree of {self.nodes} nodes is too wide: at most {MAX_TREE_NODES} (each round verifies "
                             f"nodes + 1 tokens in one pass); use fewer nodes (by default depth x topk)")

    @classmethod
    def from_choices(cls, choices: Sequence[Sequence[int]]) -> TreeShape:
        """The static tree of ``choices`` (lists of top-k ranks per depth)."""
        choices = tuple(sorted((tuple(int(r) for r in c) for c in choices), key=lambda c: (len(c), c)))
        parents, depth, _ = static_tree(choices)
        return cls(nodes=len(parents), depth=int(depth.max()), topk=1 + max(max(c) for c in choices),
                   choices=choices)


def default_choices(nodes: int, depth: int, topk: int) -> tuple[tuple[int, ...], ...]:
    """A static tree without measured acceptances: the ``nodes`` rank paths (ranks < ``topk``, at
    most ``depth`` long) of smallest rank sum, shorter first; every prefix of a kept path is kept.

    Best first, in O(nodes log nodes): a path's successors in that order are its next sibling
    (its last rank + 1: sum + 1) and its first child (rank 0 appended: one longer), never before it,
    and every path is the successor of exactly one other, so a heap from ``(0,)`` pops them in order."""
    import heapq

    available = sum(topk**d for d in range(1, depth + 1))
    if nodes > available:
        raise ValueError(f"a tree of depth {depth} with top-{topk} children has at most {available} nodes, "
                         f"not {nodes}")
    heap, paths = [(0, 1, (0,))], []
    while len(paths) < nodes:
        total, length, path = heapq.heappop(heap)
        paths.append(path)
        if path[-1] + 1 < topk:
            heapq.heappush(heap, (total + 1, length, path[:-1] + (path[-1] + 1,)))
        if length < depth:
            heapq.heappush(heap, (total, length + 1, path + (0,)))
    return tuple(paths)


def load_choices(path: str | pathlib.Path) -> TreeShape:
    """A static tree from a JSON file holding a list of choices, e.g. ``[[0], [1], [0, 0]]``."""
    try:
        choices = json.loads(pathlib.Path(path).read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ValueError(f"cannot read tree choices from {path}: {err}") from None
    if not isinstance(choices, list) or not all(isinstance(c, list) for c in choices):
        raise ValueError(f"{path} must hold a list of lists of ranks (Medusa's tree format)")
    for i, choice in enumerate(choices):
        if not all(isinstance(r, int) and not isinstance(r, bool) and r >= 0 for r in choice):
            raise ValueError(f"{path}: choice {i} ({json.dumps(choice)}) must be a list of ranks (ints >= 0), "
                             "e.g. [0, 1]")
    try:
        return TreeShape.from_choices(choices)
    except ValueError as err:
        raise ValueError(f"{path}: {err}") from None


def chain_parents(batch: int, nodes: int) -> jax.Array:
    """i32[B,N]: the parents of a chain, ``c - 1``."""
    return jnp.broadcast_to(jnp.arange(nodes, dtype=jnp.int32)[None, :] - 1, (batch, nodes))


def check_parents(parents: np.ndarray) -> None:
    """ValueError unless every parent is -1 or an earlier node (host-side, for static trees)."""
    parents = np.asarray(parents)
    index = np.arange(parents.shape[-1])
    bad = (parents < ROOT) | (parents >= index)
    if bad.any():
        c = int(np.argwhere(bad)[0][-1])
        raise ValueError(f"node {c} has parent {int(parents.reshape(-1, parents.shape[-1])[0, c])}: a parent must "
                         f"be -1 (the root) or an earlier node, so that parents come before their children")


def structure(parents: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(depth i32[B,N+1], ancestors bool[B,N+1,N+1])`` over the verify inputs ``[t0, nodes]``.

    ``depth[b, 0] = 0`` (t0) and ``depth[b, c + 1]`` is node c's depth;
    ``ancestors[b, i, j]``: input j is input i or one of its ancestors (t0 is
    everyone's). This is the verify pass's block mask.
    """
    batch, nodes = parents.shape
    inputs = jnp.arange(nodes + 1)

    def add(c, carry):
        depth, ancestors = carry
        parent = (parents[:, c] + 1)[:, None]  # i32[B,1] verify input of the parent
        depth = depth.at[:, c + 1].set(jnp.take_along_axis(depth, parent, axis=1)[:, 0] + 1)
        row = jnp.take_along_axis(ancestors, parent[:, :, None], axis=1)[:, 0] | (inputs == c + 1)[None, :]
        return depth, ancestors.at[:, c + 1].set(row)

    depth = jnp.zeros((batch, nodes + 1), jnp.int32)
    ancestors = jnp.broadcast_to(jnp.eye(nodes + 1, dtype=bool) | (inputs == 0)[None, :], (batch, nodes + 1, nodes + 1))
    return jax.lax.fori_loop(0, nodes, add, (depth, ancestors))


def sibling_rank(parents: jax.Array) -> jax.Array:
    """i32[B,N]: how many earlier nodes share node c's parent (0 for the first child)."""
    nodes = parents.shape[1]
    earlier = jnp.tril(jnp.ones((nodes, nodes), bool), k=-1)[None]  # [1,c,j]: j < c
    return jnp.sum((parents[:, :, None] == parents[:, None, :]) & earlier, axis=2).astype(jnp.int32)


def path_to(node: jax.Array, depth: jax.Array, parents: jax.Array, width: int) -> jax.Array:
    """i32[B,width]: the nodes on the way from the root to ``node`` i32[B] (at ``depth`` i32[B],
    0 = the root itself), one per depth 1, 2, ...; -1 past ``depth``."""
    columns = jnp.arange(width)[None, :]

    def hop(i, carry):
        current, path = carry
        slot = depth - 1 - i  # the depth of `current`, minus one
        path = jnp.where((columns == slot[:, None]) & (slot >= 0)[:, None], current[:, None], path)
        up = jnp.take_along_axis(parents, jnp.maximum(current, 0)[:, None], axis=1)[:, 0]
        return up, path

    path = jnp.full((node.shape[0], width), -1, jnp.int32)
    return jax.lax.fori_loop(0, width, hop, (node.astype(jnp.int32), path))[1]


def compact(tokens: jax.Array, parents: jax.Array, keep: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``(tokens, parents, num_nodes)`` with the kept nodes first (in their order) and the parents
    renumbered; the others become padding. ``keep bool[B,N]`` must keep every kept node's parent."""
    nodes = tokens.shape[1]
    index = jnp.arange(nodes)[None, :]
    order = jnp.argsort(jnp.where(keep, index, nodes + index), axis=1)  # kept nodes first, stable
    new_index = jnp.argsort(order, axis=1)  # old node -> its new index
    tokens = jnp.take_along_axis(tokens, order, axis=1)
    old_parents = jnp.take_along_axis(parents, order, axis=1)
    renumbered = jnp.take_along_axis(new_index, jnp.maximum(old_parents, 0), axis=1)
    num_nodes = keep.sum(axis=1).astype(jnp.int32)
    parents = jnp.where((old_parents >= 0) & (index < num_nodes[:, None]), renumbered, ROOT)
    return tokens.astype(jnp.int32), parents.astype(jnp.int32), num_nodes


def first_nodes(tokens: jax.Array, parents: jax.Array, keep: jax.Array, nodes: int):
    """``(tokens, parents, num_nodes)`` of the first ``nodes`` kept nodes of ``tokens``, ``parents`` and
    ``keep`` [B,M] (`compact`; padded when M < nodes)."""
    tokens, parents, count = compact(tokens, parents, keep)
    pad = max(0, nodes - tokens.shape[1])
    tokens = jnp.pad(tokens, ((0, 0), (0, pad)))[:, :nodes]
    parents = jnp.pad(parents, ((0, 0), (0, pad)), constant_values=ROOT)[:, :nodes]
    return tokens, parents, jnp.minimum(count, nodes).astype(jnp.int32)


def static_tree(choices: Sequence[Sequence[int]]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(parents i32[N], depth i32[N], rank i32[N])`` of a static tree in Medusa's format: one
    choice per node, the list of top-k ranks on the way to it (``[0]`` is the best first token,
    ``[0, 1]`` the second-best token after it). Nodes are ordered by depth, then by choice; every
    choice's prefix must be a choice too."""
    choices = [tuple(int(r) for r in c) for c in choices]
    if not choices:
        raise ValueError("a static tree needs at least one choice")
    for c in choices:
        if not c or min(c) < 0:
            raise ValueError(f"choice {list(c)} must be a non-empty list of ranks >= 0")
    if len(set(choices)) != len(choices):
        raise ValueError("the tree choices list a node twice")
    ordered = sorted(choices, key=lambda c: (len(c), c))
    index = {c: i for i, c in enumerate(ordered)}
    missing = [c for c in ordered if len(c) > 1 and c[:-1] not in index]
    if missing:
        raise ValueError(f"choice {list(missing[0])} has no parent {list(missing[0][:-1])} among the choices")
    parents = np.array([index[c[:-1]] if len(c) > 1 else ROOT for c in ordered], np.int32)
    depth = np.array([len(c) for c in ordered], np.int32)
    rank = np.array([c[-1] for c in ordered], np.int32)
    return parents, depth, rank
