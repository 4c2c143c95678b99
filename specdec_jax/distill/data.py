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
    features  f16[N,S,L,H] or None: the target's hidden states of L layers at each position

:func:`build_feature_dataset` (EAGLE and Medusa heads) runs teacher-forced
target passes instead, which are prefill-shaped: over the prompt (and, with
`answers`, the target's greedy answer, decoded once), it stores the features
of `feature_layers` and the top-k law at every position; `weight` is 1 wherever
a next token exists.
"""

from __future__ import annotations

import pathlib
import zipfile
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from specdec_jax import engine
from specdec_jax.distill.config import TrainConfig
from specdec_jax.files import replacing
from specdec_jax.runner import encode


class Dataset(NamedTuple):
    tokens: np.ndarray
    top_ids: np.ndarray
    top_logp: np.ndarray
    weight: np.ndarray
    features: np.ndarray | None = None

    def save(self, path: pathlib.Path) -> None:
        """Written atomically (`files.replacing`): a kill leaves no half file under ``path``."""
        with replacing(path) as tmp, open(tmp, "wb") as f:
            np.savez(f, **{k: v for k, v in self._asdict().items() if v is not None})

    @classmethod
    def load(cls, path: pathlib.Path) -> Dataset:
        """A saved dataset; an unreadable or incomplete file is a ValueError naming it."""
        try:
            with np.load(path) as f:
                return cls(**{name: f[name] for name in cls._fields if name in f.files})
        except (OSError, ValueError, KeyError, TypeError, zipfile.BadZipFile, EOFError) as err:
            raise ValueError(f"{path}: unreadable ({err.__class__.__name__}: {err})") from None

    @classmethod
    def concatenate(cls, parts: list[Dataset]) -> Dataset:
        return cls(*[None if parts[0][i] is None else np.concatenate([p[i] for p in parts]) for i in range(len(cls._fields))])

    def batch(self, index: np.ndarray) -> dict:
        """{field: array[index]} of the fields present."""
        return {name: value[index] for name, value in self._asdict().items() if value is not None}

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


def encoded_prompts(target, tc: TrainConfig, records: list[dict]) -> list[list[int]]:
    """Token ids of the records' prompts (in the chat template; at most max_prompt_tokens long) or
    texts (`"text"`, sent raw, any length: only their last seq_len tokens are used), shortest first."""
    tok, limit = target.tokenizer, tc.max_prompt_tokens
    texts = [tok.encode(r["text"]) for r in records if "text" in r]
    prompts = [encode(tok, r["prompt"], raw=False) for r in records if "text" not in r]
    encoded = sorted(texts + [p for p in prompts if not limit or len(p) <= limit], key=len)
    if not encoded:
        raise ValueError(f"no prompt of at most max_prompt_tokens = {limit} tokens")
    return encoded


def build_dataset(target, tc: TrainConfig, records: list[dict], progress: bool = True) -> Dataset:
    """Greedy answers of `target` to `records` with its top-k law, cut into training windows."""
    tok = target.tokenizer
    encoded = encoded_prompts(target, tc, records)  # similar lengths batch well
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


def build_feature_dataset(target, tc: TrainConfig, records: list[dict], layers: tuple[int, ...],
                          progress: bool = True, answers: bool | None = None) -> Dataset:
    """Teacher-forced target passes over each prompt (+ the target's greedy answer with `answers`,
    default tc.answers): features of target `layers` and the top-k law at every position of the
    last seq_len tokens."""
    encoded = encoded_prompts(target, tc, records)
    if tc.answers if answers is None else answers:
        answers = []
        for start in tqdm(range(0, len(encoded), tc.gen_batch_size), desc="target answers", unit="batch",
                          disable=not progress):
            chunk = encoded[start : start + tc.gen_batch_size]
            answers += engine.generate(target, chunk, None, gamma=0, max_new_tokens=tc.gen_max_new_tokens,
                                       stop_ids=target.tokenizer.stop_ids).tokens
        encoded = [p + a for p, a in zip(encoded, answers)]
    width, k = tc.seq_len, tc.teacher_top_k
    model, params = target.as_target()
    tokens = np.zeros((len(encoded), width), np.int32)
    lengths = np.zeros(len(encoded), np.int32)
    for i, sequence in enumerate(encoded):
        window = sequence[-width:]
        tokens[i, : len(window)], lengths[i] = window, len(window)
    teacher = _teacher_pass(model, layers, k)
    features = np.zeros((len(encoded), width, len(layers), model.hidden_size), np.float16)
    top_ids = np.zeros((len(encoded), width, k), np.int32)
    top_logp = np.zeros((len(encoded), width, k), np.float32)
    for start in tqdm(range(0, len(encoded), tc.gen_batch_size), desc="teacher-forced features", unit="batch",
                      disable=not progress):
        stop = min(start + tc.gen_batch_size, len(encoded))
        rows = np.zeros((tc.gen_batch_size, width), np.int32)  # one compiled shape
        rows[: stop - start] = tokens[start:stop]
        f, ids, logp = jax.device_get(teacher(params, rows))
        features[start:stop], top_ids[start:stop], top_logp[start:stop] = f[: stop - start], ids[: stop - start], \
            logp[: stop - start]
    weight = (np.arange(width)[None, :] < lengths[:, None] - 1).astype(np.float32)  # a next token exists
    return Dataset(tokens, top_ids, top_logp, weight, features)


def _teacher_pass(model, layers: tuple[int, ...], k: int):
    """jitted (params, tokens i32[B,S]) -> (features f16[B,S,L,H], top ids i32[B,S,k], top log-probs f32[B,S,k])."""
    def run(params, tokens):
        batch, width = tokens.shape
        positions = jnp.broadcast_to(jnp.arange(width, dtype=jnp.int32)[None, :], (batch, width))
        logits, hidden, _ = model.apply(params, tokens, model.init_cache(batch, width), positions, None, layers)
        logp, ids = jax.lax.top_k(jax.nn.log_softmax(logits, axis=-1), k)
        return hidden.transpose(1, 2, 0, 3).astype(jnp.float16), ids, logp

    return jax.jit(run)


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
