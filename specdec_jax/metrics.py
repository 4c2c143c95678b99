"""Acceptance statistics, counted on device per live row and round (docs/design.md section 5)."""

from __future__ import annotations

import dataclasses

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np


@flax.struct.dataclass
class Counters:
    rounds: jax.Array  # i32[B] rounds in which the row was live
    drafted: jax.Array  # i32[B] sum of num_draft
    accepted: jax.Array  # i32[B] accepted drafts that were emitted
    emitted: jax.Array  # i32[B] tokens emitted (bonus/correction included)
    position_proposed: jax.Array  # i32[G] rounds whose proposal reached draft position (tree depth) i+1
    position_accepted: jax.Array  # i32[G] rounds whose accepted run (path) reached position (depth) i+1
    width_rounds: jax.Array  # i32[W] loop rounds whose verify pass ran at each of the engine's verify widths

    @classmethod
    def zeros(cls, batch: int, gamma: int, num_widths: int = 1) -> Counters:
        row, pos = jnp.zeros((batch,), jnp.int32), jnp.zeros((gamma,), jnp.int32)
        return cls(row, row, row, row, pos, pos, jnp.zeros((num_widths,), jnp.int32))

    def add_round(self, live, num_draft, n_accepted, n_emit, width_index=0, reach=None) -> Counters:
        """live bool[B], num_draft/n_accepted/n_emit i32[B] of one round; width_index i32[] of its verify
        pass; reach i32[B] the deepest draft position proposed (a tree's deepest verified node; default
        num_draft, a chain's)."""
        reach = num_draft if reach is None else reach
        live_i = live.astype(jnp.int32)
        used = jnp.minimum(n_accepted, n_emit) * live_i  # accepted drafts cut by EOS/budget are not counted
        positions = jnp.arange(self.position_proposed.shape[0])[None, :]
        return Counters(
            rounds=self.rounds + live_i,
            drafted=self.drafted + num_draft * live_i,
            accepted=self.accepted + used,
            emitted=self.emitted + n_emit * live_i,
            position_proposed=self.position_proposed + jnp.sum((positions < (reach * live_i)[:, None]), 0),
            position_accepted=self.position_accepted + jnp.sum((positions < used[:, None]), 0),
            width_rounds=self.width_rounds.at[width_index].add(1),
        )


@dataclasses.dataclass(frozen=True)
class Metrics:
    """Batch totals over real rows. mean_accepted_length = emitted / rounds (plain decoding: 1.0)."""

    rounds: int
    draft_tokens: int
    accepted_tokens: int
    emitted_tokens: int
    mean_accepted_length: float
    acceptance_rate: float  # accepted / drafted (nan when nothing was drafted)
    per_position_acceptance: list[float]  # accepted at draft position (tree depth) i+1 / rounds proposing it;
    # nan past the deepest position proposed
    position_proposed: list[int]  # rounds whose proposal reached position (depth) i+1
    position_accepted: list[int]  # rounds whose accepted run reached position (depth) i+1
    width_rounds: list[int]  # loop rounds run at each verify width (EngineSpec.verify_widths), whole batch

    @classmethod
    def from_totals(cls, rounds, drafted, accepted, emitted, position_proposed, position_accepted,
                    width_rounds=()) -> Metrics:
        position_proposed = [int(x) for x in position_proposed]
        position_accepted = [int(x) for x in position_accepted]
        return cls(
            rounds=int(rounds),
            draft_tokens=int(drafted),
            accepted_tokens=int(accepted),
            emitted_tokens=int(emitted),
            mean_accepted_length=emitted / rounds if rounds else float("nan"),
            acceptance_rate=accepted / drafted if drafted else float("nan"),
            per_position_acceptance=[a / p if p else float("nan") for a, p in zip(position_accepted, position_proposed)],
            position_proposed=position_proposed,
            position_accepted=position_accepted,
            width_rounds=[int(x) for x in width_rounds],
        )

    @classmethod
    def from_counters(cls, counters: Counters, num_rows: int) -> Metrics:
        c = jax.tree.map(np.asarray, counters)
        return cls.from_totals(
            c.rounds[:num_rows].sum(), c.drafted[:num_rows].sum(), c.accepted[:num_rows].sum(),
            c.emitted[:num_rows].sum(), c.position_proposed, c.position_accepted, c.width_rounds,
        )

    @classmethod
    def combine(cls, parts: list[Metrics]) -> Metrics:
        """Totals over several runs with the same gamma."""
        return cls.from_totals(
            sum(m.rounds for m in parts), sum(m.draft_tokens for m in parts), sum(m.accepted_tokens for m in parts),
            sum(m.emitted_tokens for m in parts), np.sum([m.position_proposed for m in parts], axis=0),
            np.sum([m.position_accepted for m in parts], axis=0), np.sum([m.width_rounds for m in parts], axis=0),
        )

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)
