"""The transformers peer of `specdec-jax bench --peer hf`: greedy and prompt-lookup decoding.

transformers (with torch, the optional `hf` extra: `pip install -e ".[hf]"`)
loads the same checkpoint as our target: the default model's GGUF, a `.gguf`
path, or a Hugging Face directory. It is timed the way bench times our engine:
each prompt's decode phase is the median of `repeats` generate calls minus the
time of a 1-token call (prefill and first token).
"""

from __future__ import annotations

import pathlib
import statistics
import time


class HFPeer:
    """transformers `generate` on the target's checkpoint, float32 on the CPU."""

    def __init__(self, model_name: str):
        try:
            import torch
            from transformers import AutoModelForCausalLM
        except ImportError as err:
            raise ValueError('--peer hf needs transformers and torch: pip install -e ".[hf]"') from err
        self.torch = torch
        folder, kwargs = _checkpoint(model_name)
        self.model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **kwargs).eval()

    def generate(self, ids: list[int], max_new_tokens: int, eos_id: int | None, lookup: int = 0) -> list[int]:
        """Greedy continuation of `ids`; with `lookup` > 0, prompt-lookup decoding proposing `lookup` tokens."""
        torch = self.torch
        extra = {"prompt_lookup_num_tokens": lookup} if lookup else {}
        if eos_id is None:  # run to the budget: an id no token reaches
            extra["eos_token_id"] = []
        with torch.no_grad():
            out = self.model.generate(
                torch.tensor([ids]), max_new_tokens=max_new_tokens, min_new_tokens=0, do_sample=False,
                pad_token_id=eos_id if eos_id is not None else 0, **extra,
            )
        return out[0, len(ids):].tolist()

    def time_decode(self, ids: list[int], max_new_tokens: int, eos_id: int | None, lookup: int,
                    repeats: int) -> dict:
        """{"tokens", "decode_s", "end_to_end_s"}: medians of `repeats` runs minus a 1-token run."""
        self.generate(ids, 1, eos_id, lookup)  # warm-up
        first = _median_seconds(lambda: self.generate(ids, 1, eos_id, lookup), 1)
        tokens: list[int] = []

        def run():
            tokens[:] = self.generate(ids, max_new_tokens, eos_id, lookup)

        total = _median_seconds(run, repeats)
        return {"tokens": list(tokens), "decode_s": max(total - first, 1e-9), "end_to_end_s": total}


def _checkpoint(model_name: str) -> tuple[pathlib.Path, dict]:
    """(folder, from_pretrained kwargs) of a model name or path."""
    if model_name == "smollm2-135m":
        from specdec_jax.models.fetch import smollm2_gguf

        path = smollm2_gguf()
    else:
        path = pathlib.Path(model_name)
    if path.suffix == ".gguf":
        return path.parent, {"gguf_file": path.name}
    if path.is_dir():
        return path, {}
    raise ValueError(f"--peer hf cannot load {model_name!r}: use smollm2-135m, a .gguf file or a model directory")


def _median_seconds(fn, repeats: int) -> float:
    times = []
    for _ in range(max(repeats, 1)):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)
