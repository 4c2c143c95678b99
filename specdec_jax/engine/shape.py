"""Choosing the draft shape per round from the device's costs and each row's acceptance (docs/design.md section 11).

A `ShapePolicy` names the draft lengths the program is compiled for
(`gammas`, ascending, 0 = a plain decoding step) and what each costs on the
running device in units of T1, one 1-token target step: `verify_cost[i]` =
Tv(gammas[i] + 1) / T1 and `draft_cost[i]` = the drafter's proposal of
gammas[i] tokens / T1 (`specdec_jax.engine.calibration` measures both). The
loop state carries per row `acceptance f32[B,G]`: an estimate of
P(draft i accepted | drafts 1..i-1 accepted). A row's expected tokens from a
chain of g drafts are

    E(g) = 1 + a_1 + a_1 a_2 + ... + a_1 ... a_g.

Each round, on device:

0. each live row gets a weight (`row_weights`): its expected rounds left,
   (room + 1) / E, over the largest among the live rows, with
   E = 1 + f (E_row(G) - 1) and f the row's share of recent rounds whose
   drafter found drafts (a row of free text under prompt lookup finds few,
   and its estimates, seldom observed, stay near the prior). A batch runs
   until its last row ends, so tokens of a row far ahead of the others (one
   that copies, or has little budget left) shorten nothing, and that row stops
   pulling the whole batch's verify pass wider; rows alike weigh alike, and a
   row alone weighs 1;
1. before drafting (`choose_draft`): the g that maximises
   sum_live w_row E_row(min(g, room)) / (draft_cost(g) + verify_cost(g)). A drafter whose
   whole proposal is free (`free_drafts`: the n-gram lookup) always drafts G,
   so what it finds (a row without a match has no drafts) informs step 2;
2. after drafting (`choose_verify`): the verify shape g_v <= g that maximises
   sum_live w_row E_row(min(g_v, num_draft)) / (draft_cost(g) + verify_cost(g_v)); drafts
   past g_v are dropped. A row without drafts counts 1 at every shape, so rows
   whose drafts keep failing (a ~ 0) stop widening the batch's verify pass: the
   per-row opt-out falls out of the batch's choice;
3. after verification (`update`): each position a row verified moves its
   estimate toward the outcome (weight `learn`). Positions not verified drift:
   position 1 toward `prior` (weight `relax` per round), so a row that stopped
   drafting tries again later; position i > 1 toward the larger of the prior
   and the estimate of position i - 1 (weight `follow`): depths not tried lately
   are assumed as good as the depth above them, or the prior (conditional
   acceptance tends to grow with depth: a copy that started goes on), so a row
   that accepts well is soon offered a longer chain. The default prior is what
   the drafter says its drafts typically reach (`drafter_prior`; else
   `CHAIN_PRIOR`), and sits at least `PROBE_MARGIN` above the acceptance at which
   drafting breaks even (`break_even`), so that a row probes where drafting is
   dear instead of never drafting.

A token tree is just another shape (`tree=True`, docs/design.md section 10): gammas
are node counts, and a tree drafter orders its nodes so that every prefix is
itself a tree (parents come first) and the drafter's best tree of that size
(EAGLE-2's N best by score; the n-gram trie's best match first), so verifying
n < N nodes is truncating the proposal. The estimate is then per node index,
``acceptance f32[B,N]`` = P(node i lies on the accepted path), and

    E(n) = 1 + p_1 + ... + p_n,

for a chain the same sum (p_i = a_1 ... a_i). Observed nodes (the verified
prefix) move toward 0/1 (on the path or not); an unobserved node drifts toward
the node before it (weight `follow`): a conservative guess would never try a
wider tree again. The tree is grown whole or not at all (its drafting cost
hardly depends on how many of its nodes are kept), so step 1 chooses between
gamma 0 and N: N if some verify size pays for the whole tree's drafting.

The choice depends only on earlier rounds, so stochastic verification stays
exact: each round preserves the target's law whatever its shape.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from specdec_jax.theory import expected_tokens_per_round

# The shapes `gamma="auto"` compiles: verify widths 1 to 5. Every width up to 5 is a candidate because the cost of
# a width need not grow with it (XLA CPU multiplies up to 4 rows at about matrix-vector speed and 5 rows by another
# kernel; measured in docs/design.md section 8), so gamma 3 can pay where 4 loses.
AUTO_GAMMAS = (0, 1, 2, 3, 4)
AUTO_TREE_SIZES = (1, 2, 4, 8, 16)  # node counts `gamma="auto"` verifies of a tree drafter's nodes (below N)


def tree_sizes(nodes: int) -> tuple[int, ...]:
    """The node counts a shape policy chooses among for a tree of ``nodes`` nodes: 0 (plain
    decoding), the `AUTO_TREE_SIZES` below ``nodes``, and ``nodes``."""
    return tuple(sorted({0, nodes, *(n for n in AUTO_TREE_SIZES if n < nodes)}))


def chain_gammas(max_drafts: int | None) -> tuple[int, ...]:
    """The chain lengths gamma "auto" chooses among: `AUTO_GAMMAS`; for a drafter whose proposal holds at most
    ``max_drafts`` (a DFlash block: B - 1 drafts from one pass, whatever their number), those up to it, the
    powers of two below it and ``max_drafts`` itself (B = 16: 0, 1, 2, 3, 4, 8, 15)."""
    if max_drafts is None:
        return AUTO_GAMMAS
    powers = {1 << k for k in range(max_drafts.bit_length())}
    return tuple(sorted({g for g in (*AUTO_GAMMAS, *powers) if g < max_drafts} | {max_drafts}))


def auto_shapes(drafter) -> tuple[tuple[int, ...], bool]:
    """``(gammas, tree)`` that gamma "auto" chooses among for ``drafter``: `chain_gammas` of its
    ``max_drafts`` for a chain, `tree_sizes` of its node count for a tree drafter (tree True)."""
    shape = getattr(drafter, "tree", None)
    if shape is None:
        return chain_gammas(getattr(drafter, "max_drafts", None)), False
    return tree_sizes(shape.nodes), True

FREE_DRAFTS = 0.02  # a proposal of G tokens costing at most this many T1 is treated as free
# A chain's prior is low enough that a probe seldom widens a whole batch's pass and high enough that a batch of one
# still speculates at once (the entry "Which prior should the shape policy start from?" of experiments/README.md
# compares priors). A tree's nodes start at TREE_PRIOR^(i+1): from 0.5^(i+1) its deep nodes start so low that it
# never tries its widest sizes.
CHAIN_PRIOR = 0.5
TREE_PRIOR = 0.7
# Where drafting is dear, a default prior is raised to this much above the break-even acceptance (`break_even`), so
# that a row probes once at the start and again after its estimates relax, instead of never drafting.
PROBE_MARGIN = 0.05


@dataclasses.dataclass(frozen=True)
class ShapePolicy:
    """The compiled draft lengths, their measured costs (units of T1) and the estimator's constants."""

    gammas: tuple[int, ...]  # ascending, gammas[0] == 0
    verify_cost: tuple[float, ...]  # Tv(g + 1) / T1 per entry of gammas (1.0 for g = 0)
    draft_cost: tuple[float, ...]  # drafting g tokens / T1 per entry of gammas
    # acceptance assumed before a position is observed; None: ``drafter_prior`` (without one CHAIN_PRIOR, TREE_PRIOR
    # for a tree), or `break_even` + PROBE_MARGIN where that is higher
    prior: float | None = None
    drafter_prior: float | None = None  # the drafter's `acceptance_prior`: what it typically reaches, if it says
    # weight of a new observation: 0.15 rather than 0.25, so one rejection moves a row's estimate less (a draft
    # model's misses come in bursts it recovers from; docs/shape_policy.md, "How fast a row's estimates move")
    learn: float = 0.15
    relax: float = 0.2  # per-round pull of an unobserved position 1 toward the prior (docs/shape_policy.md)
    follow: float = 0.25  # per-round pull of an unobserved position i > 1 toward position i - 1
    tree: bool = False  # gammas are token-tree node counts; acceptance is per node (module docstring)
    weigh_rows: bool = True  # weigh rows by rounds left (a static batch); False: alike (rows refilled as they end)

    def __post_init__(self):
        gammas = tuple(int(g) for g in self.gammas)
        object.__setattr__(self, "gammas", gammas)
        object.__setattr__(self, "verify_cost", tuple(float(c) for c in self.verify_cost))
        object.__setattr__(self, "draft_cost", tuple(float(c) for c in self.draft_cost))
        if not gammas or gammas[0] != 0 or any(b <= a for a, b in zip(gammas, gammas[1:])):
            raise ValueError(f"gammas must ascend strictly from 0, got {gammas}")
        if not len(self.verify_cost) == len(self.draft_cost) == len(gammas):
            raise ValueError("verify_cost and draft_cost need one entry per gamma")
        if min(self.verify_cost) <= 0 or min(self.draft_cost) < 0:
            raise ValueError("verify costs must be > 0 and draft costs >= 0")
        if self.drafter_prior is not None and not 0.0 <= self.drafter_prior <= 1.0:
            raise ValueError(f"drafter_prior must be in [0, 1], got {self.drafter_prior}")
        if self.prior is None:
            default = self.drafter_prior if self.drafter_prior is not None else TREE_PRIOR if self.tree else CHAIN_PRIOR
            object.__setattr__(self, "prior", min(1.0, max(default, break_even(self) + PROBE_MARGIN)))
        for name in ("prior", "learn", "relax", "follow"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {getattr(self, name)}")

    @property
    def max_gamma(self) -> int:
        return self.gammas[-1]

    @property
    def free_drafts(self) -> bool:
        return self.draft_cost[-1] <= FREE_DRAFTS

    def initial(self, batch: int) -> jax.Array:
        """f32[B,G]: the estimates before any round: `prior` per position of a chain; a tree's node
        i gets prior^(i+1), a chain's marginal (every node prior would verify whole trees first)."""
        if not self.tree:
            return jnp.full((batch, self.max_gamma), self.prior, jnp.float32)
        marginal = self.prior ** jnp.arange(1, self.max_gamma + 1, dtype=jnp.float32)
        return jnp.broadcast_to(marginal, (batch, self.max_gamma))


def break_even(policy: ShapePolicy, tolerance: float = 1e-4) -> float:
    """The acceptance ``a`` at which the best drafting shape first pays as well as a plain round,
    when every position's estimate is the prior's shape at ``a`` (a chain: ``a`` per position; a
    tree: node i at a^(i+1)): both give E(g) = 1 + a + ... + a^g, against a shape's drafting plus
    verify cost (a tree's whole proposal is drafted whatever size is verified). 1.0 where no
    shape pays even at a = 1; 0.0 where one pays at a = 0."""
    gammas = policy.gammas[1:]
    draft = [policy.draft_cost[-1]] * len(gammas) if policy.tree else policy.draft_cost[1:]
    cost = np.asarray(draft) + np.asarray(policy.verify_cost[1:])
    plain = 1.0 / (policy.draft_cost[0] + policy.verify_cost[0])

    def pays(a: float) -> bool:
        tokens = np.asarray([expected_tokens_per_round(a, g) for g in gammas])
        return bool(np.max(tokens / cost) > plain)

    if not pays(1.0):
        return 1.0
    low, high = 0.0, 1.0  # pays(high) holds
    while high - low > tolerance:
        middle = (low + high) / 2
        low, high = (low, middle) if pays(middle) else (middle, high)
    return high


def expected_tokens(acceptance: jax.Array, limit: jax.Array, gammas: tuple[int, ...], tree: bool = False,
                    usable: jax.Array | None = None) -> jax.Array:
    """f32[B,S]: E_row(min(gammas[s], limit[b])) for acceptance f32[B,G] (a chain's conditional
    acceptances, or with ``tree`` each node's chance to be on the accepted path) and limit i32[B];
    ``usable`` bool[B,G]: the tree nodes that can be accepted (within the row's room)."""
    reach = acceptance if tree else jnp.cumprod(acceptance, axis=1)  # P(draft / node i accepted)
    if usable is not None:
        reach = jnp.where(usable, reach, 0.0)
    accepted = jnp.concatenate([jnp.zeros_like(reach[:, :1]), jnp.cumsum(reach, axis=1)], axis=1)  # [B,G+1]
    drafts = jnp.minimum(jnp.asarray(gammas, jnp.int32)[None, :], jnp.maximum(limit, 0)[:, None])
    return 1.0 + jnp.take_along_axis(accepted, drafts, axis=1)


def row_weights(policy: ShapePolicy, acceptance: jax.Array, live: jax.Array, room: jax.Array,
                found: jax.Array | None = None) -> jax.Array:
    """f32[B]: how much a row's tokens shorten the batch, 0 for finished rows (step 0 of the module
    docstring): the row's expected rounds left, (room + 1) / E, over the largest among the live
    rows, where E = 1 + found (E_row(the widest shape) - 1) and ``found`` f32[B] is the row's share
    of rounds whose drafter found drafts (`update_found`; None: every round); with
    ``policy.weigh_rows`` off, 1 for every live row."""
    if not policy.weigh_rows:
        return live.astype(jnp.float32)
    limit = jnp.where(room > 0, policy.max_gamma, 0) if policy.tree else room
    gain = expected_tokens(acceptance, limit, (policy.max_gamma,), policy.tree)[:, 0] - 1.0
    rounds = (room + 1) / (1.0 + (gain if found is None else found * gain))
    rounds = jnp.where(live, rounds, 0.0)
    return rounds / jnp.maximum(jnp.max(rounds), 1e-6)


def update_found(policy: ShapePolicy, found: jax.Array, drafting: jax.Array, num_draft: jax.Array) -> jax.Array:
    """f32[B]: each row's share of rounds whose drafter found drafts, moved (weight ``learn``) toward
    this round's outcome (num_draft i32[B] > 0) in the rows that drafted (``drafting`` bool[B]).
    A row that seldom finds any (free text under prompt lookup) expects about one token a round
    whatever its acceptance estimates say, so `row_weights` sees it as the batch's last row."""
    outcome = (num_draft > 0).astype(found.dtype)
    return jnp.where(drafting, found + policy.learn * (outcome - found), found)


def _best(policy: ShapePolicy, acceptance, weight, limit, draft_cost, allowed=None, usable=None) -> jax.Array:
    tokens = expected_tokens(acceptance, limit, policy.gammas, policy.tree, usable)
    tokens = jnp.sum(weight[:, None] * tokens, axis=0)
    rate = tokens / (draft_cost + jnp.asarray(policy.verify_cost, jnp.float32))
    if allowed is not None:
        rate = jnp.where(allowed, rate, -jnp.inf)
    return jnp.argmax(rate).astype(jnp.int32)


def choose_draft(policy: ShapePolicy, acceptance: jax.Array, weight: jax.Array, room: jax.Array) -> jax.Array:
    """i32[]: index into gammas of the proposal to draw (step 1 of the module docstring); weight
    f32[B] as `row_weights` (or the live mask, every row counting alike)."""
    if policy.free_drafts:
        return jnp.asarray(len(policy.gammas) - 1, jnp.int32)
    if policy.tree:  # grown whole (if any verify size pays for it) or not at all; room bounds depth, not nodes
        whole = jnp.where(jnp.arange(len(policy.gammas)) > 0, policy.draft_cost[-1], 0.0)
        best = _best(policy, acceptance, weight, jnp.where(room > 0, policy.max_gamma, 0), whole)
        return jnp.where(best > 0, len(policy.gammas) - 1, 0).astype(jnp.int32)
    return _best(policy, acceptance, weight, room, jnp.asarray(policy.draft_cost, jnp.float32))


def draft_options(policy: ShapePolicy) -> tuple[int, ...]:
    """The proposal sizes `choose_draft` can pick: every gamma, or a tree's 0 and N."""
    return (0, policy.max_gamma) if policy.tree else policy.gammas


def choose_verify(policy: ShapePolicy, acceptance: jax.Array, weight: jax.Array, num_draft: jax.Array,
                  draft_choice: jax.Array, usable: jax.Array | None = None) -> jax.Array:
    """i32[]: index into gammas of the verify shape, at most ``draft_choice`` (i32[], the index into
    gammas of the proposal drawn; step 2); ``usable`` bool[B,G]: a tree's nodes that lie within the
    row's room."""
    sunk = jnp.asarray(policy.draft_cost, jnp.float32)[draft_choice]
    allowed = jnp.arange(len(policy.gammas)) <= draft_choice
    return _best(policy, acceptance, weight, num_draft, sunk, allowed, usable)


def update(policy: ShapePolicy, acceptance: jax.Array, live: jax.Array, num_draft: jax.Array,
           n_accepted: jax.Array, path: jax.Array | None = None) -> jax.Array:
    """f32[B,G]: estimates after a round in which each row verified num_draft drafts and accepted
    the first n_accepted (step 3): positions 1..min(n_accepted + 1, num_draft) were observed. A
    tree (``path`` i32[B,G], the accepted nodes, -1 past them) observed every verified node."""
    position = jnp.arange(acceptance.shape[1])[None, :]
    verified = live[:, None] & (position < num_draft[:, None])
    if policy.tree:
        observed = verified
        outcome = jnp.any(path[:, :, None] == position[:, None, :], axis=1).astype(acceptance.dtype)
    else:
        observed = verified & (position <= n_accepted[:, None])
        outcome = (position < n_accepted[:, None]).astype(acceptance.dtype)
    learned = jnp.where(observed, acceptance + policy.learn * (outcome - acceptance), acceptance)
    above = jnp.concatenate([jnp.full_like(learned[:, :1], policy.prior), learned[:, :-1]], axis=1)
    if not policy.tree:
        above = jnp.maximum(above, policy.prior)
    rate = jnp.where(position == 0, policy.relax, policy.follow)
    return jnp.where(observed, learned, acceptance + rate * (above - acceptance))
