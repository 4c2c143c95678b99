"""The transformers peer of `specdec-jax bench --peer hf`: greedy decoding, and prompt-lookup decoding
(beside our n-gram drafter) or assisted generation with the same draft model (`assistant_model`, beside
our draft-model drafter).

transformers (with torch, the optional `hf` extra: `pip install -e ".[hf]"`)
loads the same checkpoints as ours: a registered model's GGUF, a `.gguf`
path, or a Hugging Face directory. Assisted generation keeps transformers'
defaults (its heuristic schedule of assistant tokens per round). It is timed the way bench times our engine:
each prompt's decode phase is the median of `repeats` generate calls minus the
time of a 1-token call (prefill and first token).
"""

from __future__ import annotations

import pathlib
import statistics
import time


class HFPeer:
    """transformers `generate` on the target's checkpoint, float32 on the CPU."""

    def __init__(self, model_name: str, assistant_name: str | None = None):
        try:
            import torch
            from transformers import AutoModelForCausalLM
        except ImportError as err:
            raise ValueError('--peer hf needs transformers and torch: pip install -e ".[hf]"') from err
        self.torch = torch
        folder, kwargs = _checkpoint(model_name)
        self.model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **kwargs).eval()
        self.assistant = None
        if assistant_name is not None:
            folder, kwargs = _checkpoint(assistant_name)
            self.assistant = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **kwargs).eval()

    def generate(self, ids: list[int], max_new_tokens: int, eos_id: int | None, lookup: int = 0,
                 assisted: bool = False) -> list[int]:
        """Greedy continuation of `ids`; with `lookup` > 0, prompt-lookup decoding proposing `lookup` tokens;
        with `assisted`, assisted generation by the assistant model."""
        torch = self.torch
        extra = {"prompt_lookup_num_tokens": lookup} if lookup else {}
        if assisted:
            extra["assistant_model"] = self.assistant
        if eos_id is None:  # run to the budget: an id no token reaches
            extra["eos_token_id"] = []
        with torch.no_grad():
            out = self.model.generate(
                torch.tensor([ids]), max_new_tokens=max_new_tokens, min_new_tokens=0, do_sample=False,
                pad_token_id=eos_id if eos_id is not None else 0, **extra,
            )
        return out[0, len(ids):].tolist()

    def time_decode(self, ids: list[int], max_new_tokens: int, eos_id: int | None, lookup: int,
                    repeats: int, assisted: bool = False) -> dict:
        """{"tokens", "decode_s", "end_to_end_s"}: medians of `repeats` runs minus a 1-token run."""
        self.generate(ids, 1, eos_id, lookup, assisted)  # warm-up
        first = _median_seconds(lambda: self.generate(ids, 1, eos_id, lookup, assisted), 1)
        tokens: list[int] = []

        def run():
            tokens[:] = self.generate(ids, max_new_tokens, eos_id, lookup, assisted)

        total = _median_seconds(run, repeats)
        return {"tokens": list(tokens), "decode_s": max(total - first, 1e-9), "end_to_end_s": total}


def _checkpoint(model_name: str) -> tuple[pathlib.Path, dict]:
    """(folder, from_pretrained kwargs) of a model name or path."""
    from specdec_jax.models.fetch import MODEL_FILES, model_gguf

    if model_name in MODEL_FILES:
        path = model_gguf(model_name)
    else:
        path = pathlib.Path(model_name)
    if path.suffix == ".gguf":
        return path.parent, {"gguf_file": path.name}
    if path.is_dir():
        return path, {}
    raise ValueError(f"--peer hf cannot load {model_name!r}: use {', '.join(MODEL_FILES)}, a .gguf file or a model directory")


def _median_seconds(fn, repeats: int) -> float:
    times = []
    for _ in range(max(repeats, 1)):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)
