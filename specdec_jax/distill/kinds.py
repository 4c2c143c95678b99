"""What `train-draft --kind` trains: a standalone draft model, an EAGLE head, Medusa heads or a DFlash drafter.

One pipeline (`distill.train`: data, AdamW, checkpoints, resume, evaluation,
curve) serves every kind; a kind supplies only what differs:

    data_layers(tc, num_layers)  target hidden states the data stores (None: decoded answers, no features)
    setup(target, tc)            the static architecture (hashable; the loss's first argument)
    init(setup, target, tc, vocab_map) -> {name: array}, including the frozen ones
    frozen(tc)                   names the optimizer leaves alone
    loss(setup, params, batch, train) -> (loss, {"loss", "agreement", ...})
    export(out, setup, params, tokenizer, target_info, info) -> path of what `--draft-model` loads

`agreement` is the share of weighted positions where the drafter's first draft
(given the real context) is the target's argmax: greedy acceptance at draft
position 1. Data arrays are those of `distill.data.Dataset`.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from specdec_jax.distill.config import TrainConfig
from specdec_jax.distill.dflash_drafter import dflash_layers, dflash_loss, dflash_setup, export_dflash, init_dflash
from specdec_jax.distill.draft import WIDTH_KEYS, distill_loss, draft_config, frozen_names, init_draft, top_k_ce
from specdec_jax.distill.eagle3_head import eagle3_config, eagle3_layers, export_eagle3, init_eagle3
from specdec_jax.drafters.eagle import EagleConfig, EagleDrafter, HeadFunctions, init_eagle
from specdec_jax.drafters.eagle3 import Eagle3Config, Eagle3Drafter
from specdec_jax.drafters.heads import save_head, target_fingerprint
from specdec_jax.drafters.medusa import MedusaConfig, init_medusa, medusa_logits
from specdec_jax.models.llama import Llama, LlamaTarget
from specdec_jax.models.loaded import LoadedModel
from specdec_jax.target import FINAL_NORM


def head_vocab(target, tc: TrainConfig) -> int | None:
    return tc.draft_vocab if 0 < tc.draft_vocab < target.config.vocab_size else None


def target_head_rows(target) -> np.ndarray:
    """f32[H,V]: the target's LM head."""
    arrays = target.model.arrays()
    return (arrays["embed"] if target.config.tie_embeddings else arrays["lm_head"]).T


def shared_target_weights(target) -> dict:
    """The target weights a head's loss reads through `TargetModel.embed` / `logits_of`."""
    arrays = target.model.arrays()
    return {name: arrays[name] for name in ("embed", "lm_head") if name in arrays}


def head_target_info(target) -> dict:
    """What a head records of its target (`drafters.heads`): sizes and `target_fingerprint`."""
    cfg = target.config
    return {"hidden_size": cfg.hidden_size, "vocab_size": cfg.vocab_size, "num_layers": cfg.num_layers,
            "fingerprint": target_fingerprint(target)}


class ModelKind:
    """A standalone draft model distilled on the target's answers (`distill.draft`)."""

    name = "model"

    def data_layers(self, tc, num_layers):
        return None

    def setup(self, target, tc):
        return draft_config(target.config, tc)

    def init(self, cfg, target, tc, vocab_map):
        return init_draft(cfg, target.config, target.model.arrays(), tc, vocab_map)

    def frozen(self, tc):
        return frozen_names(tc)

    def loss(self, cfg, params, batch, train):
        return distill_loss(cfg, params, batch)

    def export(self, out, cfg, params, tokenizer, target_info, info):
        from specdec_jax.models.loading import save_model_dir

        model = LoadedModel(Llama.from_arrays(cfg, params), cfg, tokenizer)
        return save_model_dir(out / "draft", model, {"kind": "distilled draft", **info})


