"""Training objectives: what one micro-batch costs. The loop (:mod:`hyla.train.loop`) does the
rest (steps, accumulation, clipping, schedules, logging, checkpoints).

An objective holds the models it needs (a student, a frozen teacher) and answers two questions:

- ``backward(batch, accum) -> metrics``: compute the loss of one micro-batch ``(input_ids
  [1, N], labels [1, N], cu_seqlens)``, backpropagate ``loss / accum`` and return the metrics
  of this micro-batch (floats, ``"loss"`` among them, already divided by ``accum``: the loop
  sums them over the step's micro-batches). Most objectives only define ``loss(batch) ->
  (loss, metrics)`` and inherit this; one whose parts train independently
  (:class:`~hyla.train.distill.objectives.AttentionTransfer`) backpropagates each part alone.
- ``clip_groups() -> [[params], ...]``: the parameter groups whose gradient norm is clipped
  each on its own (usually one group: everything trained).
"""

from __future__ import annotations

import contextlib
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from hyla.data.packing import corpus_blocks
from hyla.model import HylaLM
from hyla.train.batches import next_batch

Batch = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # input_ids, labels, cu_seqlens


class Objective(Protocol):
    """What the training loop needs from an objective (see the module docstring)."""

    def backward(self, batch: Batch, accum: int = 1) -> dict: ...

    def clip_groups(self) -> list[list[nn.Parameter]]: ...


class LossObjective:
    """Base of the objectives that are one differentiable loss a micro-batch.

    Subclasses set ``self.model`` (what trains) and define ``loss(batch) -> (loss tensor,
    {name: float})``.
    """

    model: nn.Module

    def loss(self, batch: Batch) -> tuple[torch.Tensor, dict]:
        raise NotImplementedError

    def backward(self, batch: Batch, accum: int = 1) -> dict:
        loss, metrics = self.loss(batch)
        loss = loss / accum
        loss.backward()
        return {"loss": loss.item(), **{k: v / accum for k, v in metrics.items()}}

    def clip_groups(self) -> list[list[nn.Parameter]]:
        return [list(self.model.parameters())]


def lm_loss(model: HylaLM, ids, labels, cu, precision: str = "fp32") -> torch.Tensor:
    """Mean next-token cross-entropy over the labelled positions (-100: not scored).

    Example:
        >>> from hyla.model import preset
        >>> ids = torch.randint(0, 256, (1, 8))
        >>> lm_loss(HylaLM(preset("debug")), ids, ids, None).item() > 0
        True
    """
    autocast = (torch.autocast(ids.device.type, dtype=torch.bfloat16) if precision == "bf16"
                else contextlib.nullcontext())
    with autocast:
        logits = model(ids, cu_seqlens=cu)
    return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=-100)


class LanguageModelling(LossObjective):
    """Next-token cross-entropy of ``model`` (``hyla train``).

    Args:
        model: the HylaLM being trained (put in training mode at every micro-batch).
        precision: "fp32", or "bf16" (autocast).
        offload_activations: keep the tensors saved for backward in (pinned) CPU memory.

    Example:
        >>> from hyla.model import preset
        >>> objective = LanguageModelling(HylaLM(preset("debug")))
        >>> ids = torch.randint(0, 256, (1, 16))
        >>> batch = (ids, ids, torch.tensor([0, 9, 16]))
        >>> sorted(objective.backward(batch, accum=2))
        ['loss']
    """

    def __init__(self, model: HylaLM, *, precision: str = "fp32",
                 offload_activations: bool = False):
        self.model, self.precision, self.offload = model, precision, offload_activations

    def loss(self, batch: Batch) -> tuple[torch.Tensor, dict]:
        self.model.train()
        offload = (torch.autograd.graph.save_on_cpu(pin_memory=torch.cuda.is_available())
                   if self.offload else contextlib.nullcontext())
        with offload:
            return lm_loss(self.model, *batch, self.precision), {}


@torch.no_grad()
def validation_loss(model: HylaLM, tokenizer, cfg) -> float:
    """Mean loss over the first ``cfg.eval_batches`` micro-batches of ``cfg.batch_size`` blocks
    of ``cfg.seq_len`` tokens from the validation split (the same blocks every time).

    Example:
        >>> from hyla.data.tokenizer import ByteTokenizer
        >>> from hyla.model import preset
        >>> from hyla.train.config import TrainConfig
        >>> cfg = TrainConfig(seq_len=16, batch_size=1, eval_batches=1)
        >>> validation_loss(HylaLM(preset("debug")), ByteTokenizer(), cfg) > 0
        True
    """
    was_training = model.training
    model.eval()
    blocks = corpus_blocks(cfg.data, tokenizer, cfg.seq_len, split="validation", seed=0)
    device = next(model.parameters()).device
    losses = [lm_loss(model, *(t.to(device) for t in next_batch(blocks, cfg.batch_size)),
                      cfg.precision).item() for _ in range(cfg.eval_batches)]
    model.train(was_training)
    return sum(losses) / len(losses)
