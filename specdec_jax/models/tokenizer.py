"""Byte-level tokenizer for the random test models.

The interface (``encode``, ``decode``, ``bos_id``, ``eos_id``, ``vocab_size``) is
the one real tokenizers are wrapped to.
"""

from __future__ import annotations

from collections.abc import Iterable


class ByteTokenizer:
    """Ids 0..255 are UTF-8 bytes; 256 is BOS, 257 is EOS; vocab size 258."""

    bos_id: int = 256
    eos_id: int = 257
    vocab_size: int = 258

    def encode(self, text: str, *, add_bos: bool = False) -> list[int]:
        """The UTF-8 bytes of ``text``, optionally preceded by ``bos_id``."""
        return [self.bos_id] * add_bos + list(text.encode("utf-8"))

    def decode(self, ids: Iterable[int]) -> str:
        """Text of the byte ids; special ids are skipped, bad UTF-8 replaced."""
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")