@dataclasses.dataclass(frozen=True)
class HeadSetup:
    head: EagleConfig | Eagle3Config | MedusaConfig
    target: LlamaTarget  # for the shared embedding and LM head
    noise: float = 0.0  # eagle: feature noise (relative to the features' RMS) while training
    regression_weight: float = 1.0
    ce_weight: float = 0.1
    ttt_steps: int = 0  # eagle: EAGLE-3's training-time test, steps fed the head's own outputs


class EagleKind:
    """An EAGLE head (`drafters.eagle`): input j = fc(embed(token j+1), feature j), output h_j ~ feature j+1.

    Loss: regression_weight * smooth-L1(h_j, final-norm feature of j+1) (with final-norm features
    only) + ce_weight * cross-entropy of logits(h_j) against the target's law at j+1, over the
    windows' positions; input features get Gaussian noise while training (EAGLE's robustness to
    its own, imperfect features when drafting).

    With ``ttt_steps`` k > 0, EAGLE-3's training-time test: k more steps, each fed the previous
    step's outputs in place of the target's features (step t's input at j is its step t - 1
    output at j - 1), so that step t at j is draft t + 1 of a chain whose real context ends at
    j - t. Its query sees what drafting would have cached: step 0's keys at slots <= j - t and
    its own chain's steps 1..t (`ttt_visible`). Each step has the targets of step 0; the loss is
    the mean over steps, and ``agreement_step{t+1}`` is the agreement of draft t + 1.

    With ``eagle_version`` 3 (the default) the head is EAGLE-3's (`distill.eagle3_head`), its loss the cross-entropy
    (no regression: its features are not the final-norm state), saved in speculators' format.
    """

    name = "eagle"

    def data_layers(self, tc, num_layers):
        return eagle3_layers(tc.feature_layers, num_layers) if tc.eagle_version == 3 else tc.feature_layers

    def setup(self, target, tc):
        cfg = target.config
        widths = {k: getattr(tc, k) or getattr(cfg, k) for k in WIDTH_KEYS}
        if widths["hidden_size"] != cfg.hidden_size:
            raise ValueError("an EAGLE head works at the target's hidden size: leave hidden_size null")
        del widths["hidden_size"]
        if tc.eagle_version == 3:
            head = eagle3_config(cfg, tc.feature_layers, widths, head_vocab(target, tc))
            return HeadSetup(head, LlamaTarget(cfg), tc.feature_noise, 0.0, tc.ce_weight, tc.ttt_steps)
        head = EagleConfig(hidden_size=cfg.hidden_size, vocab_size=cfg.vocab_size, feature_layers=tc.feature_layers,
                           output_vocab_size=head_vocab(target, tc), rope_theta=cfg.rope_theta,
                           rms_norm_eps=cfg.rms_norm_eps, **widths)
        return HeadSetup(head, LlamaTarget(cfg), tc.feature_noise, tc.regression_weight, tc.ce_weight, tc.ttt_steps)

    def init(self, setup, target, tc, vocab_map):
        if isinstance(setup.head, Eagle3Config):
            return {**init_eagle3(setup.head, tc.seed, target_head_rows(target), vocab_map),
                    "target": shared_target_weights(target)}
        arrays = init_eagle(setup.head, jax.random.key(tc.seed), target_head_rows(target), vocab_map)
        return {**arrays, "target": shared_target_weights(target)}

    def frozen(self, tc):
        return ("vocab_map", "target")

    def loss(self, setup, params, batch, train):
        cfg, target = setup.head, setup.target
        tokens, weight = batch["tokens"], batch["weight"][:, 1:]  # input j predicts position j + 1's law
        features = batch["features"].astype(jnp.float32)  # f32[B,S,k,H]
        inputs = head_functions(cfg).project(cfg, params, features)
        if train and setup.noise > 0:
            key = jax.random.fold_in(jax.random.key(0), batch["step"])
            rms = jnp.sqrt(jnp.mean(inputs * inputs, axis=-1, keepdims=True))
            inputs = inputs + setup.noise * rms * jax.random.normal(key, inputs.shape)
        width, losses, metrics = tokens.shape[1] - 1, [], {}
        outputs = unrolled_outputs(cfg, target, params, tokens[:, 1:], inputs[:, :-1], setup.ttt_steps + 1)
        for step, h in enumerate(outputs):
            step_loss, step_metrics = self._step_loss(setup, params, batch, h, features,
                                                      weight * (jnp.arange(width) >= step))
            losses.append(step_loss)
            if step == 0:
                metrics.update(step_metrics)
            else:
                metrics[f"agreement_step{step + 1}"] = step_metrics["agreement"]
        loss = sum(losses) / len(losses)
        return loss, {"loss": loss, **metrics}

    @staticmethod
    def _step_loss(setup, params, batch, h, features, weight):
        """(loss, metrics) of outputs ``h f32[B,S-1,H]`` (input j predicts position j + 1) under ``weight``."""
        cfg = setup.head
        logits = head_functions(cfg).logits(cfg, params, setup.target, params["target"], h)[0]
        ce, agree = top_k_ce(logits, params.get("vocab_map"), batch["top_ids"][:, 1:], batch["top_logp"][:, 1:],
                             setup.target.config.vocab_size)
        total = jnp.maximum(weight.sum(), 1.0)
        ce = jnp.sum(ce * weight) / total
        loss = setup.ce_weight * ce
        metrics = {"ce": ce, "agreement": jnp.sum(agree * weight) / total}
        if cfg.feature_layers == (FINAL_NORM,):
            error = jnp.abs(h - features[:, 1:, 0])
            smooth = jnp.where(error < 1.0, 0.5 * error**2, error - 0.5).mean(-1)
            regression = jnp.sum(smooth * weight) / total
            loss = loss + setup.regression_weight * regression
            metrics["regression"] = regression
        return loss, metrics

    def export(self, out, setup, params, tokenizer, target_info, info):
        if isinstance(setup.head, Eagle3Config):
            return export_eagle3(out / "head", setup.head, params, target_info, info, setup.ttt_steps + 1)
        arrays = {k: v for k, v in params.items() if k != "target"}
        return save_head(out / "head", self.name, setup.head, arrays, target_info, info)


