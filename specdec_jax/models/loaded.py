"""`LoadedModel`: a model with its config and tokenizer, as every loader returns it."""

from __future__ import annotations

from typing import NamedTuple

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

    def as_target(self):
        """``(TargetModel, weights)`` of the model, for the engine (``specdec_jax.target``)."""
        return self.model.as_target()
