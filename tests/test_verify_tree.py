"""Tree verification: hand cases, chains as the special case, and the sequence law under sampling.

The law tests build, for N rows, a depth-3 tree (1 to 4 children per node, 24 nodes) over a
toy model whose laws depend on the whole context (tables indexed by the path), verify it once, and
extend each emitted run with the target's own draws to 4 tokens. The 4-token
sequences must then follow the target's sequence law exactly: a chi-square test
at significance 1e-4 per case (3 cases and a power check: a false alarm on a
fresh seed has probability below 4e-4). Verifying children drawn without
replacement with the i.i.d. rule is detected (the power check).
"""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from specdec_jax import token_tree
from specdec_jax.rng import position_keys
from specdec_jax.verify import verify_greedy, verify_stochastic
from specdec_jax.verify_tree import verify_tree_greedy, verify_tree_stochastic

CHI2_SIGNIFICANCE = 1e-4


def row_keys(seed, rows, width):
    return position_keys(jax.random.key(seed), jnp.arange(rows), jnp.broadcast_to(jnp.arange(width), (rows, width)))


# --- structure -----------------------------------------------------------------------------------------------

def test_structure_depths_ancestors_paths_and_compaction():
    parents = jnp.array([[-1, -1, 0, 0, 2, 1]])
    depth, ancestors = token_tree.structure(parents)
    assert depth.tolist() == [[0, 1, 1, 2, 2, 3, 2]]
    # input 5 (node 4): itself, node 2, node 0 and t0
    assert np.flatnonzero(ancestors[0, 5]).tolist() == [0, 1, 3, 5]
    assert np.flatnonzero(ancestors[0, 0]).tolist() == [0]
    assert token_tree.sibling_rank(parents).tolist() == [[0, 1, 0, 1, 0, 0]]
    assert token_tree.path_to(jnp.array([4]), jnp.array([3]), parents, 6).tolist() == [[0, 2, 4, -1, -1, -1]]
    assert token_tree.path_to(jnp.array([0]), jnp.array([0]), parents, 3).tolist() == [[-1, -1, -1]]
    tokens = jnp.array([[10, 11, 12, 13, 14, 15]])
    keep = jnp.array([[True, False, True, True, True, False]])  # drop node 1 and its child
    t, p, n = token_tree.compact(tokens, parents, keep)
    assert n.tolist() == [4] and t[0, :4].tolist() == [10, 12, 13, 14] and p[0, :4].tolist() == [-1, 0, 0, 1]


def test_static_tree_orders_choices_and_rejects_bad_ones():
    parents, depth, rank = token_tree.static_tree([[1], [0, 0], [0], [0, 1], [0, 0, 0]])
    assert parents.tolist() == [-1, -1, 0, 0, 2] and depth.tolist() == [1, 1, 2, 2, 3]
    assert rank.tolist() == [0, 1, 0, 1, 0]
    with pytest.raises(ValueError, match="no parent"):
        token_tree.static_tree([[0, 0]])
    with pytest.raises(ValueError, match="twice"):
        token_tree.static_tree([[0], [0]])
    with pytest.raises(ValueError, match="earlier node"):
        token_tree.check_parents(np.array([-1, 2, 0]))


# --- greedy --------------------------------------------------------------------------------------------------

def test_greedy_takes_the_deepest_good_node_then_the_argmax():
    # target argmax at inputs [t0, n0..n4]: after t0 -> 7, after n0 -> 8, after n1 -> 5, after n3 -> 9
    parents = jnp.array([[-1, -1, 0, 1, 3]])
    tokens = jnp.array([[7, 7, 3, 5, 9]])  # duplicate siblings n0, n1; only n1's subtree goes deep
    argmax = jnp.array([[7, 8, 5, 0, 9, 4]])
    out = verify_tree_greedy(tokens, parents, jnp.ones((1, 5), bool), argmax)
    assert out.n_accepted.tolist() == [3] and out.path[0, :3].tolist() == [1, 3, 4]
    assert out.tokens[0, :4].tolist() == [7, 5, 9, 4] and out.n_emit.tolist() == [4]
    # invalid nodes never count; a stop token on the path ends the run (kept)
    valid = jnp.array([[True, True, True, False, False]])
    cut = verify_tree_greedy(tokens, parents, valid, argmax)
    assert cut.n_accepted.tolist() == [1] and cut.tokens[0, :2].tolist() == [7, 8]
    stop = verify_tree_greedy(tokens, parents, jnp.ones((1, 5), bool), argmax, stop_ids=(5,))
    assert stop.n_emit.tolist() == [2] and stop.tokens[0].tolist() == [7, 5, 0, 0, 0, 0]
    budget = verify_tree_greedy(tokens, parents, jnp.ones((1, 5), bool), argmax, budget=jnp.array([1]))
    assert budget.n_emit.tolist() == [1]


