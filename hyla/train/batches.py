"""Micro-batches for the training loop: packed blocks stacked into one varlen row."""

from __future__ import annotations

import torch


def stack_blocks(blocks: list[dict]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """B blocks -> one packed row (input_ids [1, B*T], labels [1, B*T], cu_seqlens).

    The model's varlen path takes one row; every block edge is a document edge, so the state
    never leaks from one block into the next.

    Example:
        >>> block = {"input_ids": torch.arange(4), "labels": torch.arange(4),
        ...          "cu_seqlens": torch.tensor([0, 3, 4])}
        >>> ids, labels, cu = stack_blocks([block, block])
        >>> ids.shape, cu.tolist()
        (torch.Size([1, 8]), [0, 3, 4, 7, 8])
    """
    T = blocks[0]["input_ids"].numel()
    ids = torch.cat([b["input_ids"] for b in blocks])[None]
    labels = torch.cat([b["labels"] for b in blocks])[None]
    cu = torch.cat([blocks[0]["cu_seqlens"][:1]]
                   + [b["cu_seqlens"][1:] + i * T for i, b in enumerate(blocks)])
    return ids, labels, cu


def next_batch(blocks, batch_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The next ``batch_size`` blocks of a block stream, stacked (see :func:`stack_blocks`)."""
    return stack_blocks([next(blocks) for _ in range(batch_size)])
