"""The engine's seams (docs/design.md section 9): a drafter that reads the target's hidden states
runs through the engine with no edit of it.

`FeatureRecorder` declares `reads_hidden = (0, FINAL_NORM)`, proposes with the
n-gram lookup (so drafts are both accepted and rejected), and records every
feature the engine hands it: the prompt's in `init`, each round's in its
`commit` hook; with a `TreeShape` it proposes the n-gram trie, and the engine must
hand it the accepted path's features as a chain's. Its `propose` checks on device that `DraftContext.features` and
`last_emit` are what the previous round committed. After the loop, the
recorded features of every committed token (all but the final t0) must equal
the hidden states of one fresh target pass over the whole sequence, which
reaches them by another path (one prefill-shaped pass instead of rounds of
verify passes and rollbacks).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import engine_helpers as H
from specdec_jax import engine
from specdec_jax.drafters import NgramDrafter
from specdec_jax.drafters.base import DrafterBase
from specdec_jax.target import FINAL_NORM
from specdec_jax.token_tree import TreeShape

LAYERS = (0, FINAL_NORM)


@dataclasses.dataclass(frozen=True)
class FeatureRecorder(DrafterBase):
    """N-gram proposals; records the target features it is handed (state: a dict of arrays)."""

    name: str = "feature-recorder"
    params: None = None
    reads_hidden: tuple[int, ...] = LAYERS
    tree: TreeShape | None = None

    def init(self, params, prefill):
        batch, width, layers, hidden = prefill.features.shape
        features = jnp.zeros((batch, prefill.capacity + 1, layers, hidden), jnp.float32)
        zeros = jnp.zeros((batch,), jnp.int32)
        return dict(features=features.at[:, :width].set(prefill.features[:, : prefill.capacity + 1]),
                    emitted=zeros, last_emit=zeros, ctx_error=jnp.zeros((), jnp.float32),
                    last_emit_error=zeros, over_room=zeros)

    def propose(self, params, state, ctx, gamma):
        # ctx.features entry j < last_emit is the committed token at num_tokens - 1 - last_emit + j.
        index, valid = _committed_index(ctx.num_tokens, ctx.last_emit, gamma + 1)
        recorded = jnp.take_along_axis(state["features"], index[:, :, None, None], axis=1)
        error = jnp.where(valid[:, :, None, None], jnp.abs(recorded - ctx.features), 0.0).max()
        proposal, _ = NgramDrafter(tree=self.tree).propose(None, None, ctx, gamma)
        return proposal, dict(state, ctx_error=jnp.maximum(state["ctx_error"], error),
                              last_emit_error=state["last_emit_error"] + (ctx.last_emit != state["last_emit"]),
                              over_room=state["over_room"] + (ctx.room < 0))

    def commit(self, params, state, outcome):
        index, valid = _committed_index(outcome.num_tokens, outcome.n_emit, outcome.features.shape[1])
        rows = jnp.arange(index.shape[0])[:, None]
        index = jnp.where(valid, index, state["features"].shape[1])  # invalid entries are dropped
        features = state["features"].at[rows, index].set(outcome.features, mode="drop")
        return dict(state, features=features, emitted=state["emitted"] + outcome.n_emit, last_emit=outcome.n_emit)


def _committed_index(num_tokens, n_emit, width):
    """(i32[B,width] sequence index of verify input j, bool[B,width] j < n_emit) after a commit."""
    column = jnp.arange(width)[None, :]
    return jnp.maximum(num_tokens[:, None] - 1 - n_emit[:, None] + column, 0), column < n_emit[:, None]


SHAPES = {"chain": None, "trie": TreeShape(nodes=12, depth=4, topk=3)}


@functools.cache
def recorded_run(shape: str = "chain"):
    tree = SHAPES[shape]
    run = engine.prepare(H.target(), H.RAGGED, FeatureRecorder(tree=tree), gamma=H.GAMMA if tree is None else None,
                         max_new_tokens=H.MAX_NEW, eos_id=H.eos_id())
    return jax.device_get(engine.run_loop(run.spec, run.params, run.state)), run.num_rows


@pytest.mark.parametrize("shape", list(SHAPES))
def test_feature_reading_drafter_is_lossless_and_its_commit_hook_sees_every_token(shape):
    state, rows = recorded_run(shape)
    out = [state.tokens[b, len(p) : state.num_tokens[b]].tolist() for b, p in enumerate(H.RAGGED)]
    assert out == H.reference().tokens
    drafter = state.drafter_state
    np.testing.assert_array_equal(drafter["emitted"][:rows], [len(o) for o in out])
    assert drafter["ctx_error"] == 0.0  # DraftContext.features are the last round's committed features
    assert not drafter["last_emit_error"].any() and not drafter["over_room"].any()
    c = state.counters
    assert 0 < c.accepted.sum() < c.drafted.sum()  # multi-token commits and rejections both happened


@pytest.mark.parametrize("shape", list(SHAPES))
def test_features_handed_to_the_drafter_equal_a_fresh_target_pass(shape):
    state, rows = recorded_run(shape)
    model, params = H.target().as_target()
    apply = jax.jit(model.apply, static_argnames=("hidden_layers", "compute_logits"))
    for b in range(rows):
        n = int(state.num_tokens[b]) - 1  # every committed token but the final t0 has features
        sequence = jnp.asarray(state.tokens[b : b + 1, :n])
        _, hidden, _ = apply(params, sequence, model.init_cache(1, n), jnp.arange(n)[None], None, LAYERS,
                             compute_logits=False)
        expected = np.asarray(hidden[:, 0]).transpose(1, 0, 2)  # [n, k, H]
        np.testing.assert_allclose(state.drafter_state["features"][b, :n], expected, rtol=2e-4, atol=2e-4)
