"""What enters each mixer of a model on a batch: the teacher's hidden states that layer
ranking, calibration and the KL ranking read (one module, so they import no each other)."""

from __future__ import annotations

import torch

from hyla.model import Context, HylaLM


def mixer_inputs(teacher: HylaLM, ids: torch.Tensor, ctx: Context) -> dict[int, torch.Tensor]:
    """What enters each mixer of ``teacher`` on ``ids`` (its normed hidden states), by layer."""
    seen: dict[int, torch.Tensor] = {}
    hooks = [b.mixer.register_forward_hook(lambda _m, args, _o, i=i: seen.__setitem__(i, args[0]))
             for i, b in enumerate(teacher.blocks)]
    try:
        teacher(ids, ctx, hidden=True)
    finally:
        for hook in hooks:
            hook.remove()
    return seen
