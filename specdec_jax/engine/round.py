"""One round of speculative decoding as two pure, jitted functions (docs/design.md sections 2 and 4).

    draft_step(spec, params, state) -> state    # the drafter proposes
    verify_step(spec, params, state) -> state   # target pass, acceptance, commit, stop reasons

`verify_step` is the composition of its named parts, each a pure function:

    target_pass   the target over [t0, d1..dG] at slots lengths + s, positions lengths + s (a chain)
                  or lengths + depth under the ancestor mask (a token tree, `specdec_jax.token_tree`);
                  a `TargetPass`: its logits, or, when nothing past the pass reads them, only
                  the greedy tokens, reduced inside each width's branch; under a grammar
                  constraint the logits of tokens the grammar refuses after each input's own
                  path are -inf (`verify_masks`, docs/constraints.md)
    target_law    the processed law p at each verified position (penalties, temperature, filters);
                  target_argmax its greedy token, when no row samples (no law is built then)
    accept        the verification rule on the pass's scores: accepted drafts, correction or
                  bonus, stop/budget cut (`verify` for chains, `verify_tree` for trees)
    commit        the pass's keys/values (a tree's accepted path moved to the front, so the cache
                  holds a chain again), tokens, cache lengths (the rollback), the recorded log-probs
                  (`record`), the drafter's hook, metrics
    stop_reasons  which live rows just ended, and why (a grammar's: a whole match nothing may follow)

With `EngineSpec.policy` set (`--gamma auto`), `draft_step` chooses the
round's draft length and verify width on device from measured costs and each
row's acceptance (`engine.shape`), and `commit` updates those estimates.

`run_loop` is `jax.jit` around `lax.while_loop(cond, draft_step then
verify_step)` with the state donated, so caches update in place and nothing
crosses to the host until every row is done (or a chunk of rounds has run:
`engine.generate` returns to the host about once a second to see a stop). gamma = 0 is plain
autoregressive decoding through the same code.

The engine knows the target only as a `specdec_jax.target.TargetModel` and the
drafter only through `specdec_jax.drafters.base`'s protocol.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from specdec_jax import grammar, rng, token_tree
from specdec_jax.drafters.base import DraftContext, Proposal, RoundOutcome
from specdec_jax.engine import shape
from specdec_jax.engine.state import CAPACITY, EOS, GRAMMAR, LENGTH, DecodeState, EngineParams, EngineSpec
from specdec_jax.kv_cache import KVBlock, ordered_read
from specdec_jax.sampling import PenaltyCounts, first_argmax, penalize, process_logits
from specdec_jax.target import chain_positions
from specdec_jax.verify import VerifyResult, verify_greedy, verify_stochastic
from specdec_jax.verify_tree import verify_tree_greedy, verify_tree_stochastic


def position_keys(state: DecodeState, width: int) -> jax.Array:
    """key[B,width]: row keys of the absolute positions num_tokens + 0..width-1 (`specdec_jax.rng`)."""
    return rng.position_keys(state.key, state.row_ids, chain_positions(state.num_tokens, width))


def draft_room(spec: EngineSpec, state: DecodeState) -> jax.Array:
    """i32[B]: drafts a row can use: past the budget they are never emitted, past slot T-1 they
    could not be verified; 0 for finished rows."""
    generated = state.num_tokens - state.prompt_lens
    room = jnp.minimum(state.max_new - generated - 1, spec.capacity - state.num_tokens)
    return jnp.where(state.done, 0, jnp.maximum(room, 0)).astype(jnp.int32)


def row_grammar(params: EngineParams, state: DecodeState) -> grammar.RowGrammar | None:
    """The batch's grammar as a round reads it (None: no row has a constraint)."""
    if params.grammar is None:
        return None
    return grammar.RowGrammar(params.grammar, state.grammar_state, state.max_new - (state.num_tokens - state.prompt_lens))


