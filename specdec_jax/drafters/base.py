"""The drafter protocol (docs/design.md sections 5 and 9).

A drafter is a frozen, hashable dataclass (it is a static argument of the
jitted round) whose arrays live in `params`, a field left out of hashing and
equality. Its methods are pure functions of explicit arguments and must read
weights from the `params` argument, never from `self.params`, so weights enter
the compiled program as inputs rather than as constants:

    params                                   the drafter's weights (a pytree, or None)
    reads_hidden: tuple[int, ...]            target hidden states it reads (`specdec_jax.target`
                                             layer indices, FINAL_NORM = -1); () reads none
    tree: TreeShape | None                   a token-tree drafter's shape (`specdec_jax.token_tree`); its
                                             proposals have `parents` and G = tree.nodes; None: chains
    without_replacement: bool                sampled tree siblings were drawn without replacement
    check(target: TargetModel, mesh | None)  ValueError unless it can draft for this target
                                             (vocabulary, widths, mesh axes)
    init(params, prefill: PrefillContext) -> state
    resume(params, state, ctx: DraftContext, drafting) -> state
                                             every round, before the proposal and outside the per-size
                                             switch (drafting: bool[], whether the round has drafts; None at
                                             a fixed gamma, where every round drafts): a drafter that skips
                                             the rounds without drafts catches up here, compiled once for
                                             all sizes, and one that keeps its cache in step writes it here
    propose(params, state, ctx: DraftContext, gamma) -> (Proposal, update)
    settle(params, state, update) -> state   after the proposal, outside the per-size switch (default: the
                                             update is the new state)
    commit(params, state, outcome: RoundOutcome) -> state
    observe(outputs: list[list[int]])        after each generate call, the rows' emitted tokens (host
                                             lists): a drafter that learns from its target's outputs
                                             (the retrieval drafter's outputs datastore) updates its
                                             params for the next call, keeping their shapes

The engine keeps the target's hidden states only for the layers a drafter
declares in `reads_hidden`, and hands them over twice: those of the prompt to
`init`, and each round those of the tokens the last verify pass committed in
`DraftContext.features`. `commit` runs after every verification (the drafter
can update its own caches from what was accepted). `DrafterBase` supplies the
defaults: no hidden states, chains, no checks, `resume` and `commit` leave the state unchanged, `settle` takes
the update as the new state, `observe` does nothing.

A tree drafter's `propose` gets gamma = tree.nodes and returns that many nodes
(`Proposal.parents`); the engine verifies the tree and hands `commit` the
accepted path as if it had been a chain: `RoundOutcome.features` and the
target's cache hold [t0, path] in order.

`propose` runs inside the engine's `lax.switch` over proposal sizes (`--gamma auto`), whose outputs are
fresh buffers: a state returned through it is copied every round, and a cache written inside it is
copied on every pass. A drafter with a cache of its own therefore only reads it in `propose`, returns
what the round fed (the draft model: a `kv_cache.KVBlock`), and writes it in `settle` (docs/design.md
section 3). An update's arrays may be narrower for smaller gammas; the engine pads them with zeros to
the widest proposal's shapes. Other drafters return their new state as the update.

`propose` may be called with gamma 0 (a round in which the engine's shape
policy, `engine.shape`, does not speculate): it returns no drafts, and either
keeps its state in step with the committed tokens or lets it fall behind and
catches up in `resume` when drafting resumes (the draft model does:
`drafters.model`).

A drafter keeps no committed length of its own: `ctx.num_tokens` says what is
committed, so rejected drafts are rolled back for free (docs/design.md section 2).
"""

from __future__ import annotations

from typing import Any, NamedTuple, Protocol

import flax.struct
import jax

from specdec_jax.grammar import RowGrammar
from specdec_jax.sampling import RowSampling
from specdec_jax.target import TargetModel
from specdec_jax.token_tree import TreeShape


class Proposal(NamedTuple):
    """G drafts per row: a chain, or with ``parents`` a token tree of G nodes (`specdec_jax.token_tree`)."""

    drafts: jax.Array  # i32[B,G] proposed tokens (tree: node tokens), padded past num_draft
    num_draft: jax.Array  # i32[B] real drafts (tree: nodes) per row, 0..G
    probs: jax.Array | None  # f32[B,G,V] law each draft (node's sibling group) was drawn from; None = point mass
    parents: jax.Array | None = None  # i32[B,G] tree only: node c's parent, -1 = t0, else < c; None = a chain


@flax.struct.dataclass
class PrefillContext:
    """What a drafter's `init` may read: the prompts and the target's view of them."""

    prompts: jax.Array  # i32[B,P] prompts, left-aligned, padded past prompt_lens
    prompt_lens: jax.Array  # i32[B]
    features: jax.Array | None  # f32[B,P,k,H] target hidden states of reads_hidden at each prompt token; None if ()
    target_params: Any  # the target's weights (e.g. its embedding, for heads that share it)
    capacity: int = flax.struct.field(pytree_node=False)  # T, KV slots per row
    target: TargetModel = flax.struct.field(pytree_node=False)


