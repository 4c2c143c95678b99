"""Settings of `specdec-jax train-draft`: one frozen dataclass, YAML keys = flags (underscores for dashes).

Precedence as for runs: dataclass defaults < YAML file (`--config`) < flags.
Unknown keys and bad values are ValueErrors that name the file and the key.
"""

from __future__ import annotations

import dataclasses
import pathlib
from typing import Any

from specdec_jax.config import blame, read_yaml
from specdec_jax.typed import check_fields


KINDS = ("model", "eagle", "medusa", "dflash")


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    # what to train: a standalone draft model, an EAGLE head, Medusa heads or a DFlash drafter (distill.kinds)
    kind: str = "model"
    # target and data
    target: str = "smollm2-135m"
    prompts_file: str | None = None  # JSONL with question_id/turns (Spec-Bench form); None: Spec-Bench
    heldout_per_category: int = 5  # the last N question ids of each category are held out: never trained on
    max_train_prompts: int = 0  # 0: every training prompt (all turns of the training questions)
    eval_prompts: int = 32  # held-out questions (first turns) answered for evaluation during training
    max_prompt_tokens: int = 0  # skip longer prompts (their prefill dominates data time); 0: keep all
    gen_max_new_tokens: int = 128  # length of the target's greedy answers used as data
    gen_batch_size: int = 16
    teacher_top_k: int = 16  # the loss matches the target's law on its top-k tokens
    seq_len: int = 256  # training windows (the last seq_len tokens of each prompt + answer)
    answers: bool = True  # eagle/medusa: train on prompt + the target's answer (False: prompt text only)
    extra_text: str = ""  # eagle/medusa: more training text, teacher-forced only: "chitchat" (distill.chitchat)
    extra_examples: int = 0  # how many texts of extra_text (conversations), one window each
    # draft architecture (None: the target's value)
    num_layers: int = 2
    hidden_size: int | None = None
    intermediate_size: int | None = None
    num_heads: int | None = None
    num_kv_heads: int | None = None
    head_dim: int | None = None
    draft_vocab: int = 8192  # output ids kept (most frequent in the training data); 0: the full vocabulary
    init: str = "target"  # "target": copy embedding, final norm, head rows and the first layers; "random"
    # eagle and medusa heads
    feature_layers: tuple[int, ...] = (-1,)  # target hidden states the EAGLE head reads (-1: final norm)
    medusa_heads: int = 4  # K heads, head k proposing the token k + 1 ahead
    feature_noise: float = 0.1  # eagle: Gaussian noise on input features, relative to their RMS
    regression_weight: float = 1.0  # eagle: smooth-L1 feature regression (final-norm features only)
    ce_weight: float = 0.1  # eagle: cross-entropy against the target's law
    ttt_steps: int = 0  # eagle: EAGLE-3's training-time test, k more steps on the head's own features
    # eagle: 3, EAGLE-3's head (speculators' format, vLLM loads it), where feature_layers [-1] stands for
    # the published ones (distill.eagle3_head); 1, EAGLE-1's (this project's head folder)
    eagle_version: int = 3
    # dflash (distill.dflash_drafter): num_layers draft layers reading feature_layers ([-1]: z-lab's default
    # layers), draft_vocab 0 (the target's LM head); blocks of block_size tokens (t0 and block_size - 1 masks)
    block_size: int = 16
    anchors: int = 16  # blocks drawn per training window
    position_weight: str = "dpace"  # per-draft loss weights: "dpace" (speculators' default) or "decay"
    decay_gamma: float = 4.0  # "decay": draft i weighs exp(-(i - 1) / decay_gamma)
    mask_token: int = -1  # the block's mask id; -1: an unused embedding row past the tokenizer's ids, else EOS
    # optimisation (AdamW, linear warmup then cosine decay, global-norm clipping)
    steps: int = 300
    batch_size: int = 16
    learning_rate: float = 1e-3
    warmup_steps: int = 20
    weight_decay: float = 0.01
    clip_norm: float = 1.0
    seed: int = 0
    # bookkeeping
    save_every: int = 50
    eval_every: int = 50
    keep_checkpoints: int = 2

    def __post_init__(self):
        object.__setattr__(self, "feature_layers", _layers(self.feature_layers))
        check_fields(self)  # types first (specdec_jax.typed): answers "false" is not true
        positive = ("heldout_per_category", "eval_prompts", "gen_max_new_tokens", "gen_batch_size", "teacher_top_k", "seq_len",
                    "num_layers", "steps", "batch_size", "save_every", "eval_every", "keep_checkpoints")
        for name in positive:
            value = getattr(self, name)
            if value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        for name in ("max_train_prompts", "max_prompt_tokens", "draft_vocab", "warmup_steps"):
            value = getattr(self, name)
            if value < 0:
                raise ValueError(f"{name} must be an int >= 0, got {value!r}")
        for name in ("hidden_size", "intermediate_size", "num_heads", "num_kv_heads", "head_dim"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be null or an int >= 1, got {value!r}")
        if self.kind not in KINDS:
            raise ValueError(f"kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if self.extra_text not in ("", "chitchat"):
            raise ValueError(f"extra_text must be '' or 'chitchat', got {self.extra_text!r}")
        if self.extra_examples < 0:
            raise ValueError(f"extra_examples must be an int >= 0, got {self.extra_examples!r}")
        if self.extra_text and self.kind == "model":
            raise ValueError("extra_text feeds teacher-forced feature data: it needs kind eagle or medusa or dflash")
        if self.medusa_heads < 1:
            raise ValueError(f"medusa_heads must be an int >= 1, got {self.medusa_heads!r}")
        if self.feature_noise < 0 or self.regression_weight < 0 or self.ce_weight < 0:
            raise ValueError("feature_noise, regression_weight and ce_weight must be >= 0")
        if self.ttt_steps < 0:
            raise ValueError(f"ttt_steps must be an int >= 0, got {self.ttt_steps!r}")
        if self.ttt_steps and self.kind != "eagle":
            raise ValueError("ttt_steps (the training-time test) is for kind eagle")
        if self.eagle_version not in (1, 3):
            raise ValueError(f"eagle_version must be 1 or 3, got {self.eagle_version!r}")
        eagle3 = self.kind == "eagle" and self.eagle_version == 3
        if eagle3 and len(self.feature_layers) > 1 and -1 in self.feature_layers:
            raise ValueError("an EAGLE-3 head reads inputs of target layers (speculators' format): feature_layers "
                             "cannot hold -1, the final-norm state (alone it stands for the published layers)")
        if self.kind == "dflash":
            self._check_dflash()
        if self.init not in ("target", "random"):
            raise ValueError(f"init must be 'target' or 'random', got {self.init!r}")
        if not self.learning_rate > 0 or self.weight_decay < 0 or not self.clip_norm > 0:
            raise ValueError("learning_rate and clip_norm must be > 0, weight_decay >= 0")
        if self.warmup_steps >= self.steps:
            raise ValueError(f"warmup_steps ({self.warmup_steps}) must be below steps ({self.steps})")

    def _check_dflash(self) -> None:
        """The settings of kind dflash (`distill.dflash_drafter`), each a one-line ValueError."""
        if self.block_size < 2:
            raise ValueError(f"block_size must be at least 2 (t0 and one mask), got {self.block_size}")
        if self.block_size > self.seq_len - 1:
            raise ValueError(f"block_size {self.block_size} leaves no anchor in windows of seq_len {self.seq_len}: "
                             f"at most seq_len - 1")
        if self.anchors < 1:
            raise ValueError(f"anchors must be an int >= 1, got {self.anchors!r}")
        if self.position_weight not in ("dpace", "decay"):
            raise ValueError(f"position_weight must be 'dpace' or 'decay', got {self.position_weight!r}")
        if not self.decay_gamma > 0:
            raise ValueError(f"decay_gamma must be > 0, got {self.decay_gamma!r}")
        if self.mask_token < -1:
            raise ValueError(f"mask_token must be a token id, or -1 for the default, got {self.mask_token!r}")
        if self.draft_vocab:
            raise ValueError("a DFlash drafter drafts over the target's whole vocabulary through its LM head: "
                             f"draft_vocab must be 0, got {self.draft_vocab}")

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["feature_layers"] = list(self.feature_layers)
        return d


def _layers(value) -> tuple[int, ...]:
    """feature_layers from YAML (a list, or one int) or a flag ("-1" or "3,15,-1")."""
    if isinstance(value, str):
        value = [v for v in value.split(",") if v.strip()]
    value = [value] if isinstance(value, int) else list(value)
    try:
        layers = tuple(int(v) for v in value)
    except (TypeError, ValueError):
        raise ValueError(f"feature_layers must be layer indices, got {value!r}") from None
    if not layers or len(set(layers)) != len(layers) or min(layers) < -1:
        raise ValueError(f"feature_layers must be distinct indices >= -1, got {list(layers)}")
    return layers


FIELDS = {f.name: f for f in dataclasses.fields(TrainConfig)}


def train_config(file: str | pathlib.Path | None = None, **flags) -> TrainConfig:
    """TrainConfig from an optional YAML file overridden by flags (None flags are ignored)."""
    values: dict[str, Any] = {}
    where = str(file) if file else "flags"
    if file:
        for key, value in read_yaml(file, "train config").items():
            name = str(key).replace("-", "_")
            if name not in FIELDS:
                raise ValueError(f"{file}: unknown key {key!r} (known: {', '.join(FIELDS)})")
            values[name] = value
    given = {k: v for k, v in flags.items() if v is not None}
    try:
        return TrainConfig(**{**values, **given})
    except (TypeError, ValueError) as err:
        raise ValueError(f"{blame(err, given, where)}: {err}") from None