def verify_masks(state: DecodeState, constraint: grammar.RowGrammar | None) -> jax.Array | None:
    """bool[B,G+1,V]: the tokens the grammar allows after each verify input [t0, drafts], each along
    its own path (a tree's: its ancestors) and within the row's budget at its depth; None without one."""
    if constraint is None:
        return None
    drafts, parents = state.proposal.drafts, state.proposal.parents
    states = grammar.path_states(constraint.tables, constraint.states, drafts, parents)  # i32[B,G+1]
    depth = jnp.arange(drafts.shape[1] + 1)[None, :] if parents is None else token_tree.structure(parents)[0]
    return constraint.mask(states, depth)


def allowed_prefix(constraint: grammar.RowGrammar, drafts: jax.Array) -> jax.Array:
    """i32[B]: how many leading drafts of a chain (i32[B,G]) the grammar allows along it: the drafts after
    them would be rejected (the target's law gives them 0), so they are not verified."""
    states = grammar.path_states(constraint.tables, constraint.states, drafts)[:, 1:]
    return jnp.sum(jnp.cumprod(states != grammar.DEAD, axis=1), axis=1).astype(jnp.int32)


@functools.partial(jax.jit, static_argnums=0)
def draft_step(spec: EngineSpec, params: EngineParams, state: DecodeState) -> DecodeState:
    """The drafter proposes up to gamma tokens per live row, capped by `draft_room` (a tree's
    nodes are capped by depth, in `accept`); with a shape policy, as many as the round's chosen
    shapes allow (`engine.shape`), or with ``state.forced_shape`` the forced ones."""
    if spec.gamma == 0:
        return state
    room = draft_room(spec, state)
    ctx = DraftContext(
        tokens=state.tokens, num_tokens=state.num_tokens, prompt_lens=state.prompt_lens, room=room,
        last_emit=state.last_emit, last_accepted=state.last_accepted, features=state.features,
        keys=position_keys(state, spec.gamma), sampling=state.sampling, target_params=params.target,
        target=spec.target, grammar=row_grammar(params, state),
    )
    policy, live, forced, found = spec.policy, ~state.done, state.forced_shape, state.draft_found
    # draft_choice: i32[], the index into policy.gammas of the proposal's size (gammas[0] = 0: no drafts)
    if policy is None or forced is not None:
        draft_choice = None if policy is None else forced[0]
    else:
        weight = shape.row_weights(policy, state.acceptance, live, room, found)
        draft_choice = shape.choose_draft(policy, state.acceptance, weight, room)
    fixed = policy is None or policy.free_drafts  # a fixed gamma, or a free drafter: always G drafts
    drafting = None if fixed else draft_choice > 0  # None: every round drafts, nothing falls behind
    drafter_state = spec.drafter.resume(params.drafter, state.drafter_state, ctx, drafting)
    if fixed:
        proposal, update = spec.drafter.propose(params.drafter, drafter_state, ctx, spec.gamma)
    else:
        proposal, update = _propose_chosen(spec, params, drafter_state, ctx, draft_choice)
    drafter_state = spec.drafter.settle(params.drafter, drafter_state, update)
    cap = room if proposal.parents is None else jnp.where(room > 0, spec.gamma, 0)
    if ctx.grammar is not None and proposal.parents is None:
        cap = jnp.minimum(cap, allowed_prefix(ctx.grammar, proposal.drafts))
    num_draft = jnp.clip(proposal.num_draft, 0, cap).astype(jnp.int32)
    if policy is not None:
        usable = None if proposal.parents is None else token_tree.structure(proposal.parents)[0][:, 1:] <= room[:, None]
        found = shape.update_found(policy, found, (room > 0) & (draft_choice > 0), num_draft)
        if forced is None:
            verify_choice = shape.choose_verify(policy, state.acceptance, weight, num_draft, draft_choice, usable)
            num_draft = jnp.minimum(num_draft, jnp.asarray(policy.gammas, jnp.int32)[verify_choice])
        else:  # every live row verifies the forced count; drafts the drafter did not find are padding
            num_draft = jnp.minimum(cap, jnp.asarray(policy.gammas, jnp.int32)[forced[1]])
    return state.replace(proposal=proposal._replace(num_draft=num_draft), drafter_state=drafter_state,
                         draft_found=found)


