"""Byte-level tokenizer: token id = UTF-8 byte, so any text round-trips with no vocab file."""

from __future__ import annotations

from collections.abc import Iterable


class ByteTokenizer:
    """UTF-8 bytes as token ids (vocabulary 256). Decoding replaces invalid byte runs.

    Example:
        >>> tok = ByteTokenizer()
        >>> tok.encode("hé")
        [104, 195, 169]
        >>> tok.decode([104, 195, 169])
        'hé'
    """

    vocab_size = 256

    def encode(self, text: str) -> list[int]:
        """Return the UTF-8 bytes of ``text`` as a list of ints in [0, 256)."""
        if not isinstance(text, str):
            raise ValueError(f"text must be a str, got {type(text).__name__}")
        return list(text.encode("utf-8"))

    def decode(self, ids: Iterable[int]) -> str:
        """Turn ids back into text; ids that are not whole UTF-8 sequences become U+FFFD.

        Ids outside [0, 256) (a model with a larger vocabulary sampled them) raise ValueError.
        """
        ids = [int(i) for i in ids]
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise ValueError(f"ids must be in [0, {self.vocab_size}), got {bad[:5]}")
        return bytes(ids).decode("utf-8", errors="replace")