def head_functions(cfg: EagleConfig | Eagle3Config) -> HeadFunctions:
    """The projection, pass and logits of an EAGLE-1 or EAGLE-3 head, as drafting calls them."""
    return (Eagle3Drafter if isinstance(cfg, Eagle3Config) else EagleDrafter).head


def unrolled_outputs(cfg: EagleConfig | Eagle3Config, target, params, tokens: jax.Array, inputs: jax.Array,
                     steps: int) -> list[jax.Array]:
    """The head's outputs f32[B,S,H] at each of ``steps`` training-time-test steps (`EagleKind`)
    over ``tokens i32[B,S]`` (token j + 1 of input j) and projected target features ``inputs
    f32[B,S,H]``: step 0 is the teacher-forced pass; step t's output at j is what drafting
    would compute as draft t + 1 after the real context up to j - t (valid for j >= t); each step is
    fed what drafting feeds (the head's `HeadFunctions`: its output, or EAGLE-3's ``norm_output``)."""
    batch_size, width = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(width, dtype=jnp.int32)[None, :], (batch_size, width))
    cache, fed, outputs = cfg.layer.init_cache(batch_size, steps * width), inputs, []
    functions = head_functions(cfg)
    for step in range(steps):
        visible = None if step == 0 else jnp.broadcast_to(ttt_visible(width, step, steps),
                                                          (batch_size, width, steps * width))
        h, cache = functions.head_pass(cfg, params, target, params["target"], tokens, fed,
                             cache.with_lengths(jnp.full((batch_size,), step * width, jnp.int32)), positions,
                             visible=visible)
        outputs.append(h)
        fed = functions.logits(cfg, params, target, params["target"], h)[1]
        fed = jnp.pad(fed[:, :-1], ((0, 0), (1, 0), (0, 0)))  # step t + 1's input at j: step t's output at j - 1
    return outputs