def _propose_chosen(spec: EngineSpec, params: EngineParams, drafter_state, ctx: DraftContext, index: jax.Array):
    """The drafter's ``(proposal, update)`` at policy.gammas[index] (a `lax.switch` over
    `shape.draft_options`), the proposal padded to G drafts and to the structure of a G-draft proposal, the
    update's arrays with zeros to a G-draft update's shapes. The state is an operand of the switch, not
    one of its outputs: a drafter that returns only what it changed (`Drafter.settle`) keeps its cache
    out of the switch, which would copy it every round."""
    def at(gamma: int):
        def run(drafter_state):
            proposal, update = spec.drafter.propose(params.drafter, drafter_state, ctx, gamma)
            return _pad_proposal(proposal, full), _pad_update(update, full_update)
        return run

    full, full_update = jax.eval_shape(lambda s: spec.drafter.propose(params.drafter, s, ctx, spec.gamma),
                                       drafter_state)
    options = shape.draft_options(spec.policy)
    branch = jnp.searchsorted(jnp.asarray(options), jnp.asarray(spec.policy.gammas)[index])
    return jax.lax.switch(branch, [at(g) for g in options], drafter_state)


def _pad_update(update, like):
    """``update`` (a drafter's pytree) with each array padded at the end of every axis with zeros to the
    shape of ``like``'s (the same pytree at the widest proposal)."""
    def pad(x, like):
        return x if x.shape == like.shape else jnp.pad(x, [(0, b - a) for a, b in zip(x.shape, like.shape)])

    return jax.tree.map(pad, update, like)


def _pad_proposal(proposal: Proposal, like: Proposal) -> Proposal:
    """`proposal` with drafts (and laws, zeros where none were drawn; tree parents, the root where
    there are no nodes) widened to like's G columns."""
    pad = like.drafts.shape[1] - proposal.drafts.shape[1]
    drafts = jnp.pad(proposal.drafts, ((0, 0), (0, pad)))
    probs = parents = None
    if like.probs is not None:
        probs = (jnp.zeros(like.probs.shape, like.probs.dtype) if proposal.probs is None
                 else jnp.pad(proposal.probs, ((0, 0), (0, pad), (0, 0))))
    if like.parents is not None:
        parents = (jnp.full(like.parents.shape, token_tree.ROOT, jnp.int32) if proposal.parents is None
                   else jnp.pad(proposal.parents, ((0, 0), (0, pad)), constant_values=token_tree.ROOT))
    return Proposal(drafts.astype(like.drafts.dtype), proposal.num_draft.astype(jnp.int32), probs, parents)


class TargetPass(NamedTuple):
    """What `target_pass` returns, padded to G+1 verified positions (columns past the pass's width
    are zeros and are never read)."""

    logits: jax.Array | None  # f32[B,G+1,V]; None when the round needs only greedy tokens (`keeps_logits`)
    greedy: jax.Array | None  # i32[B,G+1]: the penalized logits' first argmax; None when a row samples
    hidden: jax.Array | None  # f32[B,G+1,k,H]: the hidden states the drafter reads, or None
    block: KVBlock  # the pass's keys/values, G+1 tokens, written by `commit`
    width_index: jax.Array  # i32[]: the index in ``spec.verify_widths`` the pass ran at
    raw: jax.Array | None = None  # f32[B,G+1,V]: the logits before a grammar's mask, kept for raw log-probs only


