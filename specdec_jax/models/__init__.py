"""Model definitions, tokenizers and the by-name registry."""

from specdec_jax.models.llama import Llama, LlamaConfig, forward, param_shapes
from specdec_jax.models.registry import (
    LoadedModel,
    known_models,
    load_model,
    random_llama,
    register_model,
)
from specdec_jax.models.tokenizer import ByteTokenizer

__all__ = [
    "ByteTokenizer",
    "Llama",
    "LlamaConfig",
    "LoadedModel",
    "forward",
    "known_models",
    "load_model",
    "param_shapes",
    "random_llama",
    "register_model",
]
