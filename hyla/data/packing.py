"""Pack documents into fixed-length training blocks that remember where documents start.

Each block is ``seq_len + 1`` consecutive tokens of the document stream (inputs are the first
``seq_len``, labels the last ``seq_len``); consecutive blocks overlap by one token so no
target is skipped. Within a block, ``cu_seqlens`` marks the documents, so the GLA state
resets and attention is masked at every boundary, and the label that would predict a new
document's first token from the previous document is -100.

The order is deterministic: the documents of epoch e are visited in a permutation drawn from
``seed + e`` (file-level: folders and the stdlib corpus; ``.jsonl`` keeps file order). The
position (epoch, document, token offset) is a small dict that a checkpoint stores, and a
stream restored from it yields exactly the blocks the original would have.
"""

from __future__ import annotations

import os
import random
from collections.abc import Callable, Iterator

import torch

from hyla.data.corpus import iter_documents, list_documents

IGNORE = -100


class PackedBlocks:
    """An endless, resumable iterator of packed blocks.

    Yields dicts with ``input_ids`` [seq_len], ``labels`` [seq_len] (-100 across document
    boundaries) and ``cu_seqlens`` [n_docs + 1] (int32 offsets into the block).

    Example:
        >>> from hyla.data import ByteTokenizer
        >>> docs = lambda: iter(["abc", "defgh"])
        >>> blocks = PackedBlocks(docs, ByteTokenizer(), seq_len=4, shuffle=False)
        >>> b = next(blocks)
        >>> b["input_ids"].tolist(), b["labels"].tolist(), b["cu_seqlens"].tolist()
        ([97, 98, 99, 100], [98, 99, -100, 101], [0, 3, 4])
    """

    def __init__(self, documents: Callable[[], Iterator[str]] | list, tokenizer, seq_len: int,
                 *, seed: int = 0, shuffle: bool = True, position: dict | None = None):
        if seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {seq_len}")
        self.documents, self.tokenizer, self.seq_len = documents, tokenizer, seq_len
        self.seed, self.shuffle = seed, shuffle
        self.pos = _check_position(position) if position is not None else \
            {"epoch": 0, "doc": 0, "offset": 0}
        self._cache: list[tuple[int, int, list[int]]] = []  # tokenized docs from pos onward
        self._reader: tuple[int, int, Iterator[str]] | None = None  # epoch, next doc, source

    def position(self) -> dict:
        """Where the next block starts: store it in a checkpoint, pass it back as ``position``."""
        return dict(self.pos)

    def __iter__(self) -> PackedBlocks:
        return self

    def __next__(self) -> dict:
        need = self.seq_len + 1
        tokens: list[int] = []
        starts: list[bool] = []
        offset, i = self.pos["offset"], 0
        while len(tokens) < need:
            while i >= len(self._cache):
                self._fetch()
            take = self._cache[i][2][offset: offset + need - len(tokens)]
            starts += [offset == 0] + [False] * (len(take) - 1)
            tokens += take
            i, offset = i + 1, 0
        self._advance(self.seq_len)
        ids = torch.tensor(tokens)
        labels = ids[1:].clone()
        labels[torch.tensor(starts[1:])] = IGNORE
        cuts = [t for t in range(1, self.seq_len) if starts[t]]
        cu = torch.tensor([0, *cuts, self.seq_len], dtype=torch.int32)
        return {"input_ids": ids[:-1], "labels": labels, "cu_seqlens": cu}

    def _advance(self, n: int) -> None:
        offset = self.pos["offset"] + n
        while self._cache and offset >= len(self._cache[0][2]):
            offset -= len(self._cache[0][2])
            self._cache.pop(0)
        if self._cache:
            epoch, doc, _ = self._cache[0]
        else:  # everything cached was consumed: the next block starts at the next document
            epoch, doc, _ = self._reader
            offset = 0
        self.pos = {"epoch": epoch, "doc": doc, "offset": offset}

    def _fetch(self) -> None:
        """Tokenize the next non-empty document into the cache, moving to the next epoch at
        the end of the corpus."""
        while True:
            if self._reader is None:
                source = self._epoch_documents(self.pos["epoch"])
                for _ in range(self.pos["doc"]):
                    if next(source, None) is None:
                        raise ValueError(f"position {self.pos} is past the end of the corpus")
                self._reader = (self.pos["epoch"], self.pos["doc"], source)
            epoch, doc, source = self._reader
            text = next(source, None)
            if text is None:
                if doc == 0:
                    raise ValueError("the corpus has no documents: expected at least one")
                self._reader = (epoch + 1, 0, self._epoch_documents(epoch + 1))
                continue
            self._reader = (epoch, doc + 1, source)
            ids = self.tokenizer.encode(text)
            if ids and self.tokenizer.eos_id is not None:
                ids.append(self.tokenizer.eos_id)
            if ids:
                self._cache.append((epoch, doc, ids))
                return

    def _epoch_documents(self, epoch: int) -> Iterator[str]:
        if callable(self.documents):
            return iter(self.documents())
        order = list(range(len(self.documents)))
        if self.shuffle:
            random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
        return (_text(self.documents[i]) for i in order)


def _check_position(position) -> dict:
    try:
        pos = {key: int(position[key]) for key in ("epoch", "doc", "offset")}
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"position must be a dict with int epoch, doc and offset, got "
                         f"{position!r}") from e
    if min(pos.values()) < 0:
        raise ValueError(f"position values must be >= 0, got {position!r}")
    return pos


def _text(item) -> str:
    # Lists hold file paths (read lazily, so a corpus is never in memory) or, in tests, texts.
    if isinstance(item, os.PathLike):
        with open(item, encoding="utf-8", errors="replace") as f:
            return f.read()
    return str(item)


def corpus_blocks(data, tokenizer, seq_len: int, *, split: str = "train", seed: int = 0,
                  position: dict | None = None) -> PackedBlocks:
    """Blocks from a data source (``None``: the stdlib corpus), shuffled by file for training."""
    files = list_documents(data, split)
    if files is not None:
        return PackedBlocks(files, tokenizer, seq_len, seed=seed, shuffle=split == "train",
                            position=position)
    return PackedBlocks(lambda: iter_documents(data, split), tokenizer, seq_len, seed=seed,
                        shuffle=False, position=position)
