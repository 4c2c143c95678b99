"""The DFlash drafter `train-draft --kind dflash` trains (`drafters.dflash`), and its export as z-lab's
``save_pretrained`` folder (config.json + model.safetensors), which `drafters.published` and the dflash
package load.

The dflash 0.1.0 package has no trainer; the objective is speculators 0.9.0's DFlash training
(``speculators/models/dflash/core.py`` ``_backbone_forward``, ``utils.py`` ``select_anchors``,
``attention.py`` ``create_anchor_block_mask_mod``, ``metrics.py`` and ``losses/utils.py``), on this
project's teacher-forced windows (`distill.data`: ``tokens i32[B,S]``, target ``features f16[B,S,m,Ht]``,
the top-k law of token j + 1 at position j, ``weight[j]`` = 1 where token j + 1 exists):

- Anchors: per window, `anchors` distinct positions a drawn uniformly (a function of the step; held-out
  batches a fixed draw) among those with 1 <= a <= S - B + 1 and ``weight[a] > 0`` (every draft's
  teacher inside the window, draft 1 has one, a non-empty context as in serving, where t0 follows the
  prompt; speculators draws among its loss-mask positions a < S - B); fewer candidates than `anchors`
  leave the rest unused (speculators' ``anchor_valid``).
- Block of anchor a: ``[tokens[a], mask, ..., mask]`` (B tokens) at positions a .. a + B - 1; its
  queries see the context slots j < a (the target features of the tokens before the anchor, not the
  anchor's own: ``before_anchor``) and every token of their own block (bidirectional), no other block.
- Draft i (block position i = 1 .. B - 1) is scored against the target's law of token a + i (data
  position a + i - 1) with `distill.draft.top_k_ce`, the cross-entropy to the target's top-k law the
  EAGLE kind uses (speculators' dflash default ``ce`` is the case ``teacher_top_k: 1``), masked by
  ``weight[a + i - 1]``; position 0 (the anchor) is not trained (``sample_from_anchor`` false).
- Position weights ``w_i`` (no gradient): ``dpace`` (speculators' dflash default, ``dpace_loss_decay``,
  alpha 0.5): ``w_i = m_i * sum_{j >= i} m_j prod_{k <= j} s_k``, ``s_k = (1 - alpha) q_k + alpha`` where
  ``m_k`` = 1, else 1, ``q_k`` the drafter's probability of the target's top token; ``decay``
  (the DFlash paper's, speculators' ``dflash_loss_decay``): ``w_i = exp(-(i - 1) / decay_gamma)``.
- Loss: ``sum(ce * m * w) / sum(m)`` over the batch's drafts (speculators' ``loss_function``).

The forward is the one drafting runs: `drafters.dflash.write_context` writes the window's context into
a cache, and `drafters.dflash.block_logits` runs every anchor's block in one pass (the blocks side by
side, kept apart by its ``own`` mask). The embedding and LM head are the target's (frozen, not saved).
"""

from __future__ import annotations

import dataclasses
import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np

from specdec_jax import interrupts
from specdec_jax.distill.draft import random_weights, top_k_ce
from specdec_jax.drafters.dflash import DFlashConfig, block_logits, dflash_shapes, write_context
from specdec_jax.drafters.published import zlab_layer_ids
from specdec_jax.drafters.speculators_format import layer_config
from specdec_jax.files import write_text_atomic
from specdec_jax.models.llama import LlamaConfig, LlamaTarget
from specdec_jax.models.loading import hf_layer_weights
from specdec_jax.target import FINAL_NORM

DPACE_ALPHA = 0.5  # speculators' dpace_alpha default


@dataclasses.dataclass(frozen=True)
class DFlashSetup:
    drafter: DFlashConfig
    target: LlamaTarget  # for the shared embedding and LM head
    anchors: int  # blocks per window
    position_weight: str  # "dpace" or "decay" (module docstring)
    decay_gamma: float


def dflash_layers(feature_layers: tuple[int, ...], num_draft: int, num_target: int) -> tuple[int, ...]:
    """Our target layers of the drafter: ``feature_layers``, or for ``(-1,)`` z-lab's default
    (`published.zlab_layer_ids`, duplicates of a shallow target dropped; its id L - 1, the final-normed
    state, is our FINAL_NORM). z-lab's ids name layer outputs with L - 1 final-normed, so our layer L - 1
    (before the norm) has no id: refused."""
    if tuple(feature_layers) == (FINAL_NORM,):
        ids = dict.fromkeys(zlab_layer_ids(num_target, num_draft))
        return tuple(FINAL_NORM if i == num_target - 1 else i for i in ids)
    if any(not -1 <= layer < num_target - 1 for layer in feature_layers):
        raise ValueError(f"a DFlash drafter reads target layers 0..{num_target - 2} or -1 (the final-norm state): "
                         f"z-lab's format has no id for the un-normed output of the last layer, got "
                         f"{list(feature_layers)}")
    return tuple(feature_layers)