def keeps_logits(spec: EngineSpec, state: DecodeState) -> bool:
    """Whether the round reads the target's logits past its pass: a row samples (its law is built
    from them) or the target's top-k is recorded. Otherwise each width's branch reduces its logits
    to the greedy tokens, and no f32[B,G+1,V] array leaves the ``lax.switch``: padding it to G+1
    columns and then reducing it makes a narrow round pay for the widest (docs/design.md section 4,
    "Verify widths")."""
    return state.sampling.any_sampled or bool(spec.record_top_k) or spec.record_mode is not None


def target_pass(spec: EngineSpec, target_params, state: DecodeState, masks: jax.Array | None = None) -> TargetPass:
    """The target over the inputs ``[t0, drafts]`` at slots ``lengths + s`` and positions
    ``lengths + s`` (a chain) or ``lengths + depth`` under the ancestor mask (a tree); with ``masks``
    (bool[B,G+1,V], `verify_masks`), its logits are -inf where they are False.

    It runs at the narrowest of ``spec.verify_widths`` that holds every row's drafts. The pass
    only reads the cache; its keys/values come back as a `KVBlock` that `commit` writes after the
    ``lax.switch`` (a write inside a branch would copy the cache every round, and a tree's block
    is reordered first).
    """
    drafts, parents = state.proposal.drafts, state.proposal.parents
    t0 = jnp.take_along_axis(state.tokens, state.num_tokens[:, None] - 1, axis=1)
    inputs = jnp.concatenate([t0, drafts], axis=1)  # i32[B,G+1]
    if parents is None:
        positions, mask = chain_positions(state.cache.lengths, inputs.shape[1]), None
    else:
        depth, mask = token_tree.structure(parents)
        positions = state.cache.lengths[:, None] + depth
    keep, greedy = keeps_logits(spec, state), not state.sampling.any_sampled
    counts = _penalty_counts(spec, state) if greedy else None
    unmasked = masks is not None and spec.record_mode == "raw"  # raw log-probs read the logits before the mask

    def at_width(width: int):
        def run(cache):
            logits, hidden, block = spec.target.apply(
                target_params, inputs[:, :width], cache, positions[:, :width],
                None if mask is None else mask[:, :width, :width], spec.hidden_layers, defer_writes=True)
            masked = logits if masks is None else jnp.where(masks[:, :width], logits, -jnp.inf)
            pad = inputs.shape[1] - width
            tokens = None
            if greedy:
                narrow = None if counts is None else jax.tree.map(lambda c: c[:, :width], counts)
                tokens = jnp.pad(target_argmax(state, masked, narrow), ((0, 0), (0, pad)))
            logits = jnp.pad(logits if unmasked else masked, ((0, 0), (0, pad), (0, 0))) if keep else None
            if hidden is not None:  # [k,B,S,H] -> [B,S,k,H]
                hidden = jnp.pad(hidden.transpose(1, 2, 0, 3), ((0, 0), (0, pad), (0, 0), (0, 0)))
            return logits, tokens, hidden, block.padded(inputs.shape[1])
        return run

    widths = spec.verify_widths
    if len(widths) == 1:  # in a conditional too, or XLA copies the cache each round (`kv_cache.ordered_read`)
        branch = jnp.zeros((), jnp.int32)
        logits, tokens, hidden, block = ordered_read(at_width(widths[0]), state.cache)
    else:
        branch = jnp.searchsorted(jnp.asarray(widths), jnp.max(state.proposal.num_draft) + 1).astype(jnp.int32)
        logits, tokens, hidden, block = jax.lax.switch(branch, [at_width(w) for w in widths], state.cache)
    if unmasked:
        return TargetPass(jnp.where(masks, logits, -jnp.inf), tokens, hidden, block, branch, raw=logits)
    return TargetPass(logits, tokens, hidden, block, branch)


def target_law(spec: EngineSpec, state: DecodeState, logits: jax.Array) -> jax.Array:
    """f32[B,G+1,V]: the processed target law at each verified position (docs/design.md section 6)."""
    return process_logits(logits, state.sampling, _penalty_counts(spec, state))


