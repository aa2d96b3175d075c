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
        for block in self.lm.blocks:   # the model's own block loop runs, each mixer wrapped
            block.mixer = ConvBeforeMixer(nn.Conv1d(d, d, kernel, groups=d, bias=True),
                                          block.mixer)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.lm(input_ids)


class ConvBeforeMixer(nn.Module):
    """A mixer that reads a causal depthwise convolution of its input (training form)."""

    def __init__(self, conv: nn.Conv1d, mixer: nn.Module):
        super().__init__()
        self.conv, self.mixer = conv, mixer

    def forward(self, x: torch.Tensor, ctx) -> torch.Tensor:
        if ctx.mode != "train":
            raise ValueError("ShortConvLM is a training-only model: it keeps no conv state")
        # Left padding keeps it causal: output t sees inputs t-kernel+1 .. t.
        pad = self.conv.kernel_size[0] - 1
        h = self.conv(F.pad(x.transpose(1, 2), (pad, 0))).transpose(1, 2)
        return self.mixer(h, ctx)


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
