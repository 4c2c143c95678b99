"""Distillation data: the target's own greedy answers to training prompts, with its law at every answer token.

Prompts are split by question id (:func:`split_questions`): a held-out question
never contributes training data, so acceptance measured on it is honest. Every
turn of a training question is a training prompt.

:func:`build_dataset` runs the engine's plain decoding with `record_top_k` (the
target's top-k log-probs are a by-product of decoding: no extra teacher pass) and
cuts each prompt + answer into one training window of `seq_len` tokens, the last
ones. Arrays of a :class:`Dataset` (N windows, S = seq_len, k = teacher_top_k)::

    tokens    i32[N,S]   window tokens, right-padded with 0
    top_ids   i32[N,S,k] target's top-k ids for the token after position s
    top_logp  f32[N,S,k] their log-probs (temperature 1)
    weight    f32[N,S]   1 where the token after position s is an answer token, else 0
"""

from __future__ import annotations

import pathlib
from typing import NamedTuple

import numpy as np
from tqdm import tqdm

from specdec_jax import engine
from specdec_jax.distill.config import TrainConfig
from specdec_jax.runner import encode


class Dataset(NamedTuple):
    tokens: np.ndarray
    top_ids: np.ndarray
    top_logp: np.ndarray
    weight: np.ndarray

    def save(self, path: pathlib.Path) -> None:
        np.savez(path, **self._asdict())

    @classmethod
    def load(cls, path: pathlib.Path) -> Dataset:
        with np.load(path) as f:
            return cls(**{name: f[name] for name in cls._fields})

    def __len__(self) -> int:
        return self.tokens.shape[0]


def split_questions(questions: list[dict], per_category: int) -> tuple[list[dict], list[dict]]:
    """(train, held-out) questions: the `per_category` highest question ids of each category are
    held out (5 of the 10 questions of an MT-bench category, 5 of 80 of the others)."""
    by_category: dict[str, list[int]] = {}
    for q in questions:
        by_category.setdefault(q.get("category", ""), []).append(int(q["question_id"]))
    held = {i for ids in by_category.values() for i in sorted(ids)[-per_category:]}
    return ([q for q in questions if int(q["question_id"]) not in held],
            [q for q in questions if int(q["question_id"]) in held])


def training_prompts(train: list[dict], limit: int = 0) -> list[dict]:
    """[{"id", "prompt"}]: every turn of every training question (the first `limit`; 0 = all)."""
    records = [{"id": f"{q['question_id']}-{i}", "prompt": turn}
               for q in train for i, turn in enumerate(q["turns"])]
    return records[:limit] if limit else records


def build_dataset(target, tc: TrainConfig, records: list[dict], progress: bool = True) -> Dataset:
    """Greedy answers of `target` to `records` with its top-k law, cut into training windows."""
    tok = target.tokenizer
    encoded = sorted((encode(tok, r["prompt"], raw=False) for r in records), key=len)  # similar lengths batch well
    if tc.max_prompt_tokens:
        encoded = [p for p in encoded if len(p) <= tc.max_prompt_tokens]
    if not encoded:
        raise ValueError(f"no prompt of at most max_prompt_tokens = {tc.max_prompt_tokens} tokens")
    k, width = tc.teacher_top_k, tc.seq_len
    tokens = np.zeros((len(encoded), width), np.int32)
    top_ids = np.zeros((len(encoded), width, k), np.int32)
    top_logp = np.zeros((len(encoded), width, k), np.float32)
    weight = np.zeros((len(encoded), width), np.float32)
    batches = range(0, len(encoded), tc.gen_batch_size)
    for start in tqdm(batches, desc="target answers", unit="batch", disable=not progress):
        chunk = encoded[start : start + tc.gen_batch_size]
        out = engine.generate(target, chunk, None, gamma=0, max_new_tokens=tc.gen_max_new_tokens,
                              stop_ids=tok.stop_ids, record_top_k=k)
        for row, (prompt, answer, (ids, logp)) in enumerate(zip(chunk, out.tokens, out.target_top)):
            i = start + row
            sequence = np.asarray(prompt + answer, np.int32)
            first = max(0, len(sequence) - width)  # window = sequence[first:]
            n = len(sequence) - first
            tokens[i, :n] = sequence[first:]
            # The law of answer token j (sequence index len(prompt) + j) sits at window position
            # len(prompt) + j - 1 - first: the position of the token before it.
            pos = len(prompt) - 1 - first + np.arange(len(answer))
            keep = pos >= 0
            top_ids[i, pos[keep]] = ids[keep]
            top_logp[i, pos[keep]] = logp[keep]
            weight[i, pos[keep]] = 1.0
    return Dataset(tokens, top_ids, top_logp, weight)


def batch_indices(num_examples: int, batch_size: int, step: int, seed: int) -> np.ndarray:
    """Example indices of training step `step`: epochs are seeded permutations, so a run resumed
    at any step reads exactly the batches an uninterrupted run would."""
    per_epoch = max(1, num_examples // batch_size)
    epoch, index = divmod(step, per_epoch)
    order = np.random.default_rng([seed, epoch]).permutation(num_examples)
    return order[index * batch_size : (index + 1) * batch_size]


def vocab_by_frequency(dataset: Dataset, size: int, vocab_size: int, always: list[int]) -> np.ndarray:
    """i32[size], sorted: `always` (e.g. EOS), then the ids with the most probability mass in the
    teacher's top-k at answer positions (ties by id). The draft's reduced output vocabulary."""
    mass = np.zeros(vocab_size, np.float64)
    w = np.exp(dataset.top_logp) * dataset.weight[..., None]
    np.add.at(mass, dataset.top_ids.ravel(), w.ravel())
    mass[list(always)] = np.inf
    order = np.lexsort((np.arange(len(mass)), -mass))
    return np.sort(order[:size]).astype(np.int32)