def target_argmax(state: DecodeState, logits: jax.Array, counts: PenaltyCounts | None) -> jax.Array:
    """i32[B,S]: the greedy target token at each of S verified positions (the law's one-hot when
    no row samples), without building the law; ``counts`` those positions' `_penalty_counts`."""
    return first_argmax(penalize(logits, state.sampling, counts))


def _penalty_counts(spec: EngineSpec, state: DecodeState) -> PenaltyCounts | None:
    """Penalties count the committed tokens plus the drafts before each verified position."""
    if not state.sampling.use_penalties:
        return None
    history = PenaltyCounts.of_history(state.tokens, state.num_tokens, state.prompt_lens, spec.target.vocab_size)
    parents = state.proposal.parents
    return history.at_positions(state.proposal.drafts, None if parents is None else token_tree.structure(parents)[1])


def accept(spec: EngineSpec, state: DecodeState, scored: TargetPass,
           verified: tuple[jax.Array, jax.Array] | None) -> VerifyResult:
    """The verification rule over the target's pass: greedy (on its greedy tokens) when no row
    samples, else speculative sampling on `target_law` of its logits (greedy rows of a mixed batch
    have one-hot laws, for which it reduces to the greedy rule); `accept_tree` for a tree, whose
    `verified_nodes` are ``verified`` (None for a chain)."""
    drafts, num_draft, draft_probs, parents = state.proposal
    budget = state.max_new - (state.num_tokens - state.prompt_lens)
    if parents is not None:
        return accept_tree(spec, state, scored, budget, verified[1])
    if state.sampling.any_sampled:
        return verify_stochastic(position_keys(state, spec.gamma + 1), drafts, draft_probs,
                                 target_law(spec, state, scored.logits), num_draft, stop_ids=spec.stop_ids,
                                 budget=budget)
    return verify_greedy(drafts, scored.greedy, num_draft, stop_ids=spec.stop_ids, budget=budget)


def accept_tree(spec: EngineSpec, state: DecodeState, scored: TargetPass, budget: jax.Array,
                valid: jax.Array) -> VerifyResult:
    """The tree rules (`verify_tree`) over the ``valid`` nodes, bool[B,G] (`verified_nodes`)."""
    drafts, _, draft_probs, parents = state.proposal
    if state.sampling.any_sampled:
        return verify_tree_stochastic(position_keys(state, spec.gamma + 1), drafts, parents, valid, draft_probs,
                                      target_law(spec, state, scored.logits),
                                      without_replacement=spec.drafter.without_replacement,
                                      stop_ids=spec.stop_ids, budget=budget)
    return verify_tree_greedy(drafts, parents, valid, scored.greedy, stop_ids=spec.stop_ids, budget=budget)


def verified_nodes(spec: EngineSpec, state: DecodeState) -> tuple[jax.Array, jax.Array]:
    """A tree proposal's node depths i32[B,G] (1 = a child of t0) and which nodes are verified,
    bool[B,G]: the first num_draft, within the row's room."""
    depth = token_tree.structure(state.proposal.parents)[0][:, 1:]
    valid = (jnp.arange(spec.gamma)[None, :] < state.proposal.num_draft[:, None]) & (
        depth <= draft_room(spec, state)[:, None])
    return depth, valid


def proposed_depth(state: DecodeState, verified: tuple[jax.Array, jax.Array] | None) -> jax.Array:
    """i32[B]: how deep the verified proposal reaches: a chain's draft count, a tree's deepest
    verified node (``verified``: its `verified_nodes`); the denominators of acceptance by draft
    position, or by depth."""
    if verified is None:
        return state.proposal.num_draft
    depth, valid = verified
    return jnp.max(jnp.where(valid, depth, 0), axis=1)


