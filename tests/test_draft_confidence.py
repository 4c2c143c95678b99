"""Chains that stop at their first unconfident draft (`--draft-confidence`, `drafters.chain`).

The stopping rule is checked against the draft model run from scratch (a full
forward pass per draft, no cache), and greedy outputs of the draft model and an
EAGLE head against plain decoding; the sampled law under the stop is in
`tests/test_engine_law.py` (cases ``model-stop-g3`` and, slow, ``eagle-stop-g3``).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import numpy as np
import pytest

from specdec_jax.audit import noisy_copy
from specdec_jax.drafters import EagleDrafter, ModelDrafter
from specdec_jax.drafters.eagle import EagleConfig, init_eagle
from specdec_jax.drafters.model import oracle_drafter
from specdec_jax.engine import ShapePolicy, generate, prepare
from specdec_jax.engine.round import draft_step
from specdec_jax.models import load_model
from specdec_jax.models.llama import forward
from specdec_jax.token_tree import TreeShape

GAMMA = 4
STOP = 0.1  # tiny-random's laws are flat: its drafts' confidences lie around 0.05-0.3
EAGLE_STOP = 0.3  # a random EAGLE head's (through the target's LM head) spread more widely
PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9], [100, 20, 30, 40, 50, 60, 70], [5]]
WIDTH = 16  # the reference's padded sequence: the longest prompt, its first token and GAMMA drafts fit
# a fixed policy (not a calibration): rounds of 1 or 4 drafts as the estimates move
POLICY = ShapePolicy((0, 1, 4), (1.0, 1.1, 1.3), (0.0, 0.1, 0.4), prior=0.9)


@functools.cache
def target():
    return load_model("tiny-random")


@functools.cache
def draft():
    """The target's weights with a little noise: right on about two drafts in three."""
    return noisy_copy(target().model, scale=0.05)


def stopping_drafter(stop: float = STOP) -> ModelDrafter:
    return ModelDrafter(draft().config, draft().params(), stop_below=stop)


def stopping_eagle(stop: float) -> EagleDrafter:
    """A random EAGLE head on the target's features, its chains stopped below ``stop``."""
    cfg = target().config
    head = EagleConfig(cfg.hidden_size, cfg.vocab_size, 64, 2, 1, 32)
    return EagleDrafter(head, init_eagle(head, jax.random.key(5)), stop_below=stop)


@functools.cache
def draft_forward():
    """The draft's softmax at every position of a sequence padded to WIDTH tokens, from scratch (no cache kept)."""
    config = draft().config
    return jax.jit(lambda params, tokens: jax.nn.softmax(
        forward(config, params, tokens, config.init_cache(1, WIDTH))[0][0], axis=-1))


def reference_chain(committed: list[int], stop: float) -> list[int]:
    """The draft's greedy chain after ``committed``, up to GAMMA drafts and ended after the first whose
    softmax probability is below ``stop``: one full forward pass per draft (causal: the padding after the
    sequence is never seen)."""
    chain = []
    while len(chain) < GAMMA:
        sequence = committed + chain
        tokens = np.zeros((1, WIDTH), np.int32)
        tokens[0, : len(sequence)] = sequence
        probs = np.asarray(draft_forward()(draft().params(), tokens))[len(sequence) - 1]
        chain.append(int(np.argmax(probs)))
        if probs.max() < stop:
            break
    return chain


def test_a_chain_stops_after_its_first_unconfident_draft():
    run = prepare(target(), PROMPTS, stopping_drafter(), gamma=GAMMA, max_new_tokens=16)
    proposal = draft_step(run.spec, run.params, run.state).proposal
    drafts, counts = np.asarray(proposal.drafts), np.asarray(proposal.num_draft)
    tokens, lengths = np.asarray(run.state.tokens), np.asarray(run.state.num_tokens)
    expected = [reference_chain(tokens[b, : lengths[b]].tolist(), STOP) for b in range(len(PROMPTS))]
    assert counts[: len(PROMPTS)].tolist() == [len(chain) for chain in expected]
    for b, chain in enumerate(expected):
        assert drafts[b, : len(chain)].tolist() == chain
    assert len({len(chain) for chain in expected}) > 1  # rows stopped at different drafts


@pytest.mark.parametrize("drafter, gamma", [("model", GAMMA), ("model", "auto"), ("eagle", GAMMA)])
def test_greedy_chains_with_a_confidence_stop_equal_plain_decoding(drafter, gamma):
    plain = generate(target(), PROMPTS, None, gamma=0, max_new_tokens=24)
    stopping = stopping_drafter() if drafter == "model" else stopping_eagle(EAGLE_STOP)
    spec = generate(target(), PROMPTS, stopping, gamma=gamma, policy=POLICY if gamma == "auto" else None,
                    max_new_tokens=24)
    assert spec.tokens == plain.tokens
    proposed, accepted = spec.metrics.position_proposed, spec.metrics.position_accepted
    assert proposed[-1] > 0  # some chains ran to the end
    assert proposed[1] < 0.8 * proposed[0]  # and many stopped at their first draft
    if drafter == "model":  # (a random EAGLE head is rarely right)
        assert accepted[-1] > 0


def test_trees_and_the_oracle_refuse_a_confidence_stop():
    with pytest.raises(ValueError, match="a draft confidence stops chains"):
        dataclasses.replace(stopping_eagle(0.5), tree=TreeShape(nodes=4, depth=2, topk=2))
    with pytest.raises(ValueError, match="stops chains drawn from a drafter's law"):
        oracle = oracle_drafter(target().config, target().model.params(), 0.8)
        ModelDrafter(oracle.config, oracle.params, oracle=True, stop_below=0.5)
    with pytest.raises(ValueError, match=r"must be in \[0, 1\)"):
        stopping_drafter(1.0)
