"""Token trees through the engine: lossless greedy and penalised decoding, ragged rows equal solo
runs, caches after every round equal a fresh prefill of the committed tokens (the accepted path
is compacted to the front), and clear errors for shapes the engine cannot run.

Two tree drafters: the n-gram trie (several matches' continuations merged) and `DecoyTree`
(engine_helpers), which hides the oracle's chain among wrong siblings so the accepted path
runs through second children and past decoy subtrees. The sampling law of trees through the
engine is in test_engine_law.py.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import numpy as np
import pytest

import engine_helpers as H
from specdec_jax import engine
from specdec_jax.engine import generate
from specdec_jax.drafters import ModelDrafter
from specdec_jax.sampling import SamplingParams
from specdec_jax.token_tree import TreeShape

TREES = {"trie": H.ngram_trie, "decoy-oracle": lambda: H.decoy_tree(H.oracle(0.7)),
         "draft-model": lambda: dataclasses.replace(H.model_drafter(), tree=TreeShape(nodes=8, depth=4, topk=2))}


@functools.cache
def tree_run(name: str):
    return generate(H.target(), H.RAGGED, TREES[name](), max_new_tokens=H.MAX_NEW, eos_id=H.eos_id())


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n == "decoy-oracle" else n for n in TREES])
def test_greedy_tree_equals_plain_decoding(name):
    ref, out = H.reference(), tree_run(name)
    assert out.tokens == ref.tokens and out.stop_reasons == ref.stop_reasons
    m = out.metrics
    assert m.emitted_tokens == sum(map(len, ref.tokens))
    assert m.accepted_tokens > 0 and m.rounds < ref.metrics.rounds
    depth = TREES[name]().tree.depth  # counted by depth: full-depth trees were verified, none deeper
    assert m.position_proposed[depth - 1] > 0 and not any(m.position_proposed[depth:])


@pytest.mark.slow  # CI time; dynamic trees stay lossless in test_greedy_tree_equals_plain_decoding[draft-model]
def test_a_dynamic_tree_of_the_target_itself_accepts_its_whole_depth():
    """The target as its own draft, every candidate kept (2 + 3 * 4 = 14 nodes): its top-1 path
    is the greedy continuation, so nearly every round accepts all 4 levels and emits 5 tokens
    (the budget and EOS cut the last rounds). With fewer nodes the tiny model's flat laws rank
    deep nodes below shallow ones, as EAGLE-2's selection should."""
    cfg, params = H.target().config, H.target().model.params()
    drafter = ModelDrafter(cfg, params, tree=TreeShape(nodes=14, depth=4, topk=2))
    out = generate(H.target(), H.RAGGED, drafter, max_new_tokens=H.MAX_NEW, eos_id=H.eos_id())
    assert out.tokens == H.reference().tokens
    assert out.metrics.mean_accepted_length > 4.5


@pytest.mark.slow  # CI time; the trie's branching is checked node by node in test_tree_drafters
def test_trie_beats_the_chain_where_matches_branch():
    """On a prompt whose suffix recurs with different continuations, the trie's second branch
    is accepted where the chain's single (most recent) continuation fails."""
    from specdec_jax.drafters import NgramDrafter
    from specdec_jax.token_tree import TreeShape

    prompt = [[7, 8, 1, 2, 3, 9, 9, 7, 8, 4, 5, 6, 9, 9, 7, 8, 1, 2, 3, 9, 9, 7, 8]]
    chain = NgramDrafter()
    trie = NgramDrafter(tree=TreeShape(nodes=8, depth=4, topk=2))
    run = H.prepare(prompt, trie, gamma=None)
    drafted = run.round()
    parents = np.asarray(drafted.proposal.parents[0, :8]).tolist()
    tokens = np.asarray(drafted.proposal.drafts[0, :8]).tolist()
    # the two latest continuations of [9, 9, 7, 8]: 1 2 3 9 and 4 5 6 9, as two branches, the best first
    assert tokens == [1, 2, 3, 9, 4, 5, 6, 9] and parents == [-1, 0, 1, 2, -1, 4, 5, 6]
    chain_run = H.prepare(prompt, chain, gamma=4)
    assert np.asarray(chain_run.round().proposal.drafts[0]).tolist() == [1, 2, 3, 9]


@pytest.mark.parametrize("row", [2, 3])
def test_row_of_a_ragged_tree_batch_equals_its_solo_run(row):
    solo = generate(H.target(), [H.RAGGED[row]], H.ngram_trie(), max_new_tokens=H.MAX_NEW, eos_id=H.eos_id())
    assert solo.tokens[0] == tree_run("trie").tokens[row]


def test_penalised_greedy_tree_equals_plain_decoding():
    """Penalties count each node's own path (ancestors), not its decoy siblings and cousins: the
    exact oracle's drafts (penalised argmaxes) are accepted through second children."""
    sampling = SamplingParams(repetition_penalty=1.5, presence_penalty=0.3)
    ref = generate(H.target(), H.RAGGED, max_new_tokens=H.MAX_NEW, sampling=sampling)
    out = generate(H.target(), H.RAGGED, H.decoy_tree(H.oracle(1.0)), max_new_tokens=H.MAX_NEW, sampling=sampling)
    assert out.tokens == ref.tokens
    assert out.metrics.mean_accepted_length > 3.5  # nearly every round accepts the whole depth-3 path


def test_tree_rounds_leave_caches_equal_to_a_fresh_prefill():
    drafter = H.decoy_tree(H.oracle(0.7))
    run = H.prepare(H.RAGGED, drafter, gamma=None, eos=H.eos_id())
    second_children = 0
    for _ in range(6):
        drafted = run.round()
        s = H.host(run.state)
        second_children += int((np.asarray(s.last_accepted) > 0).sum())  # d1 is node 1, never node 0
        H.assert_caches_rebuilt(run, s)
    assert second_children > 0 and int(jax.device_get(drafted.proposal.num_draft).max()) == 7
    out, _ = run.outputs()
    assert all(o == r[: len(o)] for o, r in zip(out, H.reference().tokens))


def test_tree_shape_errors():
    chain_policy = engine.ShapePolicy((0, 12), (1.0, 1.5), (0.0, 0.0))
    with pytest.raises(ValueError, match="a tree drafter needs a shape policy over node counts"):
        engine.prepare(H.target(), H.RAGGED, H.ngram_trie(), policy=chain_policy)
    tree_policy = engine.ShapePolicy((0, 4), (1.0, 1.5), (0.0, 0.0), tree=True)
    with pytest.raises(ValueError, match="a chain drafter one over chain lengths"):
        engine.prepare(H.target(), H.RAGGED, H.ngram(), policy=tree_policy)
    with pytest.raises(ValueError, match="12 nodes"):
        engine.prepare(H.target(), H.RAGGED, H.ngram_trie(), gamma=4)
