"""Which parameters each optimizer gets.

Muon orthogonalises updates, which only means something for the 2-D weight matrices of hidden
layers. Embeddings and the output head are lookup tables and a classifier (their rows are
independent), and norms, biases and other non-2-D parameters have no matrix structure: AdamW
takes all of those, as in the Muon paper and Moonlight.
"""

from __future__ import annotations

import torch

from hyla.ops.hardware import fast_low_precision_matmul
from hyla.train.config import TrainConfig


def split_parameters(model: torch.nn.Module) -> tuple[list, list]:
    """(Muon parameters, AdamW parameters) of a HylaLM.

    Example:
        >>> from hyla.model import HylaLM, preset
        >>> muon, adamw = split_parameters(HylaLM(preset("debug")))
        >>> all(p.ndim == 2 for p in muon), any(p.ndim == 1 for p in adamw)
        (True, True)
    """
    muon, adamw, seen = [], [], set()
    for name, p in model.named_parameters():
        if id(p) in seen or not p.requires_grad:
            continue
        seen.add(id(p))
        hidden = not (name.startswith("embed.") or name.startswith("lm_head."))
        (muon if p.ndim == 2 and hidden else adamw).append(p)
    return muon, adamw


def build_optimizers(model: torch.nn.Module, cfg: TrainConfig) -> list[torch.optim.Optimizer]:
    """Muon + AdamW (``cfg.optimizer == "muon"``), or AdamW for everything."""
    muon_params, adamw_params = split_parameters(model)
    if cfg.optimizer == "adamw":
        adamw_params, muon_params = muon_params + adamw_params, []
    optimizers: list[torch.optim.Optimizer] = [
        torch.optim.AdamW(adamw_params, lr=cfg.lr, betas=(0.9, 0.95),
                          weight_decay=cfg.weight_decay)]
    if muon_params:
        from hyla.train.muon import Muon

        device = muon_params[0].device
        # Newton-Schulz in bf16 where the hardware has bf16 GEMMs; emulated bf16 costs 100x.
        ns_dtype = (torch.bfloat16 if fast_low_precision_matmul(torch.bfloat16, device)
                    else torch.float32)
        optimizers.append(Muon(muon_params, lr=cfg.muon_lr, weight_decay=cfg.weight_decay,
                               ns_dtype=ns_dtype))
    return optimizers
