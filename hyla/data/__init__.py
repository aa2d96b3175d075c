"""Data: tokenizers (byte-level now, BPE later), corpus readers, packing."""

from hyla.data.tokenizer import ByteTokenizer

__all__ = ["ByteTokenizer"]
