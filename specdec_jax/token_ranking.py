"""Which ids a reduced draft vocabulary keeps (`--draft-vocab N --draft-vocab-source S`).

A draft whose head covers only N of the vocabulary's ids reads fewer weights per step, but cannot
draft a target token outside them: a round's chain ends there. Which N ids to keep:

- ``ids``: the first N ids. A byte-level BPE vocabulary is numbered in merge order, so these are the
  tokens frequent in the tokenizer's own training text.
- a text source (``sharegpt``, a ``.jsonl`` file or a folder: the sources of a retrieval datastore,
  `datastore.source_texts`): the N ids most frequent in it under the model's tokenizer, as FR-Spec
  (Zhao et al., 2025, "FR-Spec: Accelerating Large-Vocabulary Language Models via Frequency-Ranked
  Speculative Sampling") and EAGLE-3's ``d2t`` keep them. On ShareGPT's 25.5 M tokens, the 32,768 most
  frequent Qwen2.5 ids miss 1.5% of the Qwen pair's held-out output tokens, the first 32,768 ids 4.5%
  (experiments/README.md, "What does a reduced draft vocabulary cost the pair in tokens per round?").

The ranking of every id is counted once per (tokenizer, source) and cached in
``$SPECDEC_CACHE/token_ranks/<key>.npz`` (`specdec_jax.cache`: one process counts, the others wait).
"""

from __future__ import annotations

import hashlib
import json
import pathlib
import zipfile

import numpy as np

from specdec_jax import cache
from specdec_jax.cache import cache_dir
from specdec_jax.datastore import encoded, source_fingerprint, source_texts

IDS = "ids"  # the first N ids: no text source
RANKING_VERSION = 1  # bump when the counting changes: cached rankings are counted again


def ranked_ids(source: str, tokenizer, vocab_size: int, progress: bool = True) -> np.ndarray:
    """i32[vocab_size]: every id, most frequent in ``source`` under ``tokenizer`` first; ties, and the ids
    its text never uses, in id order. ``source`` `IDS`: ``arange(vocab_size)``. Cached (module docstring)."""
    if source == IDS:
        return np.arange(vocab_size, dtype=np.int32)
    key = json.dumps({"version": RANKING_VERSION, "tokenizer": tokenizer.identity,
                      "source": source_fingerprint(source), "vocab_size": vocab_size})
    path = cache_dir() / "token_ranks" / f"{hashlib.sha256(key.encode()).hexdigest()[:20]}.npz"
    return cache.entry(path, f"the token ranking of {source}", lambda p: _read(p, key, vocab_size),
                       lambda tmp: _count(tmp, key, source, tokenizer, vocab_size, progress))


def _count(tmp: pathlib.Path, key: str, source: str, tokenizer, vocab_size: int, progress: bool) -> np.ndarray:
    """Counts every id of ``source``'s texts, writes the ranking to ``tmp`` (`cache.entry` publishes it)."""
    from tqdm import tqdm

    texts = source_texts(source, progress)
    counts = np.zeros(vocab_size, np.int64)
    with tqdm(total=len(texts), desc=f"counting the tokens of {source}", unit="doc", disable=not progress,
              leave=False, delay=0.5) as bar:
        for ids in encoded(tokenizer, texts, bar):
            ids = np.asarray(ids, np.int64)
            counts += np.bincount(ids[ids < vocab_size], minlength=vocab_size)
    if not counts.any():
        raise ValueError(f"the text source {source} holds no tokens: it cannot rank a draft vocabulary")
    ranked = np.lexsort((np.arange(vocab_size), -counts)).astype(np.int32)
    with open(tmp, "wb") as f:  # a file object: np.savez would append .npz to the partial's name
        np.savez(f, ranked=ranked, key=np.array(key))
    return ranked


def _read(path: pathlib.Path, key: str, vocab_size: int) -> np.ndarray | None:
    """The cached ranking, or None (with one line) when it is unreadable or not this key's."""
    try:
        with np.load(path, allow_pickle=False) as data:
            ranked, stored = data["ranked"], str(data["key"])
        if stored != key or ranked.shape != (vocab_size,) or ranked.dtype != np.int32:
            raise ValueError("it is not this ranking's")
        if not (np.bincount(ranked, minlength=vocab_size) == 1).all():
            raise ValueError("not a permutation of the ids")
    except (OSError, EOFError, ValueError, KeyError, zipfile.BadZipFile) as err:
        print(f"the cached token ranking {path} cannot be used ({str(err)[:120]}): counting again", flush=True)
        return None
    return ranked
