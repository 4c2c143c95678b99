"""`LoadedModel`: a model with its config and tokenizer, as every loader returns it."""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import numpy as np

from specdec_jax.models.llama import Llama, LlamaConfig
from specdec_jax.models.tokenizer import ByteTokenizer


class LoadedModel(NamedTuple):
    """What ``load_model`` and the loaders return; unpacks as ``model, config, tokenizer``.
    ``tokenizer`` is a `ByteTokenizer` or a `BPETokenizer` (same interface)."""

    model: Llama
    config: LlamaConfig
    tokenizer: ByteTokenizer

    def astype(self, dtype: str) -> LoadedModel:
        """This model with its weights (and so its activations and KV cache) in ``dtype``: "float32" or
        "bfloat16" (`Llama.astype`)."""
        model = self.model.astype(dtype)
        return LoadedModel(model, model.config, self.tokenizer)

    def with_output_vocab(self, size: int, ranking: np.ndarray | None = None) -> LoadedModel:
        """This model as a cheaper draft: logits over ``size`` ids of its vocabulary and its stop ids only
        (``output_vocab_size``, ``vocab_map``; q is zero elsewhere): the first ``size`` of ``ranking``
        (i32[V], every id, the ones to keep first: `token_ranking.ranked_ids`), or without one the first
        ``size`` ids (a byte-level BPE vocabulary is in merge order, so its first ids are the tokens
        frequent in the tokenizer's training text). The head's rows are copied from the model's head (or
        its tied embedding)."""
        config = self.config
        if config.output_vocab_size is not None:
            raise ValueError("the model's output vocabulary is reduced already")
        if not 0 < size < config.vocab_size:
            raise ValueError(f"a reduced output vocabulary needs 0 < size < {config.vocab_size}, got {size}")
        if ranking is not None and np.shape(ranking) != (config.vocab_size,):
            raise ValueError(f"a ranking orders all {config.vocab_size} ids, got shape {np.shape(ranking)}")
        kept = np.arange(size) if ranking is None else np.asarray(ranking)[:size]
        ids = np.asarray(sorted(set(kept.tolist()) | set(self.tokenizer.stop_ids)), np.int32)
        arrays = self.model.arrays()
        head = arrays.pop("lm_head") if "lm_head" in arrays else arrays["embed"]  # [V, H]
        arrays.update(lm_head=np.ascontiguousarray(head[ids]), vocab_map=ids)
        config = dataclasses.replace(config, tie_embeddings=False, output_vocab_size=len(ids), dtype="float32")
        model = type(self.model).from_arrays(config, arrays).astype(self.config.dtype)
        return LoadedModel(model, model.config, self.tokenizer)

    def as_target(self):
        """``(TargetModel, weights)`` of the model, for the engine (``specdec_jax.target``)."""
        return self.model.as_target()
