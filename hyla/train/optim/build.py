"""The optimizers of a training run, from its TrainConfig."""

from __future__ import annotations

import torch

from hyla.ops.hardware import fast_low_precision_matmul
from hyla.train.config import TrainConfig
from hyla.train.optim.param_groups import build_optimizers


def run_optimizers(model: torch.nn.Module, cfg: TrainConfig) -> list[torch.optim.Optimizer]:
    """Muon (hidden matrices) + AdamW (the rest), or AdamW for everything.

    Example:
        >>> from hyla.model import HylaLM, preset
        >>> [type(o).__name__ for o in run_optimizers(HylaLM(preset("debug")), TrainConfig())]
        ['Muon', 'AdamW']
    """
    if cfg.optimizer == "adamw":
        return [torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.95),
                                  weight_decay=cfg.weight_decay)]
    device = next(model.parameters()).device
    # Newton-Schulz in bf16 where the hardware has bf16 GEMMs; emulated bf16 costs ~100x.
    ns_dtype = (torch.bfloat16 if fast_low_precision_matmul(torch.bfloat16, device)
                else torch.float32)
    return list(build_optimizers(model, lr_muon=cfg.muon_lr, lr_adamw=cfg.lr,
                                 weight_decay=cfg.weight_decay, ns_dtype=ns_dtype))