def commit(spec: EngineSpec, params: EngineParams, state: DecodeState, result: VerifyResult,
           scored: TargetPass, reach: jax.Array) -> DecodeState:
    """Writes the pass's keys/values (a tree's accepted path first, so that slots lengths + j hold
    [t0, path] as a chain's would), appends each live row's emitted run and moves the committed
    lengths (the rollback of rejected drafts: their slots lie past the new lengths); then the
    drafter's commit hook and the round's metrics (``reach``: `proposed_depth`)."""
    hidden, block = scored.hidden, scored.block
    scores = recorded_scores(spec, state, scored)
    if result.path is not None:  # verify input of the run's j-th token: t0, then the path's nodes
        order = jnp.pad(jnp.where(result.path >= 0, result.path + 1, 0), ((0, 0), (1, 0)))  # i32[B,G+1]
        block = block.take(order)
        if scores is not None:
            scores = jnp.take_along_axis(scores, order[:, :, None], axis=1)
        if hidden is not None:
            hidden = jnp.take_along_axis(hidden, order[:, :, None, None], axis=1)
    cache = state.cache.write_block(block)
    live = ~state.done
    n_emit = jnp.where(live, result.n_emit, 0)
    grammar_state = state.grammar_state
    if grammar_state is not None:  # the run ends where the grammar finishes the row, as plain decoding's would
        grammar_state, n_emit = grammar.advance_run(row_grammar(params, state), result.tokens, n_emit)
    n_accepted = jnp.where(live, result.n_accepted, 0)
    column = jnp.arange(spec.gamma + 1)[None, :]
    index = jnp.where(column < n_emit[:, None], state.num_tokens[:, None] + column, spec.buffer_len)
    batch_index = jnp.arange(index.shape[0])[:, None]
    num_tokens = state.num_tokens + n_emit
    target_top, target_chosen = record(spec, state, scores, result.tokens, index)
    drafter_state, acceptance = state.drafter_state, state.acceptance
    if spec.gamma > 0:
        outcome = RoundOutcome(n_emit=n_emit, n_accepted=n_accepted, num_tokens=num_tokens, features=hidden)
        drafter_state = spec.drafter.commit(params.drafter, drafter_state, outcome)
    if spec.policy is not None:
        acceptance = shape.update(spec.policy, acceptance, live, state.proposal.num_draft, result.n_accepted,
                                  result.path)
    return state.replace(
        tokens=state.tokens.at[batch_index, index].set(result.tokens, mode="drop"),
        num_tokens=num_tokens,
        cache=cache.with_lengths(num_tokens - 1),
        drafter_state=drafter_state,
        last_emit=n_emit,
        last_accepted=n_accepted,
        features=hidden,
        counters=state.counters.add_round(live, state.proposal.num_draft, result.n_accepted, n_emit,
                                          scored.width_index, reach=reach),
        step=state.step + 1,
        target_top=target_top,
        target_chosen=target_chosen,
        acceptance=acceptance,
        grammar_state=grammar_state,
    )


def recorded_scores(spec: EngineSpec, state: DecodeState, scored: TargetPass) -> jax.Array | None:
    """f32[B,G+1,V]: the log-probs a round records at each verified position, the target's raw law
    (log_softmax of its logits; with ``spec.record_mode`` "raw", before a grammar's mask), or with
    "processed" the log of `target_law` (the row's bias, penalties, temperature, filters, grammar
    mask); None when nothing is recorded."""
    if not spec.record_top_k and spec.record_mode is None:
        return None
    if spec.record_mode == "processed":
        return jnp.log(target_law(spec, state, scored.logits))
    return jax.nn.log_softmax(scored.logits if scored.raw is None else scored.raw, axis=-1)