def ttt_visible(width: int, step: int, steps: int) -> np.ndarray:
    """bool[S,steps*S]: what training-time-test step ``step`` >= 1 at position j sees in a cache of
    ``steps`` blocks of ``width`` slots (block u holds step u's keys at slot u * width + position):
    step 0 at positions <= j - step (the real context), and step u's key at j - step + u for
    1 <= u <= step (its own chain; u = step is itself)."""
    j = np.arange(width)[:, None]
    block, position = np.divmod(np.arange(steps * width)[None, :], width)
    real = (block == 0) & (position <= j - step)
    chain = (block >= 1) & (block <= step) & (position == j - step + block)
    return real | chain


class MedusaKind:
    """Medusa heads (`drafters.medusa`): head k on the final-norm feature of position j, trained by
    cross-entropy against the target's law at position j + k (the token k + 1 ahead)."""

    name = "medusa"

    def data_layers(self, tc, num_layers):
        return (FINAL_NORM,)

    def setup(self, target, tc):
        cfg = target.config
        head = MedusaConfig(cfg.hidden_size, cfg.vocab_size, tc.medusa_heads, head_vocab(target, tc))
        return HeadSetup(head, LlamaTarget(cfg))

    def init(self, setup, target, tc, vocab_map):
        return {**init_medusa(setup.head, target_head_rows(target), vocab_map), "target": shared_target_weights(target)}

    def frozen(self, tc):
        return ("vocab_map", "target")

    def loss(self, setup, params, batch, train):
        cfg = setup.head
        features = batch["features"][:, :, 0].astype(jnp.float32)  # f32[B,S,H]
        logits = medusa_logits(cfg, params, setup.target, params["target"], features)  # f32[K,B,S,Vo]
        width = features.shape[1]
        losses, agreements = [], []
        for k in range(1, cfg.num_heads + 1):  # head k at position j: the law at position j + k
            weight = batch["weight"][:, k:]
            ce, agree = top_k_ce(logits[k - 1][:, : width - k], params.get("vocab_map"), batch["top_ids"][:, k:],
                                 batch["top_logp"][:, k:], cfg.vocab_size)
            total = jnp.maximum(weight.sum(), 1.0)
            losses.append(jnp.sum(ce * weight) / total)
            agreements.append(jnp.sum(agree * weight) / total)
        loss = jnp.mean(jnp.stack(losses))
        return loss, {"loss": loss, "agreement": agreements[0],
                      **{f"agreement_head{k + 1}": a for k, a in enumerate(agreements)}}

    def export(self, out, setup, params, tokenizer, target_info, info):
        arrays = {k: v for k, v in params.items() if k != "target"}
        return save_head(out / "head", self.name, setup.head, arrays, target_info, info)


class DFlashKind:
    """A DFlash block drafter (`drafters.dflash`) on the target's features, trained on anchored blocks as
    speculators trains it (`distill.dflash_drafter`), saved as z-lab's ``save_pretrained`` folder."""

    name = "dflash"

    def data_layers(self, tc, num_layers):
        return dflash_layers(tc.feature_layers, tc.num_layers, num_layers)

    def setup(self, target, tc):
        cfg = target.config
        widths = {k: getattr(tc, k) or getattr(cfg, k) for k in WIDTH_KEYS}
        if widths.pop("hidden_size") != cfg.hidden_size:
            raise ValueError("a DFlash drafter works at the target's hidden size: leave hidden_size null")
        return dflash_setup(target, tc, widths)

    def init(self, setup, target, tc, vocab_map):
        return {**init_dflash(setup.drafter, tc.seed), "target": shared_target_weights(target)}

    def frozen(self, tc):
        return ("target",)

    def loss(self, setup, params, batch, train):
        return dflash_loss(setup, params, batch, train)

    def export(self, out, setup, params, tokenizer, target_info, info):
        return export_dflash(out / "head", setup.drafter, params, target_info["num_layers"])


KINDS = {kind.name: kind for kind in (ModelKind(), EagleKind(), MedusaKind(), DFlashKind())}


def kind_of(tc: TrainConfig):
    return KINDS[tc.kind]

