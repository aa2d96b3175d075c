"""Data: tokenizers (bytes, byte-level BPE), corpus readers, packing with document boundaries."""

from hyla.data.tokenizer import BPETokenizer, ByteTokenizer, load_tokenizer, train_bpe

__all__ = ["BPETokenizer", "ByteTokenizer", "load_tokenizer", "train_bpe"]
