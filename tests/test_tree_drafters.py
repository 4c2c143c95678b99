"""The tree drafters' proposals against independent references.

- n-gram trie: the set of root-to-node token paths equals a plain-Python trie of the K best
  matches' continuations, on random buffers;
- Medusa static tree: node (r_1 .. r_d) is head d's r_d-th most likely token, from the heads'
  logits computed here;
- EAGLE's and the draft model's dynamic trees: with top-1 each is the chain's greedy drafts, round after round; with top-2
  and every candidate kept, each expanded node holds exactly the 2 most likely children of its
  path, and the expanded nodes are those of best cumulative log-probability, under a reference
  that runs from scratch (the draft model: one fresh pass over the sequence and the path; the
  EAGLE head: a fresh target pass for the features, then the path fed token by token with cache
  writes), also after tree rounds have been committed.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import engine_helpers as H
from specdec_jax import engine
from specdec_jax.drafters import EagleConfig, EagleDrafter, MedusaConfig, MedusaDrafter, ModelDrafter, NgramDrafter
from specdec_jax.drafters.eagle import head_logits, head_pass, init_eagle, project
from specdec_jax.drafters.dynamic_tree import grow_dynamic_tree
from specdec_jax.drafters.medusa import medusa_logits
from specdec_jax.sampling import RowSampling, SamplingParams
from specdec_jax.target import FINAL_NORM
from specdec_jax.token_tree import TreeShape, default_choices, static_tree
from test_drafters import context


def node_paths(tokens, parents, count):
    """Root-to-node token paths of one row's tree, checking parents come first."""
    paths = []
    for c in range(count):
        assert parents[c] < c
        paths.append((paths[parents[c]] if parents[c] >= 0 else ()) + (int(tokens[c]),))
    return paths


def reference_trie(h, k, depth, max_n, min_n):
    """Prefixes of the continuations of the k best starts (longest match, then most recent),
    skipping starts whose continuation a chosen one already covers."""
    length, scored = len(h), []
    for p in range(length):
        n = 0
        while n < max_n and p - n - 1 >= 0 and h[p - n - 1] == h[length - n - 1]:
            n += 1
        if n >= min_n:
            scored.append((n, p))
    best = []
    for _, p in sorted(scored, reverse=True):  # skip a continuation that is a prefix of a chosen one
        if len(best) < k and not any(h[p : p + depth] == h[q : q + depth][: len(h[p : p + depth])] for q in best):
            best.append(p)
    return {tuple(h[p : p + d]) for p in best for d in range(1, depth + 1) if p + d <= length}


def test_ngram_trie_matches_a_python_trie_on_random_buffers():
    rng = np.random.default_rng(5)
    rows = [rng.integers(0, 3, int(n)).tolist() for n in rng.integers(2, 20, 48)]
    shape = TreeShape(nodes=12, depth=4, topk=3)
    drafter = NgramDrafter(max_n=3, min_n=1, tree=shape)
    p = jax.device_get(jax.jit(lambda c: drafter.propose(None, None, c, 12)[0])(context(rows)))
    branched = 0
    for b, row in enumerate(rows):
        paths = node_paths(p.drafts[b], p.parents[b], int(p.num_draft[b]))
        assert len(set(paths)) == len(paths)  # merged: one node per distinct prefix
        assert set(paths) == reference_trie(row, 3, 4, 3, 1), row
        branched += sum(len(q) == 1 for q in paths) > 1
    assert branched > 10


def test_ngram_trie_lists_the_best_matchs_chain_first():
    """Every prefix of the trie is a trie (parents first), and its first nodes are the chain drafter's
    drafts: a shape policy that verifies n <= depth nodes verifies the n-gram chain."""
    rng = np.random.default_rng(6)
    rows = [rng.integers(0, 3, int(n)).tolist() for n in rng.integers(2, 20, 48)]
    trie = NgramDrafter(max_n=3, min_n=1, tree=TreeShape(nodes=12, depth=4, topk=3))
    chain = NgramDrafter(max_n=3, min_n=1)
    t = jax.device_get(jax.jit(lambda c: trie.propose(None, None, c, 12)[0])(context(rows)))
    c = jax.device_get(jax.jit(lambda c: chain.propose(None, None, c, 4)[0])(context(rows)))
    for b in range(len(rows)):
        n = int(c.num_draft[b])
        assert t.drafts[b, :n].tolist() == c.drafts[b, :n].tolist(), rows[b]
        assert t.parents[b, :n].tolist() == list(range(-1, n - 1))
        assert all(t.parents[b, i] < i for i in range(12))


