"""Grammar constraints on device: a row's grammar state, and the tokens allowed along candidate paths.

`stack_grammars` puts the tables of several constraints (`constraints.GrammarTables`, one per
distinct constraint of a batch) into one `DeviceGrammar`, beside a free grammar for rows without a
constraint, so that a row's grammar is nothing but its state, an ``i32`` into one shared table
(docs/constraints.md):

- states: the free grammar's single state is `FREE` (0); constraint k's states follow, offset by
  the states before them;
- token classes: a token's class is the tuple of its classes under every constraint (and "any"
  under the free grammar), numbered densely, so one ``token_class i32[V]`` serves every row;
- ``next_state[s, c]``: the state after a token of class ``c`` in state ``s`` (-1: not allowed).

`allowed` gives a row's mask in one gather, `advance` moves it by a token, and `path_states` gives
the state after every input of a verify pass ``[t0, candidates]`` (a chain, or a tree by its
parents), each reached along that input's own path. A candidate that its state does not allow has
state -1, and so has every input below it; `allowed` treats -1 as the free grammar, so the laws at
those inputs stay finite. They are never used: the target's law gives such a candidate probability
0, so verification stops at it.

Budget. ``distance[s]`` is the fewest tokens from state ``s`` to a whole match. Given the tokens a
row may still emit after a position (``remaining``), `allowed` also refuses a token whose next state
is farther from a match than that: a row that reaches its token budget ends on a whole match (the
law at each position is the grammar's, restricted to texts that fit the budget; where nothing
would fit, the grammar's alone, so a law is never empty).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from specdec_jax import token_tree

NEVER, STOP, FIRST_TEXT_CLASS = 0, 1, 2  # a table's token classes (docs/constraints.md)
FREE = 0  # the free grammar's state: every token allowed, always accepting
DEAD = -1  # the state after a token its state does not allow
FAR = 2**30  # `tokens_to_accept` of a state from which no match is reachable


class DeviceGrammar(NamedTuple):
    """Stacked grammar tables (module docstring); a pytree of device arrays."""

    token_class: jax.Array  # i32[V]: the joint class of each token id
    next_state: jax.Array  # i32[S,C]: the state after a token of class c in state s; -1: not allowed
    accepting: jax.Array  # bool[S]: the text so far is a whole match (FREE: always)
    initial: jax.Array  # i32[K+1]: the initial state of each grammar (0: the free one)
    distance: jax.Array  # i32[S]: the fewest tokens from a state to an accepting one (module docstring)
    stop_class: jax.Array  # bool[C]: the classes of stop tokens (`STOP` in a table)


class RowGrammar(NamedTuple):
    """What a round needs of a batch's grammar: the tables, each row's state after its newest committed
    token, and the tokens each row may still emit (its budget less what it has emitted)."""

    tables: DeviceGrammar
    states: jax.Array  # i32[B]
    budget: jax.Array  # i32[B]

    def mask(self, states: jax.Array, offset) -> jax.Array:
        """``bool[B, ..., V]``: the tokens allowed in ``states`` (i32[B, ...]), each the state before the
        token ``offset`` (int or i32[B, ...]) tokens after the row's next one (0: the next)."""
        remaining = self.budget.reshape(self.budget.shape + (1,) * (states.ndim - 1)) - 1 - offset
        return allowed(self.tables, states, remaining)

    def constrain(self, logits: jax.Array, states: jax.Array, offset, vocab_map: jax.Array | None = None
                  ) -> jax.Array:
        """``logits`` (f32[B, ..., Vo]) with the tokens `mask` refuses at -inf; ``vocab_map`` (i32[Vo]) is
        the target id of each logit of a drafter's reduced vocabulary (None: Vo = V), which leaves a row
        whose allowed ids it lacks unmasked (its draft is then refused, and wasted)."""
        mask = self.mask(states, offset)
        if vocab_map is not None:
            mask = mask[..., vocab_map]
            mask = mask | ~jnp.any(mask, axis=-1, keepdims=True)
        return jnp.where(mask, logits, -jnp.inf)


def stack_grammars(tables: Sequence, vocab_size: int) -> DeviceGrammar:
    """The free grammar (index 0) and ``tables`` (`constraints.GrammarTables`, built on the host; index
    k + 1) as one `DeviceGrammar` over ``vocab_size`` token ids (the logits' width: ids past a table's
    vocabulary are in its NEVER class)."""
    # row 0: the free grammar's one class; ids past a table's vocabulary keep NEVER (0)
    per_grammar = np.full((len(tables) + 1, vocab_size), NEVER, np.int64)
    for k, t in enumerate(tables, start=1):
        if t.token_class.size > vocab_size:
            raise ValueError(f"a grammar over {t.token_class.size} tokens does not fit {vocab_size} logits")
        per_grammar[k, : t.token_class.size] = t.token_class
    joint, token_class = np.unique(per_grammar, axis=1, return_inverse=True)  # [K+1, C]: each class's classes
    offsets = np.cumsum([1] + [t.num_states for t in tables])  # first global state of each table
    next_state = [np.zeros((1, joint.shape[1]), np.int32)]  # FREE -> FREE on every class
    for k, t in enumerate(tables, start=1):
        local = t.next_state[:, joint[k]]  # i32[S_k, C]
        next_state.append(np.where(local >= 0, local + offsets[k - 1], DEAD).astype(np.int32))
    accepting = np.concatenate([[True], *(t.accepting for t in tables)])
    initial = np.array([FREE] + [offsets[k] + t.initial for k, t in enumerate(tables)], np.int32)
    distance = np.concatenate([[0], *(tokens_to_accept(t.next_state, t.accepting) for t in tables)])
    stop_class = (joint[1:] == STOP).any(axis=0)
    return DeviceGrammar(jnp.asarray(token_class.reshape(-1), jnp.int32), jnp.asarray(np.concatenate(next_state)),
                         jnp.asarray(accepting), jnp.asarray(initial), jnp.asarray(distance, jnp.int32),
                         jnp.asarray(stop_class))


