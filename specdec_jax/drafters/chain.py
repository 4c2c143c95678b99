"""Drawing a chain of drafts from a drafter's logits, one position after another.

Every drafter that samples from its own law (a draft model, an EAGLE head,
Medusa heads) does the same at each draft position: process its logits with
the row's sampling settings (the transforms the target's law goes through: the
logit bias, penalties counted over the committed tokens and the earlier drafts), draw with
the key of that position (`rng.Purpose.DRAFT`; greedy rows take the argmax), map
a reduced output vocabulary back to target ids, and keep the law as q. Under a
grammar constraint the logits are first masked to the tokens the grammar allows
after the drafts before (`grammar.RowGrammar.constrain`), as the target's are,
so q is the law really drawn from and no draft is wasted on a refused token.
Only how the logits of the next position arise differs: `draw_chain` takes that
as a function.

A chain may stop early (``stop_below``, `--draft-confidence`): after the first
draft whose confidence is below the threshold, the row drafts nothing more, and
once no row drafts, the remaining steps are skipped (a `lax.cond` per step), so
their drafter passes are not paid. A draft's confidence is the probability of
the drawn token under the law it was drawn from, or for a greedy row under the
softmax of its processed logits (the temperature-1 law): EAGLE-2's and
transformers' `assistant_confidence_threshold`. The stop depends on the
drafter's own law and draws only, so verification stays exact.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from specdec_jax.drafters.base import DraftContext, Proposal
from specdec_jax.grammar import advance
from specdec_jax.rng import Purpose, for_purpose
from specdec_jax.sampling import PenaltyCounts, RowSampling, first_argmax, penalize, process_logits, sample

# (carry, token i32[B], index i32[]) -> (logits f32[B,Vo] of draft index + 2, carry): feeds draft index + 1
NextLogits = Callable[[Any, jax.Array, jax.Array], tuple[jax.Array, Any]]


def empty_proposal(batch: int, tree: bool = False) -> Proposal:
    """A proposal of no drafts for ``batch`` rows (a round without speculation): i32[B,0] drafts, a
    count of 0 per row, and with ``tree`` i32[B,0] parents."""
    none = jnp.zeros((batch, 0), jnp.int32)
    return Proposal(none, jnp.zeros((batch,), jnp.int32), None, none if tree else None)


def check_stop_below(stop_below: float, tree) -> None:
    """ValueError unless ``stop_below`` (a drafter's `draw_chain` threshold) is in [0, 1), and 0 for a drafter of
    token trees (``tree`` not None): a dynamic tree keeps its most likely nodes already."""
    if not 0.0 <= stop_below < 1.0:
        raise ValueError(f"the draft confidence a chain stops below must be in [0, 1), got {stop_below}")
    if stop_below and tree is not None:
        raise ValueError("a draft confidence stops chains: a tree keeps its most likely nodes already")


def drafter_sampling(ctx: DraftContext, vocab_map: jax.Array | None, vocab_size: int) -> RowSampling:
    """The rows' sampling settings over the drafter's output ids: a logit bias moved to them
    (`RowSampling.take`) when ``vocab_map`` i32[Vo] reduces the vocabulary of V = ``vocab_size`` ids."""
    return ctx.sampling if vocab_map is None else ctx.sampling.take(vocab_map, vocab_size)


def draw_chain(ctx: DraftContext, gamma: int, first_logits: jax.Array, next_logits: NextLogits, carry: Any,
               vocab_size: int, vocab_map: jax.Array | None = None,
               corrupt_alpha: jax.Array | None = None, stop_below: float = 0.0) -> tuple[Proposal, Any]:
    """``(Proposal with up to gamma drafts per row, carry)``; gamma 0: no drafts and ``carry`` unchanged.

    first_logits: f32[B,Vo] the drafter's logits of draft 1; next_logits feeds each drawn
      draft (a `lax.scan` of gamma - 1 steps) and returns the logits of the next one.
    vocab_map: i32[Vo] target id of each logit (a reduced output vocabulary); None: Vo = V.
    corrupt_alpha: the oracle's corruption, f32[] (drafts kept with probability alpha, q a point mass).
    stop_below: a row's chain ends after its first draft of confidence below this (module docstring): its
      ``num_draft`` counts the drafts up to that one. 0: every row drafts gamma."""
    if gamma == 0:  # a round without speculation: nothing drawn (unused logits are compiled away)
        return empty_proposal(first_logits.shape[0]), carry
    sampling = drafter_sampling(ctx, vocab_map, vocab_size)  # q's transforms are p's
    counts = None  # PenaltyCounts f32[B,Vo] of the committed tokens, then of each draft
    if sampling.use_penalties:
        counts = PenaltyCounts.of_history(ctx.tokens, ctx.num_tokens, ctx.prompt_lens, vocab_size)
        counts = counts if vocab_map is None else counts.take(vocab_map)
    keep_laws = ctx.sampling.any_sampled and corrupt_alpha is None
    constraint = ctx.grammar
    states = None if constraint is None else constraint.states  # i32[B] grammar state before each draft

    def pick(logits, counts, states, index):
        keys = ctx.keys[:, index]  # key[B] of this draft's position
        if constraint is not None:
            logits = constraint.constrain(logits, states, index, vocab_map)
        penalized = penalize(logits, sampling, counts)
        if sampling.any_sampled:
            law = process_logits(logits, sampling, counts)  # f32[B,Vo]
            drawn = _draw(for_purpose(keys, Purpose.DRAFT), law, sampling)  # i32[B] into the Vo ids
        else:  # every row greedy: the token without the law
            law, drawn = None, first_argmax(penalized)
        confident = None if stop_below <= 0 else _confidence(penalized, law, drawn, sampling) >= stop_below
        token = drawn if vocab_map is None else vocab_map[drawn]
        if corrupt_alpha is not None:
            token = _corrupt(keys, token, corrupt_alpha, vocab_size)
        if counts is not None:  # counts are over the drafter's ids
            counts = counts.add(drawn)
        if constraint is not None:
            states = advance(constraint.tables, states, token)
        return token, (law if keep_laws else None), counts, states, confident

    def step(state, index):
        logits, counts, states, carry, going = state
        token, law, counts, states, confident = pick(logits, counts, states, index)
        counted = going  # bool[B]: this draft is one of the row's chain
        if stop_below > 0:  # the row's next draft only after a confident one; none at all: the pass is skipped
            going = going & confident
            logits, carry = jax.lax.cond(jnp.any(going), lambda: next_logits(carry, token, index),
                                         lambda: (jnp.zeros_like(logits), carry))
        else:
            logits, carry = next_logits(carry, token, index)
        return (logits, counts, states, carry, going), (token, law, counted)

    going = jnp.ones(first_logits.shape[:1], bool)  # bool[B]: the row's chain has not stopped
    (logits, counts, states, carry, going), (tokens, laws, counted) = jax.lax.scan(
        step, (first_logits, counts, states, carry, going), jnp.arange(gamma - 1))
    last, last_law, _, _, _ = pick(logits, counts, states, gamma - 1)
    num_draft = jnp.sum(counted, axis=0) + going  # drafts up to each row's stop (all gamma without one)
    return _proposal(tokens, last, laws if keep_laws else None, last_law, num_draft, vocab_map, vocab_size), carry


def _proposal(tokens: jax.Array, last: jax.Array, laws: jax.Array | None, last_law: jax.Array | None,
              num_draft: jax.Array, vocab_map: jax.Array | None, vocab_size: int) -> Proposal:
    """The chain's `Proposal` from the scan's drafts ``tokens`` i32[G-1,B] and laws f32[G-1,B,Vo] (None: not
    kept) and the last draft i32[B] and its law: laws over the Vo drafter ids moved to the V target ids."""
    drafts = jnp.concatenate([tokens.T, last[:, None]], axis=1)  # i32[B,G]
    probs = None
    if laws is not None:
        probs = jnp.concatenate([laws.transpose(1, 0, 2), last_law[:, None]], axis=1)  # f32[B,G,Vo]
        if vocab_map is not None:
            probs = jnp.zeros(probs.shape[:2] + (vocab_size,), probs.dtype).at[:, :, vocab_map].set(probs)
    return Proposal(drafts.astype(jnp.int32), num_draft.astype(jnp.int32), probs)


def _confidence(penalized: jax.Array, law: jax.Array | None, drawn: jax.Array, sampling: RowSampling) -> jax.Array:
    """f32[B]: each row's confidence in its draft ``drawn`` i32[B] (module docstring): its probability under the
    row's processed law f32[B,Vo], or for a greedy row the largest probability of the softmax of its penalized
    logits f32[B,Vo]."""
    greedy = jnp.max(jax.nn.softmax(penalized, axis=-1), axis=-1)
    if law is None:
        return greedy
    return jnp.where(sampling.temperature == 0, greedy, jnp.take_along_axis(law, drawn[:, None], axis=1)[:, 0])


def _draw(keys, law, sampling: RowSampling):
    """i32[B]: a draw from `law` f32[B,V] for sampled rows, the argmax (the one-hot's index) for
    greedy rows."""
    return jnp.where(sampling.temperature == 0, first_argmax(law), sample(keys, law)).astype(jnp.int32)


def _corrupt(keys, token, alpha: jax.Array, vocab: int):
    """Keep each token with probability alpha, else replace it by a uniformly wrong one."""
    keep = jax.vmap(lambda k: jax.random.bernoulli(k, alpha))(for_purpose(keys, Purpose.CORRUPT_KEEP))
    offset = jax.vmap(lambda k: jax.random.randint(k, (), 1, vocab))(for_purpose(keys, Purpose.CORRUPT_TOKEN))
    return jnp.where(keep, token, (token + offset) % vocab).astype(jnp.int32)