def random_medusa(heads=3):
    rng = np.random.default_rng(4)
    h = H.target().config.hidden_size
    params = {"w": (rng.standard_normal((heads, h, h)) / np.sqrt(h)).astype(np.float32),
              "b": rng.standard_normal((heads, h)).astype(np.float32)}
    return MedusaDrafter(MedusaConfig(h, H.target().config.vocab_size, heads), params)


def test_medusa_static_tree_takes_each_heads_ranked_tokens():
    choices = default_choices(9, 3, 3)
    drafter = dataclasses.replace(random_medusa(), tree=TreeShape.from_choices(choices))
    run = H.prepare(H.RAGGED, drafter, gamma=None)
    proposal = jax.device_get(engine.draft_step(run.spec, run.params, run.state).proposal)
    model, params = H.target().as_target()
    logits = np.asarray(medusa_logits(drafter.config, drafter.params, model, params, run.state.drafter_state))
    parents, depth, rank = static_tree(choices)
    for b in range(run.num_rows):
        ranked = np.argsort(-logits[:, b], axis=-1, kind="stable")  # [K,V]
        assert proposal.parents[b].tolist() == parents.tolist()
        assert proposal.drafts[b].tolist() == [int(ranked[d - 1, r]) for d, r in zip(depth, rank)]


def random_eagle():
    cfg = H.target().config
    head = EagleConfig(cfg.hidden_size, cfg.vocab_size, 256, 4, 2, 32, feature_layers=(1, FINAL_NORM))
    return EagleDrafter(head, init_eagle(head, jax.random.key(7)))


def draft_model():
    return H.model_drafter()


DYNAMIC = {"eagle": random_eagle, "draft-model": draft_model}


@pytest.mark.parametrize("kind", list(DYNAMIC))
def test_top1_dynamic_tree_is_the_greedy_chain_round_after_round(kind):
    chain = DYNAMIC[kind]()
    tree = dataclasses.replace(chain, tree=TreeShape(nodes=4, depth=4, topk=1))
    run = H.prepare(H.RAGGED, tree, gamma=None, max_new_tokens=H.MAX_NEW)
    chain_spec = dataclasses.replace(run.spec, drafter=chain)
    for _ in range(4):
        as_chain = engine.draft_step(chain_spec, run.params, run.state).proposal
        drafted = run.round()
        np.testing.assert_array_equal(drafted.proposal.drafts, as_chain.drafts)
        assert drafted.proposal.parents.tolist() == [[-1, 0, 1, 2]] * 4


@pytest.mark.parametrize("kind", ["eagle", pytest.param("draft-model", marks=pytest.mark.slow), "medusa"])
def test_a_smaller_tree_is_the_first_nodes_of_the_larger(kind):
    """propose(n) is the first n nodes of propose(N): EAGLE-2's n best are a prefix of its N best
    (best first), Medusa's static tree is ordered by depth; so truncating the tree, as a shape
    policy does, verifies the drafter's own tree of that size."""
    drafter = random_medusa() if kind == "medusa" else DYNAMIC[kind]()
    drafter = dataclasses.replace(drafter, tree=TreeShape(nodes=10, depth=3, topk=2))
    run = H.prepare(H.RAGGED, drafter, gamma=None, max_new_tokens=H.MAX_NEW)
    for _ in range(2):  # the first round, and one after a tree round was committed
        whole = jax.device_get(engine.draft_step(run.spec, run.params, run.state).proposal)
        for n in (3, 7):
            spec = dataclasses.replace(run.spec, gamma=n)
            part = jax.device_get(engine.draft_step(spec, run.params, run.state).proposal)
            np.testing.assert_array_equal(part.drafts, whole.drafts[:, :n])
            np.testing.assert_array_equal(part.parents, whole.parents[:, :n])
            assert (np.asarray(whole.parents[:, :n]) < np.arange(n)).all()
        run.round()


_head_pass = jax.jit(head_pass, static_argnums=(0, 2))
_target_apply = jax.jit(lambda p, t, pos, layers: H.target().as_target()[0].apply(
    p, t, H.target().as_target()[0].init_cache(1, 64), pos, None, layers, compute_logits=False)[1],
    static_argnums=3)