def tokens_to_accept(next_state: np.ndarray, accepting: np.ndarray) -> np.ndarray:
    """``i32[S]``: the fewest tokens from each state of one table (``next_state i32[S, C]``, -1: not
    allowed; ``accepting bool[S]``) to an accepting state; a state with none reachable gets `FAR`."""
    source, column = np.nonzero(next_state >= 0)
    return edge_distances(source, next_state[source, column], accepting)


def edge_distances(source: np.ndarray, target: np.ndarray, goal: np.ndarray) -> np.ndarray:
    """``i32[S]``: the fewest edges (``source[e] -> target[e]``, state indices) from each state to one
    where ``goal`` (bool[S]) holds; `FAR` where none is reachable. A breadth-first walk back from the
    goal states, one level at a time over the edges into the level (edges sorted by their target):
    time linear in the edges, whatever the width of a dense table they come from."""
    order = np.argsort(target, kind="stable")
    source, first = source[order], np.searchsorted(target[order], np.arange(goal.size + 1))
    distance = np.where(goal, 0, FAR).astype(np.int32)
    level, frontier = 0, np.flatnonzero(goal)
    while frontier.size:
        level += 1
        parents = np.unique(source[ranges(first[frontier], first[frontier + 1])])
        frontier = parents[distance[parents] == FAR]
        distance[frontier] = level
    return distance


def ranges(starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """``i64[sum(ends - starts)]``: the indices ``starts[i] .. ends[i] - 1`` of every range, in order."""
    counts = ends - starts
    return np.repeat(starts - np.cumsum(counts) + counts, counts) + np.arange(counts.sum())


def allowed(grammar: DeviceGrammar, states: jax.Array, remaining: jax.Array | None = None) -> jax.Array:
    """``bool[..., V]``: the tokens allowed in ``states`` (i32[...]; DEAD counts as FREE); with
    ``remaining`` (i32[...], tokens that may follow), only those from whose next state a match is
    that near, unless none is (module docstring)."""
    successors = grammar.next_state[jnp.where(states == DEAD, FREE, states)]  # i32[..., C] per token class
    ok = successors >= 0
    if remaining is not None:
        near = ok & (grammar.distance[jnp.maximum(successors, 0)] <= remaining[..., None])
        ok = jnp.where(jnp.any(near, axis=-1, keepdims=True), near, ok)
    return jnp.take(ok, grammar.token_class, axis=-1)


def finished(grammar: DeviceGrammar, states: jax.Array, remaining: jax.Array) -> jax.Array:
    """``bool[...]``: rows in ``states`` (i32[...]) that may still emit ``remaining`` (i32[...]) tokens
    but end here: the text is a whole match and no text token (a stop token aside) leads to one within
    the budget. Never for the free grammar, nor once the budget is spent (that stop is the length's)."""
    successors = grammar.next_state[jnp.maximum(states, 0)]  # i32[..., C] per token class
    fits = ((successors >= 0) & ~grammar.stop_class
            & (grammar.distance[jnp.maximum(successors, 0)] <= remaining[..., None] - 1))
    return grammar.accepting[jnp.maximum(states, 0)] & (states != DEAD) & (remaining > 0) & ~jnp.any(fits, axis=-1)


def advance_run(constraint: RowGrammar, tokens: jax.Array, count: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The states after the first ``count[b]`` tokens of ``tokens`` (i32[B,K]) from ``constraint.states``,
    and i32[B] the length of the run cut after its first token where the row is `finished`."""
    states, cut = constraint.states, count
    for j in range(tokens.shape[1]):
        moved = advance(constraint.tables, states, tokens[:, j])
        take = j < cut
        states = jnp.where(take, moved, states)
        cut = jnp.where(take & finished(constraint.tables, moved, constraint.budget - j - 1), j + 1, cut)
    return states, cut


def advance(grammar: DeviceGrammar, states: jax.Array, tokens: jax.Array) -> jax.Array:
    """``i32[...]``: the states after ``tokens`` (i32[...]) in ``states``; DEAD where a token is not
    allowed, and where the state already was DEAD."""
    after = grammar.next_state[jnp.maximum(states, 0), grammar.token_class[tokens]]
    return jnp.where(states == DEAD, DEAD, after)


def path_states(grammar: DeviceGrammar, states: jax.Array, candidates: jax.Array,
                parents: jax.Array | None = None) -> jax.Array:
    """``i32[B,N+1]``: the state after each input of ``[t0, candidates]``, where ``states`` (i32[B])
    is the state after t0 and ``candidates`` (i32[B,N]) are a chain, or a tree's nodes with
    ``parents`` (i32[B,N], `token_tree.ROOT` for a child of t0; parents come before their children)."""
    batch, nodes = candidates.shape
    out = jnp.zeros((batch, nodes + 1), jnp.int32).at[:, 0].set(states)
    if nodes == 0:
        return out
    parent_input = (jnp.broadcast_to(jnp.arange(nodes), (batch, nodes)) if parents is None
                    else jnp.where(parents == token_tree.ROOT, 0, parents + 1))  # i32[B,N] verify input of the parent

    def step(c, out):
        before = jnp.take_along_axis(out, jax.lax.dynamic_slice_in_dim(parent_input, c, 1, axis=1), axis=1)[:, 0]
        return out.at[:, c + 1].set(advance(grammar, before, candidates[:, c]))

    return jax.lax.fori_loop(0, nodes, step, out)
