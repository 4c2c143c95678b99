"""Medusa heads: K heads on the target's last final-norm feature, all drafts in one step.

With `n` committed tokens, the newest feature the target has computed is the one
of token n - 2 (the verify pass that emitted t0 = token n - 1 produced it; the
target's own LM head already turned it into t0). Head k (1-based) reads that
feature f and proposes token n - 2 + k + 1, the one k + 1 ahead of f's token:

    h_k = f + silu(f @ w[k] + b[k])        logits_k = lm_head_k(h_k)

lm_head_k is the head's own `lm_head[k] [H,Vo]` over a reduced vocabulary
(`vocab_map i32[Vo]`; q is zero outside it), or the target's LM head when there
is no reduced vocabulary. Draft k is drawn from head k's processed law, which
conditions only on f: a valid proposal law, so verification stays exact. No
serial draft pass runs; gamma must not exceed K.

With a `TreeShape` the heads propose Medusa's static tree: a node's choice
(r_1, .., r_d) is the path of top-k ranks to it, and its token is head d's
r_d-th most likely token (`--tree-choices FILE` in Medusa's format, or the
`token_tree.default_choices` of `--tree-nodes/--tree-depth/--tree-topk`). The tokens
are fixed by the feature, so they are verified as point masses.

Weights: w [K,H,H], b [K,H], lm_head [K,H,Vo] + vocab_map [Vo] (reduced only).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from specdec_jax import token_tree
from specdec_jax.drafters.base import DraftContext, DrafterBase, PrefillContext, Proposal, check_head
from specdec_jax.drafters.chain import draw_chain, empty_proposal
from specdec_jax.target import FINAL_NORM, TargetModel
from specdec_jax.token_tree import TreeShape


@dataclasses.dataclass(frozen=True)
class MedusaConfig:
    hidden_size: int  # H, the target's
    vocab_size: int  # V, the target's
    num_heads: int  # K
    output_vocab_size: int | None = None  # None: the target's LM head for every head

    def __post_init__(self):
        if self.num_heads < 1:
            raise ValueError(f"num_heads must be >= 1, got {self.num_heads}")
        if self.output_vocab_size is not None and not 0 < self.output_vocab_size <= self.vocab_size:
            raise ValueError(f"output_vocab_size must be in [1, {self.vocab_size}], got {self.output_vocab_size}")


def medusa_shapes(cfg: MedusaConfig) -> dict[str, tuple[int, ...]]:
    k, h = cfg.num_heads, cfg.hidden_size
    shapes = {"w": (k, h, h), "b": (k, h)}
    if cfg.output_vocab_size is not None:
        shapes.update(lm_head=(k, h, cfg.output_vocab_size), vocab_map=(cfg.output_vocab_size,))
    return shapes


def init_medusa(cfg: MedusaConfig, head_rows: np.ndarray | None = None,
                vocab_map: np.ndarray | None = None) -> dict[str, np.ndarray]:
    """Medusa's initialisation: residual blocks at zero (every head starts as the base LM head) and
    each head's output copied from the target's LM head `head_rows [H,V]` at `vocab_map`."""
    k, h = cfg.num_heads, cfg.hidden_size
    arrays = {"w": np.zeros((k, h, h), np.float32), "b": np.zeros((k, h), np.float32)}
    if cfg.output_vocab_size is not None:
        if head_rows is None or vocab_map is None:
            raise ValueError("a reduced output vocabulary needs the target's head rows and the vocab_map")
        arrays["vocab_map"] = np.asarray(vocab_map, np.int32)
        rows = np.asarray(head_rows, np.float32)[:, arrays["vocab_map"]]
        arrays["lm_head"] = np.ascontiguousarray(np.broadcast_to(rows, (k, *rows.shape)))
    return arrays


def medusa_logits(cfg: MedusaConfig, params, target: TargetModel, target_params, feature: jax.Array) -> jax.Array:
    """f32[K,...,Vo]: every head's logits from final-norm features ``f32[..., H]``."""
    h = feature[None] + jax.nn.silu(jnp.einsum("...h,kho->k...o", feature, params["w"])
                                    + params["b"].reshape((params["b"].shape[0],) + (1,) * (feature.ndim - 1)
                                                          + (-1,)))
    if cfg.output_vocab_size is None:
        return target.logits_of(target_params, h)
    return jnp.einsum("k...h,kho->k...o", h, params["lm_head"]).astype(jnp.float32)


