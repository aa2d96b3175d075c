"""``N``: no feed-forward half. A block of this kind is its mixer alone (no FFN norm, no
FFN): how Nemotron-H's two Mamba layers in a row, each a block of its own, map onto hyla's
mixer-then-FFN blocks."""

from __future__ import annotations

import torch

from hyla.model.ffn.base import FFN, register_ffn


@register_ffn("N")
class NoFFN(FFN):
    """The block adds nothing after its mixer; :class:`~hyla.model.model.Block` builds no
    FFN norm for it (``present`` is False) and skips the half.

    Example:
        >>> from hyla.model.config import preset
        >>> NoFFN.present, NoFFN.parameters_count(preset("debug"))
        (False, 0)
    """

    kind = "none"
    present = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(x)

    @classmethod
    def parameters_count(cls, cfg) -> int:
        return 0

    @classmethod
    def active_parameters(cls, cfg) -> int:
        return 0
