"""The two objectives of ``hyla distill`` (see :mod:`hyla.train.distill`).

- :class:`AttentionTransfer` (stage 1): each student layer that differs from the teacher
  reproduces that teacher layer on the teacher's own hidden states; the layers are trained
  independently (each backward reaches one layer, each layer's gradient is clipped alone).
- :class:`VocabularyKL` (stage 2): KL(teacher || student) over the vocabulary, in token
  chunks, plus the next-token cross-entropy.
"""

from __future__ import annotations

import torch
from torch import nn

from hyla.model import Context, HylaLM
from hyla.train.distill.losses import chunked_vocab_kl, final_hidden, layer_transfer_loss
from hyla.train.objectives import Batch, LossObjective


class AttentionTransfer:
    """Stage 1: per-layer attention transfer from a frozen teacher.

    The teacher runs once over the batch (hooks keep each transferred layer's mixer input and
    output); then at every layer in ``transfer`` the student's mixer is scored against the
    teacher's on that input (normalised output MSE, plus StreamKL on the attention
    distributions for compressed attention layers) and backpropagated at once, so only one
    layer's graph lives at a time and long sequences fit.

    Args:
        teacher: the all-attention HylaLM (frozen).
        student: the HylaLM whose ``transfer`` layers train.
        transfer: indices of the layers to train.
        kl_weight: weight of the attention KL (compressed attention layers).

    Example:
        >>> import dataclasses
        >>> from hyla.model import preset
        >>> from hyla.train.distill.student import build_student
        >>> cfg = dataclasses.replace(preset("debug"), layers="AA")
        >>> teacher = HylaLM(cfg).requires_grad_(False)
        >>> objective = AttentionTransfer(teacher, build_student(teacher, "GA"), [0])
        >>> ids = torch.randint(0, 256, (1, 16))
        >>> sorted(objective.backward((ids, ids, torch.tensor([0, 16])))["layers"]["0"])
        ['loss', 'mse']
    """

    def __init__(self, teacher: HylaLM, student: HylaLM, transfer: list[int], *,
                 kl_weight: float = 1.0):
        self.teacher, self.student, self.kl_weight = teacher, student, kl_weight
        self.transfer = list(transfer)

    def backward(self, batch: Batch, accum: int = 1) -> dict:
        """Backpropagate every transferred layer's loss; metrics: the mean layer loss and each
        layer's parts (``{"loss", "layers": {"<i>": {"loss", "mse"[, "kl"]}}}``)."""
        if accum != 1:
            raise ValueError(f"attention transfer takes one micro-batch a step, got accum={accum}")
        ids, _, cu = batch
        ctx = Context.train(ids, cu)
        # One teacher forward; hooks keep what enters and leaves each transferred mixer.
        seen: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        hooks = [self.teacher.blocks[i].mixer.register_forward_hook(
            lambda _m, args, out, i=i: seen.__setitem__(i, (args[0], out)))
            for i in self.transfer]
        try:
            with torch.no_grad():
                self.teacher(ids, ctx, hidden=True)
        finally:
            for hook in hooks:
                hook.remove()
        layers = {}
        for i in self.transfer:
            h, y_t = seen.pop(i)
            loss, parts = layer_transfer_loss(self.teacher.blocks[i].mixer,
                                              self.student.blocks[i].mixer, h, ctx.positions,
                                              ctx.cu_seqlens, kl_weight=self.kl_weight,
                                              y_teacher=y_t)
            loss.backward()
            layers[str(i)] = {"loss": loss.item(), **parts}
        return {"loss": sum(v["loss"] for v in layers.values()) / len(layers), "layers": layers}

    def clip_groups(self) -> list[list[nn.Parameter]]:
        # one group a layer: the layers stay independent
        return [list(self.student.blocks[i].mixer.parameters()) for i in self.transfer]


def new_parameters(mixer: nn.Module) -> list[nn.Parameter]:
    """What attention transfer trains in a student mixer: what it did not take from the
    teacher (``mixer.new_parameters()``, for linearised attention), else all of it."""
    own = getattr(mixer, "new_parameters", None)
    return list(own()) if own is not None else list(mixer.parameters())


def autocast_dtype(setting: str, device: torch.device) -> torch.dtype | None:
    """bf16 under ``"bf16"``, or under ``"auto"`` where this device's bf16 matmuls are fast
    (:func:`hyla.ops.hardware.fast_low_precision_matmul`); None (fp32) otherwise."""
    from hyla.ops.hardware import fast_low_precision_matmul

    if setting == "bf16" or (setting == "auto"
                             and fast_low_precision_matmul(torch.bfloat16, device)):
        return torch.bfloat16
    return None


class Autocast:
    """An objective whose forward passes run under ``torch.autocast`` (weights, optimizer
    states and the vocabulary KL stay float32)."""

    def __init__(self, objective, dtype: torch.dtype):
        self.objective, self.dtype = objective, dtype

    def backward(self, batch: Batch, accum: int = 1) -> dict:
        device = batch[0].device.type
        with torch.autocast(device_type=device, dtype=self.dtype):
            return self.objective.backward(batch, accum)

    def clip_groups(self):
        return self.objective.clip_groups()


class VocabularyKL(LossObjective):
    """Stage 2: ``kl_weight * KL(teacher || student) + ce_weight * CE`` over the vocabulary,
    ``chunk`` tokens at a time (:func:`~hyla.train.distill.losses.chunked_vocab_kl`).

    Metrics: ``loss``, ``kl`` and ``ce``.

    Example:
        >>> from hyla.model import preset
        >>> teacher = HylaLM(preset("debug")).requires_grad_(False)
        >>> objective = VocabularyKL(HylaLM(preset("debug")), teacher, chunk=8)
        >>> ids = torch.randint(0, 256, (1, 16))
        >>> sorted(objective.backward((ids, ids, torch.tensor([0, 16]))))
        ['ce', 'kl', 'loss']
    """

    def __init__(self, student: HylaLM, teacher: HylaLM, *, kl_weight: float = 1.0,
                 ce_weight: float = 1.0, chunk: int = 1024, temperature: float = 1.0):
        self.model, self.teacher = student, teacher
        self.kw = {"kl_weight": kl_weight, "ce_weight": ce_weight, "chunk": chunk,
                   "temperature": temperature}

    def loss(self, batch: Batch) -> tuple[torch.Tensor, dict]:
        ids, labels, cu = batch
        with torch.no_grad():
            h_t = final_hidden(self.teacher, ids, cu)
        h_s = final_hidden(self.model, ids, cu)
        loss, kl, ce = chunked_vocab_kl(h_s.flatten(0, 1), self.model.lm_head.weight,
                                        h_t.flatten(0, 1), self.teacher.lm_head.weight,
                                        labels.flatten(), **self.kw)
        return loss, {"kl": kl.item(), "ce": ce.item()}