def reference_laws(drafter, target_params, sequence, paths):
    """Log-laws of the drafter after ``sequence`` (committed tokens, t0 last) followed by each path:
    a draft model's from one fresh pass each; an EAGLE head's from a fresh target pass for the
    features, then the path fed token by token."""
    if isinstance(drafter, ModelDrafter):
        return {path: np.asarray(jax.nn.log_softmax(H.teacher_logits(drafter.config, drafter.params,
                                                                     sequence + list(path))[-1]))
                for path in paths}
    cfg, (model, _) = drafter.config, H.target().as_target()
    n = len(sequence)
    tokens = jnp.asarray([sequence], jnp.int32)
    hidden = _target_apply(target_params, tokens[:, : n - 1], jnp.arange(n - 1)[None], cfg.feature_layers)
    inputs = project(cfg, drafter.params, hidden.transpose(1, 2, 0, 3))  # [1, n-1, H], feature of token j
    h, cache = _head_pass(cfg, drafter.params, model, target_params, tokens[:, 1:], inputs,
                         cfg.layer.init_cache(1, 64), jnp.arange(n - 1)[None])
    laws = {}
    for path in paths:
        h_prev, c = h[:, -1], cache.with_lengths(jnp.asarray([n - 1]))
        for i, token in enumerate(path):
            h_step, c = _head_pass(cfg, drafter.params, model, target_params, jnp.asarray([[token]]),
                                  h_prev[:, None], c, jnp.asarray([[n - 1 + i]]))
            c, h_prev = c.with_lengths(c.lengths + 1), h_step[:, 0]
        laws[path] = np.asarray(jax.nn.log_softmax(head_logits(cfg, drafter.params, model, target_params, h_prev)))[0]
    return laws


@pytest.mark.slow
@pytest.mark.parametrize("kind", list(DYNAMIC))
def test_dynamic_tree_expands_the_best_nodes_with_their_top_k_children(kind):
    """Top-2, depth 3 and all 2 + 2 * 4 candidates kept: every expanded node holds exactly the 2
    most likely children of its path, and the expanded depth-2 nodes are the 2 of best cumulative
    log-probability, under the reference."""
    drafter = dataclasses.replace(DYNAMIC[kind](), tree=TreeShape(nodes=10, depth=3, topk=2))
    run = H.prepare(H.RAGGED, drafter, gamma=None, max_new_tokens=H.MAX_NEW)
    for round_index in range(3):
        drafted = run.round()
        p, s = jax.device_get(drafted.proposal), jax.device_get(drafted)
        for b in range(run.num_rows):
            n = int(s.num_tokens[b])
            paths = node_paths(p.drafts[b], p.parents[b], int(p.num_draft[b]))
            children = {}
            for path in paths:
                children.setdefault(path[:-1], []).append(path[-1])
            laws = reference_laws(drafter, run.target_params, s.tokens[b, :n].tolist(), set(children))
            for parent, kids in children.items():
                law = laws[parent]
                assert len(kids) == 2 and min(law[kids]) >= np.sort(law)[-2] - 1e-4, (round_index, b, parent)
            depth2 = [q for q in paths if len(q) == 2]
            score = {q: laws[()][q[0]] + laws[q[:1]][q[1]] for q in depth2}
            expanded = sorted(q for q in depth2 if q in children)
            best = sorted(sorted(depth2, key=score.get)[-2:])
            assert expanded == best or np.isclose(*sorted(score.values())[-3:-1], atol=1e-4), (round_index, b)
    assert int(jax.device_get(run.state.counters.emitted).sum()) > 0


def test_a_dynamic_tree_gives_no_node_to_a_banned_token():
    """The children are ranked after the rows' logit bias: the token every node would rank first,
    banned in row 0 only, takes no node there and the most nodes in row 1."""
    v, topk = 8, 2
    favourite = 5  # every node's most likely child
    logits = jnp.asarray(np.log(np.full(v, 0.05)).astype(np.float32)).at[favourite].set(0.0)

    def expand(tokens, mask, depth, inputs):
        return jnp.broadcast_to(logits, tokens.shape[:1] + (topk, v)), None

    sampling = RowSampling.from_params([SamplingParams(logit_bias={favourite: "-inf"}), SamplingParams()], 2)
    tree = grow_dynamic_tree(TreeShape(nodes=6, depth=3, topk=topk), 6, jnp.broadcast_to(logits, (2, v)), None,
                             expand, sampling=sampling)
    drafts = np.asarray(tree.drafts)
    assert favourite not in drafts[0] and (drafts[1] == favourite).sum() >= 3