def default_mask_token(tokenizer, vocab_size: int) -> int:
    """speculators' ``resolve_mask_token_id`` as far as this project's tokenizers tell: the first embedding
    row past the tokenizer's vocabulary (where it adds ``<|MASK|>``), else the EOS (its pad/eos fallback)."""
    size = int(tokenizer.vocab_size)
    return size if size < vocab_size else int(tokenizer.eos_id)


def dflash_setup(target, tc, widths: dict) -> DFlashSetup:
    """The drafter of ``tc`` for ``target`` (a `LoadedModel`): ``tc.num_layers`` Qwen3 layers at the target's
    hidden size, RoPE and norm epsilon, ``widths`` (intermediate_size, num_heads, num_kv_heads, head_dim)."""
    cfg = target.config
    mask = tc.mask_token if tc.mask_token >= 0 else default_mask_token(target.tokenizer, cfg.vocab_size)
    layer = LlamaConfig(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, num_layers=tc.num_layers,
                        rope_theta=cfg.rope_theta, rms_norm_eps=cfg.rms_norm_eps, rope_scaling=cfg.rope_scaling,
                        max_positions=cfg.max_positions, qk_norm=True, **widths)
    drafter = DFlashConfig(layer, dflash_layers(tc.feature_layers, tc.num_layers, cfg.num_layers), cfg.hidden_size,
                           tc.block_size, mask)
    return DFlashSetup(drafter, LlamaTarget(cfg), tc.anchors, tc.position_weight, tc.decay_gamma)


def init_dflash(cfg: DFlashConfig, seed: int) -> dict[str, np.ndarray]:
    """Random weights (`distill.draft.random_weights`)."""
    return random_weights(dflash_shapes(cfg), seed)


