"""The MQAR models: a :class:`HylaLM`, optionally with a short convolution before each mixer.

Zoology puts a short causal depthwise convolution (kernel 4) in front of its sequence mixers:
it hands each position its previous few tokens, so a single mixer layer can bind a key to the
value after it instead of first learning a previous-token head (which plain two-layer models
learn only after a long plateau). ``short_conv=0`` is the plain :class:`HylaLM`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hyla.model import HylaConfig, HylaLM


class ShortConvLM(nn.Module):
    """``HylaLM`` whose mixers read ``conv(x)`` (causal depthwise conv over time).

    ``forward(input_ids [B, T]) -> logits [B, T, vocab]``; training only (no prefill/decode).
    The conv's state at decode time would be ``(kernel - 1) * d_model`` values a layer.

    Example:
        >>> from hyla.model.config import preset
        >>> m = ShortConvLM(preset("debug"), kernel=4)
        >>> m(torch.randint(0, 256, (2, 9))).shape
        torch.Size([2, 9, 256])
    """

    def __init__(self, cfg: HylaConfig, kernel: int = 4):
        super().__init__()
        if kernel < 2:
            raise ValueError(f"kernel must be >= 2, got {kernel}")
        self.cfg, self.kernel = cfg, kernel
        self.lm = HylaLM(cfg)
        d = cfg.d_model
        self.convs = nn.ModuleList(nn.Conv1d(d, d, kernel, groups=d, bias=True)
                                   for _ in cfg.layers)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [B, T], got {tuple(input_ids.shape)}")
        lm = self.lm
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        x = lm.embed(input_ids)
        for block, conv in zip(lm.blocks, self.convs, strict=True):
            h = block.mixer_norm(x)
            # Left padding keeps it causal: output t sees inputs t-kernel+1 .. t.
            h = conv(F.pad(h.transpose(1, 2), (self.kernel - 1, 0))).transpose(1, 2)
            x = x + (block.mixer(h) if block.kind == "gla" else block.mixer(h, positions))
            x = x + block.mlp(block.mlp_norm(x))
        return lm.lm_head(lm.norm(x))


def build_model(cfg: HylaConfig, short_conv: int = 0) -> nn.Module:
    """``HylaLM(cfg)``, or a :class:`ShortConvLM` with kernel ``short_conv`` when > 0.

    Example:
        >>> from hyla.model.config import preset
        >>> type(build_model(preset("debug"))).__name__
        'HylaLM'
    """
    if short_conv < 0:
        raise ValueError(f"short_conv must be >= 0 (0 = none), got {short_conv}")
    return ShortConvLM(cfg, short_conv) if short_conv else HylaLM(cfg)