def test_greedy_on_a_chain_is_the_chain_rule():
    rng = np.random.default_rng(0)
    batch, gamma = 512, 5
    argmax = rng.integers(0, 3, (batch, gamma + 1))
    drafts = np.where(rng.random((batch, gamma)) < 0.7, argmax[:, :-1], rng.integers(0, 3, (batch, gamma)))
    num_draft = rng.integers(0, gamma + 1, batch)
    valid = np.arange(gamma)[None] < num_draft[:, None]
    chain = verify_greedy(drafts, argmax, num_draft, stop_ids=(2,))
    as_tree = verify_tree_greedy(drafts, token_tree.chain_parents(batch, gamma), valid, argmax, stop_ids=(2,))
    for a, b in zip(chain[:3], as_tree[:3]):
        np.testing.assert_array_equal(a, b)


# --- sampling: chains --------------------------------------------------------------------------------------

@pytest.mark.parametrize("point_mass", [False, True])
def test_sampling_on_a_chain_draws_what_the_chain_rule_draws(point_mass):
    rng = np.random.default_rng(1)
    batch, gamma, vocab = 4096, 4, 6
    p = rng.dirichlet(np.full(vocab, 0.8), (batch, gamma + 1)).astype(np.float32)
    q = rng.dirichlet(np.full(vocab, 0.8), (batch, gamma)).astype(np.float32)
    drafts = np.stack([[rng.choice(vocab, p=q[b, i] / q[b, i].sum()) for i in range(gamma)] for b in range(batch)])
    num_draft = rng.integers(0, gamma + 1, batch)
    valid = np.arange(gamma)[None] < num_draft[:, None]
    keys = row_keys(3, batch, gamma + 1)
    law = None if point_mass else jnp.asarray(q)
    chain = verify_stochastic(keys, drafts, law, p, num_draft)
    as_tree = verify_tree_stochastic(keys, drafts, token_tree.chain_parents(batch, gamma), valid, law, p)
    mismatch = np.flatnonzero(np.any(np.asarray(chain.tokens) != np.asarray(as_tree.tokens), axis=1))
    assert len(mismatch) <= 2, f"{len(mismatch)} of {batch} rows differ"  # float rounding at a threshold only
    np.testing.assert_array_equal(np.delete(np.asarray(chain.n_emit), mismatch),
                                  np.delete(np.asarray(as_tree.n_emit), mismatch))


# --- sampling: the sequence law on a toy model -----------------------------------------------------------

V = 5
# children of the i-th node of each level (cycling): depth 1: 4; depth 2: 3, 2, 2, 1; depth 3: 2, 1, ...
BRANCHING = ((4,), (3, 2, 2, 1), (2, 1))  # 4 + 8 + 12 = 24 nodes
ROWS = 300_000


def toy_laws(seed):
    """Target and draft laws indexed by the context: p[d] f32[V]*d + [V] for d = 0..3; the draft
    gives zero mass to one token of every context the target does not."""
    rng = np.random.default_rng(seed)
    p = [rng.dirichlet(np.full(V, 1.5), size=(V,) * d) for d in range(4)]
    q = []
    for d in range(3):
        law = rng.dirichlet(np.full(V, 1.5), size=(V,) * d)
        hole = rng.integers(0, V, size=(V,) * d)
        law = np.where(np.arange(V) == hole[..., None], 0.0, law)
        q.append(law / law.sum(-1, keepdims=True))
    return p, q


def tree_topology():
    """parents i32[N] and depth i32[N] of the fixed tree, breadth first."""
    parents, depth, level = [], [], [-1]
    for d, widths in enumerate(BRANCHING, start=1):
        nxt = []
        for i, parent in enumerate(level):
            for _ in range(widths[i % len(widths)]):
                nxt.append(len(parents))
                parents.append(parent)
                depth.append(d)
        level = nxt
    return np.array(parents, np.int32), np.array(depth, np.int32)


