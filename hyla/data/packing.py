"""Pack documents into fixed-length training blocks that remember where documents start.

Each block is ``seq_len + 1`` consecutive tokens of the document stream (inputs are the first
``seq_len``, labels the last ``seq_len``); consecutive blocks of the stream overlap by one
token so no target is skipped. Within a block, ``cu_seqlens`` marks the documents, so the GLA
state resets and attention is masked at every boundary, and the label that would predict a
new document's first token from the previous document is -100.

Mixing happens at two levels. The documents of epoch e are visited in a permutation drawn
from ``seed + e`` (file-level: folders and the stdlib corpus; ``.jsonl`` keeps file order).
Then, with ``shuffle_buffer=N``, the blocks cut from that stream pass through a shuffle buffer
of N blocks (from many documents at once): each ``next`` tops the buffer up to N blocks and
hands out one drawn at random, so consecutive blocks are close to independent instead of
coming from one or two files. The draws are deterministic given the seed.

The position is a dict that a checkpoint stores: where the stream's next block starts
(epoch, document, token offset) and, with a buffer, the number of draws so far and the
buffered blocks themselves. A stream restored from it yields exactly the blocks the original
would have.
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

    Args:
        documents: a list (file paths or texts, shuffled per epoch when ``shuffle``) or a
            callable returning a fresh iterator of texts (read in order).
        tokenizer: has ``encode`` and ``eos_id`` (appended to every document when not None).
        seq_len: tokens a block.
        seed: the epochs' document orders and the buffer's draws derive from it.
        shuffle: permute the documents of every epoch.
        shuffle_buffer: blocks held in the shuffle buffer (0 or 1: none, stream order).
        position: a :meth:`position` to resume from.

    Example:
        >>> from hyla.data import ByteTokenizer
        >>> docs = lambda: iter(["abc", "defgh"])
        >>> blocks = PackedBlocks(docs, ByteTokenizer(), seq_len=4, shuffle=False)
        >>> b = next(blocks)
        >>> b["input_ids"].tolist(), b["labels"].tolist(), b["cu_seqlens"].tolist()
        ([97, 98, 99, 100], [98, 99, -100, 101], [0, 3, 4])
        >>> docs = ["a" * 40, "b" * 40, "c" * 40]   # three documents of ten blocks each
        >>> first = lambda blocks: "".join(chr(next(blocks)["input_ids"][0]) for _ in range(12))
        >>> first(PackedBlocks(docs, ByteTokenizer(), seq_len=4))    # file-level order only
        'aaaaaaaaaacc'
        >>> first(PackedBlocks(docs, ByteTokenizer(), seq_len=4, shuffle_buffer=16))
        'aacccaabaccb'
    """

    def __init__(self, documents: Callable[[], Iterator[str]] | list, tokenizer, seq_len: int,
                 *, seed: int = 0, shuffle: bool = True, shuffle_buffer: int = 0,
                 position: dict | None = None):
        if seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {seq_len}")
        if shuffle_buffer < 0:
            raise ValueError(f"shuffle_buffer must be >= 0, got {shuffle_buffer}")
        self.documents, self.tokenizer, self.seq_len = documents, tokenizer, seq_len
        self.seed, self.shuffle, self.shuffle_buffer = seed, shuffle, shuffle_buffer
        pos = _check_position(position, seq_len, shuffle_buffer) if position is not None \
            else {"epoch": 0, "doc": 0, "offset": 0}
        # The buffer: (ids [seq_len + 1] int64, document starts [seq_len + 1] bool) a block.
        self._buffer: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._drawn = pos.pop("drawn", 0)
        if "buffer_ids" in pos:
            ids, starts = pos.pop("buffer_ids"), pos.pop("buffer_starts")
            self._buffer = [(i.long(), s.bool()) for i, s in zip(ids, starts, strict=True)]
        self.pos = pos
        self._cache: list[tuple[int, int, list[int]]] = []  # tokenized docs from pos onward
        self._reader: tuple[int, int, Iterator[str]] | None = None  # epoch, next doc, source

    def position(self) -> dict:
        """Where the stream resumes: store it in a checkpoint, pass it back as ``position``.

        ``epoch``, ``doc``, ``offset``: the next block the stream cuts; with a shuffle buffer
        also ``drawn`` (blocks handed out so far) and ``buffer_ids`` / ``buffer_starts``
        ([n, seq_len + 1] int32 / bool tensors: the buffered blocks, in order).
        """
        pos = dict(self.pos)
        if self.shuffle_buffer > 1:
            L = self.seq_len + 1
            pos["drawn"] = self._drawn
            pos["buffer_ids"] = torch.stack([i for i, _ in self._buffer]).int() \
                if self._buffer else torch.zeros(0, L, dtype=torch.int32)
            pos["buffer_starts"] = torch.stack([s for _, s in self._buffer]) \
                if self._buffer else torch.zeros(0, L, dtype=torch.bool)
        return pos

    def __iter__(self) -> PackedBlocks:
        return self

    def __next__(self) -> dict:
        if self.shuffle_buffer > 1:
            while len(self._buffer) < self.shuffle_buffer:
                self._buffer.append(self._next_block())
            # One generator a draw, seeded by (seed, draw number): nothing to save but the count.
            i = random.Random(f"{self.seed}:{self._drawn}").randrange(len(self._buffer))
            self._buffer[i], self._buffer[-1] = self._buffer[-1], self._buffer[i]
            ids, starts = self._buffer.pop()
            self._drawn += 1
        else:
            ids, starts = self._next_block()
        labels = ids[1:].clone()
        labels[starts[1:]] = IGNORE
        cuts = starts[1:-1].nonzero().flatten().int() + 1
        cu = torch.cat([torch.tensor([0], dtype=torch.int32), cuts,
                        torch.tensor([self.seq_len], dtype=torch.int32)])
        return {"input_ids": ids[:-1], "labels": labels, "cu_seqlens": cu}

    def _next_block(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The stream's next ``seq_len + 1`` tokens and which of them start a document."""
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
        return torch.tensor(tokens), torch.tensor(starts)

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


def _check_position(position, seq_len: int, shuffle_buffer: int) -> dict:
    try:
        pos = {key: int(position[key]) for key in ("epoch", "doc", "offset")}
        pos["drawn"] = int(position.get("drawn", 0))
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise ValueError(f"position must be a dict with int epoch, doc and offset, got "
                         f"{position!r}") from e
    if min(pos.values()) < 0:
        raise ValueError(f"position values must be >= 0, got {position!r}")
    if "buffer_ids" in position:
        ids, starts = position["buffer_ids"], position.get("buffer_starts")
        shape = getattr(ids, "shape", None)
        if (not isinstance(ids, torch.Tensor) or not isinstance(starts, torch.Tensor)
                or ids.dim() != 2 or starts.shape != shape or shape[1] != seq_len + 1
                or shape[0] >= max(shuffle_buffer, 1)):
            raise ValueError(f"position's buffer_ids / buffer_starts must be two [n, "
                             f"{seq_len + 1}] tensors with n < shuffle_buffer "
                             f"({shuffle_buffer}), got {shape} / "
                             f"{getattr(starts, 'shape', None)}")
        pos["buffer_ids"], pos["buffer_starts"] = ids, starts
    return pos


def _text(item) -> str:
    # Lists hold file paths (read lazily, so a corpus is never in memory) or, in tests, texts.
    if isinstance(item, os.PathLike):
        with open(item, encoding="utf-8", errors="replace") as f:
            return f.read()
    return str(item)


def corpus_blocks(data, tokenizer, seq_len: int, *, split: str = "train", seed: int = 0,
                  shuffle_buffer: int = 0, position: dict | None = None) -> PackedBlocks:
    """Blocks from a data source (``None``: the stdlib corpus), shuffled by file for training
    and, with ``shuffle_buffer`` > 1, by block through a buffer of that many blocks."""
    files = list_documents(data, split)
    if files is not None:
        return PackedBlocks(files, tokenizer, seq_len, seed=seed, shuffle=split == "train",
                            shuffle_buffer=shuffle_buffer, position=position)
    return PackedBlocks(lambda: iter_documents(data, split), tokenizer, seq_len, seed=seed,
                        shuffle=False, shuffle_buffer=shuffle_buffer, position=position)