def sample_anchors(weight: jax.Array, count: int, block: int, key: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(anchors i32[B,A], valid bool[B,A])``: A = min(count, S - B + 1) distinct anchors per row of
    ``weight f32[B,S]`` drawn uniformly among the candidates (module docstring); valid is false where a row
    has fewer."""
    width = weight.shape[1]
    position = jnp.arange(width - block + 2)
    candidate = (weight[:, : width - block + 2] > 0) & (position >= 1)
    score = jnp.where(candidate, jax.random.uniform(key, candidate.shape), -1.0)
    top, anchors = jax.lax.top_k(score, min(count, width - block + 1))
    return anchors.astype(jnp.int32), top >= 0


def anchored_blocks(cfg: DFlashConfig, tokens: jax.Array, anchors: jax.Array):
    """``(tokens i32[B,A*K], positions i32[B,A*K], context bool[B,A*K,S], own bool[B,A*K,A*K])`` of the
    blocks of ``anchors i32[B,A]`` (K the block size) over windows ``tokens i32[B,S]``. A block always sees
    itself (an unused anchor's block too: no query without a key)."""
    batch, count = anchors.shape
    block = cfg.block_size
    positions = (anchors[:, :, None] + jnp.arange(block)[None, None, :]).reshape(batch, count * block)
    first = jnp.take_along_axis(tokens, anchors, axis=1)[:, :, None]
    masks = jnp.full((batch, count, block - 1), cfg.mask_token, jnp.int32)
    ids = jnp.concatenate([first, masks], axis=2).reshape(batch, count * block)
    anchor_of = jnp.repeat(anchors, block, axis=1)  # i32[B,A*K]
    context = jnp.arange(tokens.shape[1])[None, None, :] < anchor_of[:, :, None]
    which = jnp.arange(count * block) // block
    own = (which[:, None] == which[None, :])[None]
    return ids, positions, context, jnp.broadcast_to(own, (batch, count * block, count * block))


def anchored_logits(cfg: DFlashConfig, target: LlamaTarget, params: dict, tokens: jax.Array, features: jax.Array,
                    anchors: jax.Array) -> jax.Array:
    """f32[B,A,K,V]: the logits of every block position of the blocks of ``anchors i32[B,A]`` over windows
    ``tokens i32[B,S]`` with target ``features [B,S,m,Ht]``, as drafting computes each: `write_context` of
    the window, then `block_logits` of all blocks in one pass (`anchored_blocks`' masks). ``params``: the
    drafter's arrays and ``target`` (the target's embedding and LM head)."""
    batch, width = tokens.shape
    steps = jnp.broadcast_to(jnp.arange(width, dtype=jnp.int32)[None, :], (batch, width))
    cache = write_context(cfg, params, cfg.layer.init_cache(batch, width), features, steps)
    ids, positions, context, own = anchored_blocks(cfg, tokens, anchors)
    logits = block_logits(cfg, params, target, params["target"], ids, positions, cache, context, own)
    return logits.reshape(batch, anchors.shape[1], cfg.block_size, logits.shape[-1])


def position_weights(q: jax.Array, mask: jax.Array, how: str, gamma: float) -> jax.Array:
    """f32[..., K-1]: the weights of drafts 1 .. K - 1 (module docstring) given the drafter's probability
    ``q f32[..., K-1]`` of the target's top token and ``mask f32[..., K-1]``; constants to the gradient."""
    if how == "decay":
        return jnp.broadcast_to(jnp.exp(-jnp.arange(q.shape[-1], dtype=jnp.float32) / gamma), q.shape)
    smooth = jnp.where(mask > 0, (1.0 - DPACE_ALPHA) * q + DPACE_ALPHA, 1.0)
    prefix = jnp.cumprod(smooth, axis=-1) * mask
    return jax.lax.stop_gradient(mask * jnp.flip(jnp.cumsum(jnp.flip(prefix, -1), axis=-1), -1))


def dflash_loss(setup: DFlashSetup, params: dict, batch: dict, train: bool) -> tuple[jax.Array, dict]:
    """(loss, {"loss", "agreement", "accepted"}) of a batch of windows (module docstring): agreement is that
    of draft 1, accepted the mean run of leading drafts equal to the target's argmax per used block (greedy
    drafts accepted, the verify pass's own token not counted)."""
    cfg, tokens, weight = setup.drafter, batch["tokens"], batch["weight"]
    block = cfg.block_size
    key = jax.random.fold_in(jax.random.key(0), batch["step"]) if train else jax.random.key(1)
    anchors, valid = sample_anchors(weight, setup.anchors, block, key)
    logits = anchored_logits(cfg, setup.target, params, tokens, batch["features"], anchors)[:, :, 1:]
    teacher = anchors[:, :, None] + jnp.arange(block - 1)[None, None, :]  # data position of draft i's law
    top_ids, top_logp = _at(batch["top_ids"], teacher), _at(batch["top_logp"], teacher)
    ce, agree = top_k_ce(logits, None, top_ids, top_logp, cfg.layer.vocab_size)
    mask = _at(weight, teacher) * valid[:, :, None]
    q = jnp.exp(jnp.take_along_axis(jax.nn.log_softmax(logits, axis=-1), top_ids[..., :1], axis=-1)[..., 0])
    w = position_weights(q, mask, setup.position_weight, setup.decay_gamma)
    total = jnp.maximum(mask.sum(), 1.0)
    loss = jnp.sum(ce * mask * w) / total
    first = jnp.maximum(mask[..., 0].sum(), 1.0)
    accepted = jnp.cumprod(agree * mask, axis=-1).sum(-1)
    return loss, {"loss": loss, "agreement": jnp.sum(agree[..., 0] * mask[..., 0]) / first,
                  "accepted": jnp.sum(accepted * mask[..., 0]) / first}


def _at(x: jax.Array, index: jax.Array) -> jax.Array:
    """``x[b, index[b, ...]]`` of ``x [B,S,...]`` at ``index i32[B,A,K]``: ``[B,A,K,...]``."""
    flat = index.reshape(index.shape[0], -1)
    taken = jnp.take_along_axis(x, flat.reshape(flat.shape + (1,) * (x.ndim - 2)), axis=1)
    return taken.reshape(index.shape + x.shape[2:])


def zlab_config(cfg: DFlashConfig, num_target_layers: int) -> dict:
    """config.json as z-lab's ``DFlashDraftModel.save_pretrained`` writes it (a Qwen3 config with
    ``block_size``, ``num_target_layers`` and ``dflash_config``: the mask token and z-lab's target layer ids,
    output of layer i, i = L - 1 the final-normed state)."""
    ids = [num_target_layers - 1 if layer == FINAL_NORM else layer for layer in cfg.feature_layers]
    layers = cfg.layer.num_layers
    return {**layer_config(cfg), "architectures": ["DFlashDraftModel"], "block_size": cfg.block_size,
            "num_target_layers": num_target_layers, "dtype": "float32",
            "dflash_config": {"mask_token_id": cfg.mask_token, "target_layer_ids": ids},
            "layer_types": ["full_attention"] * layers, "max_window_layers": layers, "sliding_window": None,
            "use_sliding_window": False}


def zlab_weights(cfg: DFlashConfig, params: dict) -> dict[str, np.ndarray]:
    """z-lab's state dict (``[out, in]`` matrices) of the drafter's arrays (`drafters.dflash` names)."""
    weights = {f"layers.{i}.{theirs}": params[ours][i]
               for ours, theirs in hf_layer_weights(cfg.layer).items() for i in range(cfg.layer.num_layers)}
    weights.update({"fc.weight": params["fc"], "hidden_norm.weight": params["hidden_norm"],
                    "norm.weight": params["norm"]})
    return {name: np.ascontiguousarray(np.asarray(w, np.float32)) for name, w in weights.items()}


def export_dflash(folder, cfg: DFlashConfig, params: dict, num_target_layers: int) -> pathlib.Path:
    """Writes z-lab's folder (`zlab_config`, `zlab_weights`; not the target's embedding or LM head) and
    returns its path; config.json last, so a folder cut short is not taken for a drafter."""
    from safetensors.numpy import save_file

    folder = pathlib.Path(folder).resolve()
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").unlink(missing_ok=True)
    with interrupts.deferred():
        save_file(zlab_weights(cfg, params), str(folder / "model.safetensors"), metadata={"format": "pt"})
    write_text_atomic(folder / "config.json", json.dumps(zlab_config(cfg, num_target_layers), indent=2))
    return folder