def law_at(table, contexts):
    """f32[R,V] rows of `table` at contexts i32[R,d]."""
    return table[tuple(contexts.T)] if contexts.shape[1] else np.broadcast_to(table, (contexts.shape[0], V))


def draw(rng, laws):
    """One i32 draw per row of f32[R,V]."""
    return (rng.random((laws.shape[0], 1)) > np.cumsum(laws, -1)).sum(-1).clip(0, V - 1)


def build_trees(kind, p, q, rng):
    """tokens i32[R,N], draft laws f32[R,N,V] and target laws f32[R,N+1,V] of R random trees."""
    parents, depth = tree_topology()
    nodes = len(parents)
    tokens = np.zeros((ROWS, nodes), np.int64)
    laws = np.zeros((ROWS, nodes, V))
    contexts = {-1: np.zeros((ROWS, 0), np.int64)}
    for parent in [-1] + list(range(nodes)):
        children = np.flatnonzero(parents == parent)
        if not len(children):
            continue
        ctx = contexts[parent]
        s = law_at(q[ctx.shape[1]], ctx)
        remaining = s.copy()
        order = np.argsort(-s + 1e-9 * np.arange(V), axis=1)  # deterministic top ranks
        for i, c in enumerate(children):
            if kind == "point_mass":  # ranks 0, 0, 1, 2: a duplicate sibling, fixed by the context
                x = order[:, [0, 0, 1, 2][i]]
            elif kind == "iid":
                x = draw(rng, s)
            else:
                x = draw(rng, remaining / remaining.sum(-1, keepdims=True))
                remaining[np.arange(ROWS), x] = 0.0
            tokens[:, c], laws[:, c] = x, s
            contexts[c] = np.concatenate([ctx, x[:, None]], axis=1)
    target = np.stack([law_at(p[contexts[u].shape[1]], contexts[u]) for u in [-1] + list(range(nodes))], axis=1)
    return parents, tokens, laws, target


def sequence_counts(kind, seed, rule_without_replacement):
    p, q = toy_laws(seed)
    rng = np.random.default_rng(seed + 1)
    parents, tokens, laws, target = build_trees(kind, p, q, rng)
    nodes = len(parents)
    out = jax.jit(verify_tree_stochastic, static_argnames="without_replacement")(
        row_keys(seed, ROWS, nodes + 1), jnp.asarray(tokens, jnp.int32),
        jnp.broadcast_to(jnp.asarray(parents), tokens.shape), jnp.ones(tokens.shape, bool),
        None if kind == "point_mass" else jnp.asarray(laws, jnp.float32), jnp.asarray(target, jnp.float32),
        without_replacement=rule_without_replacement)
    run, n_emit = np.asarray(out.tokens), np.asarray(out.n_emit)
    seq = np.zeros((ROWS, 4), np.int64)
    for j in range(4):  # the emitted run, then the target's own draws
        own = draw(rng, law_at(p[j], seq[:, :j]))
        seq[:, j] = np.where(j < n_emit, run[:, j], own)
    exact = np.ones((V,) * 4)
    for y in itertools.product(range(V), repeat=4):
        exact[y] = np.prod([p[j][y[:j]][y[j]] for j in range(4)])
    return np.bincount(np.ravel_multi_index(seq.T, (V,) * 4), minlength=V ** 4), exact.reshape(-1)


def chi2_p_value(counts, law):
    expected = law * counts.sum()
    small = expected < 5  # pooled into one cell
    obs = np.append(counts[~small], counts[small].sum())
    exp = np.append(expected[~small], expected[small].sum())
    stat = ((obs - exp) ** 2 / exp).sum()
    return stats.chi2.sf(stat, len(obs) - 1)


@pytest.mark.parametrize("kind", [pytest.param("point_mass", marks=pytest.mark.slow), "iid", "without_replacement"])
def test_sampled_trees_follow_the_target_sequence_law(kind):
    counts, law = sequence_counts(kind, seed=11, rule_without_replacement=kind == "without_replacement")
    assert chi2_p_value(counts, law) > CHI2_SIGNIFICANCE


@pytest.mark.slow  # suite time: a check of the check
def test_the_sequence_law_test_has_power():
    """Children drawn without replacement but verified with the i.i.d. rule: the law is off."""
    counts, law = sequence_counts("without_replacement", seed=11, rule_without_replacement=False)
    assert chi2_p_value(counts, law) < 1e-12