def record(spec: EngineSpec, state: DecodeState, scores: jax.Array | None, tokens: jax.Array, index: jax.Array):
    """``(target_top, target_chosen)`` with this round's run written at buffer slots ``index`` i32[B,G+1]
    (past the buffer: dropped): the top ``spec.record_top_k`` of ``scores`` (`recorded_scores`, in run
    order) and, with ``spec.record_mode``, the emitted ``tokens``' own log-probs; the state's unchanged
    where nothing is recorded."""
    target_top, target_chosen = state.target_top, state.target_chosen
    batch_index = jnp.arange(index.shape[0])[:, None]
    if spec.record_top_k:
        logp, ids = jax.lax.top_k(scores, spec.record_top_k)  # [B,G+1,k]
        target_top = (target_top[0].at[batch_index, index].set(ids, mode="drop"),
                      target_top[1].at[batch_index, index].set(logp, mode="drop"))
    if spec.record_mode is not None:
        chosen = jnp.take_along_axis(scores, tokens[:, :, None], axis=2)[:, :, 0]  # f32[B,G+1]
        target_chosen = target_chosen.at[batch_index, index].set(chosen, mode="drop")
    return target_top, target_chosen


def stop_reasons(spec: EngineSpec, was_done: jax.Array, state: DecodeState,
                 tables: grammar.DeviceGrammar | None = None) -> DecodeState:
    """Rows live before this round (``~was_done``) that now end: a stop token as the newest token, a
    whole match of the row's grammar (``tables``) that no text token can extend within the budget
    (`grammar.finished`), the budget spent, or no cache slot left for the next t0."""
    live = ~was_done
    last = jnp.take_along_axis(state.tokens, state.num_tokens[:, None] - 1, axis=1)[:, 0]
    hit_stop = live & jnp.isin(last, jnp.asarray(spec.stop_ids, jnp.int32)) if spec.stop_ids else jnp.zeros_like(live)
    remaining = state.max_new - (state.num_tokens - state.prompt_lens)
    hit_grammar = (jnp.zeros_like(live) if tables is None
                   else live & grammar.finished(tables, state.grammar_state, remaining))
    hit_length = live & (remaining <= 0)
    hit_capacity = live & (state.num_tokens - 1 >= spec.capacity)
    reason = jnp.select([hit_stop, hit_grammar, hit_length, hit_capacity], [EOS, GRAMMAR, LENGTH, CAPACITY],
                        state.stop_reason)
    done = was_done | hit_stop | hit_grammar | hit_length | hit_capacity
    return state.replace(done=done, stop_reason=reason.astype(jnp.int32))


@functools.partial(jax.jit, static_argnums=0)
def verify_step(spec: EngineSpec, params: EngineParams, state: DecodeState) -> DecodeState:
    """One target pass over [t0, drafts], verification, commit, stop reasons and metrics."""
    scored = target_pass(spec, params.target, state, verify_masks(state, row_grammar(params, state)))
    verified = None if state.proposal.parents is None else verified_nodes(spec, state)  # once a round: a loop
    result = accept(spec, state, scored, verified)
    return stop_reasons(spec, state.done, commit(spec, params, state, result, scored, proposed_depth(state, verified)),
                        params.grammar)


def decode_round(spec: EngineSpec, params: EngineParams, state: DecodeState) -> DecodeState:
    """One round: the loop body, also driven step by step by the Python debug path."""
    return verify_step(spec, params, draft_step(spec, params, state))


@functools.partial(jax.jit, static_argnums=0, donate_argnums=2)
def run_loop(spec: EngineSpec, params: EngineParams, state: DecodeState, rounds: jax.Array | None = None) -> DecodeState:
    """Rounds until every row is done (each live row emits >= 1 token a round, so at most
    max(max_new)), or until ``rounds`` (i32[], traced: every value runs one program) more have run:
    `engine.generate` runs the loop in chunks so that the host sees a stop (Ctrl-C) between them."""
    limit = jnp.max(state.max_new)
    if rounds is not None:
        limit = jnp.minimum(limit, state.step + rounds)

    def cond(s: DecodeState):
        # Some row is still running, and the round limit (a safety net, or the chunk's end) is not reached.
        return jnp.any(~s.done) & (s.step < limit)

    return jax.lax.while_loop(cond, lambda s: decode_round(spec, params, s), state)