@dataclasses.dataclass(frozen=True)
class MedusaDrafter(DrafterBase):
    """Drafts with Medusa heads (module docstring). params: the heads' weights (not hashed)."""

    config: MedusaConfig
    params: Any = dataclasses.field(compare=False, repr=False)
    name: str = "medusa"
    reads_hidden: tuple[int, ...] = (FINAL_NORM,)
    tree: TreeShape | None = None

    def check(self, target: TargetModel, mesh) -> None:
        cfg = self.config
        check_head(self.tree, cfg, target, "the Medusa heads")
        if self.tree is not None and self.tree.depth > cfg.num_heads:
            raise ValueError(f"a tree of depth {self.tree.depth} needs as many Medusa heads; these have "
                             f"{cfg.num_heads}")

    def init(self, params, prefill: PrefillContext) -> jax.Array:
        """f32[B,H]: the final-norm feature of token n - 2 of the prompt (for the first round)."""
        last = jnp.maximum(prefill.prompt_lens - 2, 0)
        return jnp.take_along_axis(prefill.features[:, :, 0], last[:, None, None], axis=1)[:, 0]

    def propose(self, params, last_feature: jax.Array, ctx: DraftContext, gamma: int):
        if self.tree is None and gamma > self.config.num_heads:
            raise ValueError(f"gamma {gamma} exceeds the {self.config.num_heads} Medusa heads")
        emitted = ctx.last_emit
        newest = jnp.take_along_axis(ctx.features[:, :, 0], jnp.maximum(emitted - 1, 0)[:, None, None], axis=1)[:, 0]
        feature = jnp.where((emitted >= 1)[:, None], newest, last_feature)  # f32[B,H] of token n - 2
        logits = medusa_logits(self.config, params, ctx.target, ctx.target_params, feature)  # f32[K,B,Vo]
        if self.tree is not None:
            return self._static_tree(params, logits, ctx, gamma), feature

        def next_head(carry, token, step):  # every head's logits are known: nothing is fed
            return jax.lax.dynamic_index_in_dim(logits, step + 1, keepdims=False), carry

        proposal, _ = draw_chain(ctx, gamma, logits[0], next_head, None, self.config.vocab_size,
                                 params.get("vocab_map"))
        return proposal._replace(num_draft=jnp.where(ctx.num_tokens >= 2, proposal.num_draft, 0)), feature

    def _static_tree(self, params, logits: jax.Array, ctx: DraftContext, nodes: int) -> Proposal:
        """The first ``nodes`` nodes of the static tree (ordered by depth, so every prefix is a tree):
        node (r_1 .. r_d) is head d's r_d-th most likely token."""
        shape = self.tree
        choices = shape.choices or token_tree.default_choices(shape.nodes, shape.depth, shape.topk)
        batch = logits.shape[1]
        if nodes == 0:  # a round without speculation
            return empty_proposal(batch, tree=True)
        parents, depth, rank = (a[:nodes] for a in token_tree.static_tree(choices))
        _, ids = jax.lax.top_k(logits[: int(depth.max())], int(rank.max()) + 1)  # i32[D,B,k]
        tokens = ids[depth - 1, :, rank].T  # i32[B,N]
        if "vocab_map" in params:
            tokens = params["vocab_map"][tokens]
        count = jnp.where(ctx.num_tokens >= 2, len(parents), 0).astype(jnp.int32)
        return Proposal(tokens.astype(jnp.int32), count, None, jnp.broadcast_to(jnp.asarray(parents), (batch, len(parents))))
