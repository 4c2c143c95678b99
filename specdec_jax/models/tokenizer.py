"""Byte-level tokenizer for the random test models.

The interface (``encode``, ``decode``, ``bos_id``, ``eos_id``, ``stop_ids``,
``vocab_size``) is the one real tokenizers are wrapped to. ``stop_ids`` are the
model's end tokens (EOS, end of turn, ...); ``eos_id`` is the first of them.
"""

from __future__ import annotations

import functools
import hashlib
import json
import pathlib
from collections.abc import Iterable


class ByteTokenizer:
    """Ids 0..255 are UTF-8 bytes; 256 is BOS, 257 is EOS; vocab size 258."""

    bos_id: int = 256
    eos_id: int = 257
    stop_ids: tuple[int, ...] = (257,)
    vocab_size: int = 258

    @property
    def identity(self) -> str:
        """Names the tokenization: equal for two tokenizers that map text to the same ids."""
        return "bytes-258"

    def encode(self, text: str, *, add_bos: bool = False) -> list[int]:
        """The UTF-8 bytes of ``text``, optionally preceded by ``bos_id``."""
        return [self.bos_id] * add_bos + list(text.encode("utf-8"))

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """`encode` of each text."""
        return [self.encode(t) for t in texts]

    def decode(self, ids: Iterable[int]) -> str:
        """Text of the byte ids; special ids are skipped, bad UTF-8 replaced."""
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")


# How each `tokenizer.ggml.pre` splits text before byte-level BPE (llama.cpp's pre-tokenizer types; the
# patterns are those of the models' own Hugging Face tokenizers). None: GPT-2's split inside ByteLevel.
# Any other value is refused: another split of the text would give other ids, silently.
GPT2_SPLIT = None
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
               r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")  # digits one by one
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")  # digits in threes
GGUF_PRE_TOKENIZERS = {None: GPT2_SPLIT, "default": GPT2_SPLIT, "gpt2": GPT2_SPLIT, "smollm": GPT2_SPLIT,
                       "qwen2": QWEN2_SPLIT, "llama-bpe": LLAMA3_SPLIT, "llama3": LLAMA3_SPLIT}
CONTROL, USER_DEFINED = 3, 4  # tokenizer.ggml.token_type values of added tokens (special, and plain)


def gguf_pre_tokenizer(pre: str | None):
    """The `tokenizers` pre-tokenizer of GGUF `tokenizer.ggml.pre` value `pre` (ValueError if unknown)."""
    from tokenizers import Regex, pre_tokenizers

    if pre not in GGUF_PRE_TOKENIZERS:
        raise ValueError(f"GGUF pre-tokenizer {pre!r} is not supported ({', '.join(map(str, GGUF_PRE_TOKENIZERS))})")
    split = GGUF_PRE_TOKENIZERS[pre]
    if split is not None:
        return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(split), behavior="isolated"),
                                        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre == "smollm":  # llama.cpp's 'smollm' splits digits one by one before the GPT-2 regex
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    return byte_level


class BPETokenizer:
    """A `tokenizers.Tokenizer` plus the model's special ids and chat template.

    Built from GGUF metadata (`from_gguf_metadata`: byte-level BPE from vocab and
    merges) or a Hugging Face directory (`models.loading`: tokenizer.json).
    `stop_ids`: the model's end tokens, EOS first (`eos_id`).
    """

    def __init__(self, tokenizer, *, bos_id: int | None, stop_ids: tuple[int, ...], chat_template: str | None):
        self._tok = tokenizer
        self.bos_id = bos_id
        self.stop_ids = tuple(dict.fromkeys(int(i) for i in stop_ids))
        self.eos_id = self.stop_ids[0]
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
        self.chat_template = chat_template

    @property
    def backend(self):
        """The wrapped `tokenizers.Tokenizer` (its vocabulary and decoder, e.g. for grammar tables)."""
        return self._tok

    @property
    def identity(self) -> str:
        """Names the tokenization (sha256 of the serialized tokenizer and the stop ids)."""
        text = self._tok.to_str() + repr(self.stop_ids)
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    @classmethod
    def from_gguf_metadata(cls, meta: dict) -> BPETokenizer:
        from tokenizers import AddedToken, Tokenizer, decoders, models

        kind = meta.get("tokenizer.ggml.model")
        if kind != "gpt2":
            raise ValueError(f"GGUF tokenizer model {kind!r} is not supported (only byte-level BPE, 'gpt2')")
        pre_tokenizer = gguf_pre_tokenizer(meta.get("tokenizer.ggml.pre"))
        tokens = list(meta["tokenizer.ggml.tokens"])
        merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
        tok = Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges, ignore_merges=False))
        tok.pre_tokenizer = pre_tokenizer
        tok.decoder = decoders.ByteLevel()
        types = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
        # Control tokens (<|im_end|>) are special: matched whole, skipped when decoding; user-defined ones
        # (Qwen's <tool_call>) are matched whole and decoded as text.
        tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                for t, k in zip(tokens, types) if k == CONTROL])
        tok.add_tokens([AddedToken(t, special=False, normalized=False) for t, k in zip(tokens, types) if k == USER_DEFINED])
        ends = [meta.get(f"tokenizer.ggml.{kind}_token_id") for kind in ("eos", "eot", "eom")]
        if ends[0] is None:
            raise ValueError("GGUF metadata names no tokenizer.ggml.eos_token_id")
        return cls(
            tok,
            bos_id=meta.get("tokenizer.ggml.bos_token_id"),
            stop_ids=tuple(i for i in ends if i is not None),
            chat_template=meta.get("tokenizer.chat_template"),
        )

    def save(self, folder) -> None:
        """Writes Hugging Face style `tokenizer.json`, `tokenizer_config.json` (special tokens,
        chat template) and `generation_config.json` (`eos_token_id`: the stop ids) into `folder`."""
        folder = pathlib.Path(folder)
        (folder / "tokenizer.json").write_text(self._tok.to_str())
        config = {"bos_token": self._token_text(self.bos_id) or None, "eos_token": self._token_text(self.eos_id),
                  "chat_template": self.chat_template}
        (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=1))
        (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": list(self.stop_ids)}))

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`; special-token strings in it map to their ids."""
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """`encode` of each text (the library's threads)."""
        return [e.ids for e in self._tok.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: Iterable[int]) -> str:
        """Text of `ids`, special tokens skipped."""
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=True)

    def apply_chat_template(self, user_text: str | list[dict]) -> str:
        """The model's chat template around one user turn, with the assistant prompt opened; or
        around a whole conversation (a list of {"role", "content"} messages), closed."""
        if not self.chat_template:
            raise ValueError("this tokenizer has no chat template; send the text raw")
        template = _compiled_template(self.chat_template)
        one_turn = isinstance(user_text, str)
        return template.render(
            messages=[{"role": "user", "content": user_text}] if one_turn else user_text,
            add_generation_prompt=one_turn,
            bos_token=self._token_text(self.bos_id), eos_token=self._token_text(self.eos_id),
        )

    def _token_text(self, token_id: int | None) -> str:
        return "" if token_id is None else (self._tok.id_to_token(token_id) or "")


@functools.lru_cache(maxsize=8)
def _compiled_template(source: str):
    """A chat template compiled as transformers compiles it (sandboxed jinja2, trim_blocks and lstrip_blocks,
    loop controls, a `tojson` that leaves non-ASCII and HTML alone, `raise_exception`), so that both
    render the same text."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise ValueError(f"chat template: {message}")

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    return env.from_string(source)