@flax.struct.dataclass
class DraftContext:
    """What a drafter may read in a round, before the verify pass.

    Row b has `num_tokens[b]` committed tokens; the newest, t0 =
    `tokens[b, num_tokens[b] - 1]`, is not yet in the target's cache. Draft i+1
    would sit at absolute position `num_tokens[b] + i`, whose key is `keys[b, i]`.
    """

    tokens: jax.Array  # i32[B,Tbuf] committed tokens (prompt, then generated), junk past num_tokens
    num_tokens: jax.Array  # i32[B] committed count; tokens[b, num_tokens[b]-1] is t0
    prompt_lens: jax.Array  # i32[B] tokens[b, :prompt_lens[b]] is the prompt
    room: jax.Array  # i32[B] most drafts the engine keeps (budget and capacity; 0 for finished rows)
    last_emit: jax.Array  # i32[B] tokens the last round emitted (0 before the first round)
    last_accepted: jax.Array  # i32[B] drafts the last round accepted
    # f32[B,G+1,k,H] or None: the target hidden states (reads_hidden) of the last verify pass's
    # inputs [t0, d1, ...] (a tree's: [t0, accepted path]); entry j < last_emit[b] is the committed token at index
    # num_tokens[b] - 1 - last_emit[b] + j (every committed token but t0 has its features then)
    features: jax.Array | None
    keys: jax.Array  # key[B,G] keys[b, i]: the key of position num_tokens[b] + i (fold in a rng.Purpose)
    sampling: RowSampling  # per-row sampling settings (the drafter's q uses the same transforms)
    target_params: Any  # the target's weights
    target: TargetModel = flax.struct.field(pytree_node=False)
    # the rows' grammar (docs/constraints.md): a drafter that draws from its own law masks it with
    # `grammar.constrain` along each draft's path (`chain.draw_chain` does); None: no row has a constraint
    grammar: RowGrammar | None = None


@flax.struct.dataclass
class RoundOutcome:
    """What verification decided this round, handed to `Drafter.commit`."""

    n_emit: jax.Array  # i32[B] tokens emitted (0 for finished rows)
    n_accepted: jax.Array  # i32[B] drafts accepted (before stop-token / budget truncation)
    num_tokens: jax.Array  # i32[B] committed count after the round
    features: jax.Array | None  # f32[B,G+1,k,H] hidden states of this round's inputs (as DraftContext.features)


class Drafter(Protocol):
    name: str
    params: Any
    reads_hidden: tuple[int, ...]
    tree: TreeShape | None
    without_replacement: bool

    def check(self, target: TargetModel, mesh) -> None: ...

    def init(self, params, prefill: PrefillContext) -> Any: ...

    def resume(self, params, state, ctx: DraftContext, drafting: jax.Array | None) -> Any: ...

    def propose(self, params, state, ctx: DraftContext, gamma: int) -> tuple[Proposal, Any]: ...

    def settle(self, params, state, update) -> Any: ...

    def commit(self, params, state, outcome: RoundOutcome) -> Any: ...

    def observe(self, outputs: list[list[int]]) -> None: ...


class DrafterBase:
    """Defaults of the optional parts of the protocol (mix into a frozen dataclass)."""

    reads_hidden: tuple[int, ...] = ()
    tree: TreeShape | None = None
    max_drafts: int | None = None  # the most drafts one proposal holds (a DFlash block's B - 1); None: no bound
    # the acceptance a shape policy assumes of a row before it has seen any (`engine.shape.ShapePolicy.drafter_prior`);
    # None: the policy's own default
    acceptance_prior: float | None = None
    without_replacement: bool = False

    def check(self, target: TargetModel, mesh) -> None:
        """Nothing to check."""

    def resume(self, params, state, ctx: DraftContext, drafting: jax.Array | None):
        """The state is unchanged (it never falls behind)."""
        return state

    def settle(self, params, state, update):
        """The proposal's update is the new state."""
        return update

    def commit(self, params, state, outcome: RoundOutcome):
        """The state is unchanged."""
        return state

    def observe(self, outputs: list[list[int]]) -> None:
        """Nothing is learnt from the outputs."""


def check_tree_topk(tree: TreeShape | None, output_ids: int, what: str) -> None:
    """ValueError naming the flag when a tree asks for more children per node than ``what`` has output ids."""
    if tree is not None and tree.topk > output_ids:
        raise ValueError(f"--tree-topk {tree.topk} exceeds the {output_ids} output ids of {what}: use at most {output_ids}")


def check_head(tree: TreeShape | None, config, target: TargetModel, what: str) -> None:
    """Checks of a head on the target's features (``config`` with ``hidden_size``, ``vocab_size`` and
    ``output_vocab_size``): `check_tree_topk`, and a ValueError when ``what`` (e.g. "the EAGLE head") was
    built for another hidden size or vocabulary than the target's."""
    check_tree_topk(tree, config.output_vocab_size or config.vocab_size, what)
    if (config.hidden_size, config.vocab_size) != (target.hidden_size, target.vocab_size):
        raise ValueError(f"{what}: built for hidden size {config.hidden_size} and vocabulary {config.vocab_size}; "
                         f"the target has {target.hidden_size} and {target.vocab_size}")
