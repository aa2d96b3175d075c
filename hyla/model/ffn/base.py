"""The FFN protocol: one registry of feed-forward kinds, chosen per layer by the config.

The feed-forward half of a block gets the treatment the mixers have: a kind is a module
registered under a letter (``cfg.ffn_layers``, one letter a layer; ``"S"`` everywhere by
default), built from the layer's config, with options of its own in
``cfg.ffn_options[kind]``. Nothing outside this package knows how an FFN routes tokens.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import nn

from hyla.model.options import parse_options


class FFN(nn.Module):
    """Base class of the feed-forward kinds: ``forward(x [..., d_model]) -> [..., d_model]``.

    Example:
        >>> sorted(FFNS), FFNS["S"].kind
        (['E', 'N', 'R', 'S'], 'dense')
    """

    letter: ClassVar[str] = ""
    kind: ClassVar[str] = ""
    options_class: ClassVar[type | None] = None
    present: ClassVar[bool] = True      # False: the block has no FFN half (and no FFN norm)

    def __init__(self, cfg, layer_idx: int = 0):
        super().__init__()
        self.layer_idx = layer_idx
        self.opts = self.options(cfg)

    @classmethod
    def options(cls, cfg) -> Any:
        return parse_options(cls.options_class, cfg.ffn_options.get(cls.kind),
                             f"ffn_options[{cls.kind!r}]")

    @classmethod
    def check_config(cls, cfg) -> None:
        """ValueError naming the option unless ``cfg`` (one layer's config) builds this kind."""
        cls.options(cfg)

    @classmethod
    def active_parameters(cls, cfg) -> int:
        """Parameters one token runs through (all of them, for a dense FFN)."""
        raise NotImplementedError

    @classmethod
    def parameters_count(cls, cfg) -> int:
        """Parameters of one layer of this kind under ``cfg``."""
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


FFNS: dict[str, type[FFN]] = {}


def register_ffn(letter: str):
    """Class decorator: make an :class:`FFN` the feed-forward kind of ``letter`` in
    ``cfg.ffn_layers``."""
    if not isinstance(letter, str) or len(letter) != 1 or not letter.isalpha():
        raise ValueError(f"an FFN letter must be one letter, got {letter!r}")

    def wrap(cls: type[FFN]) -> type[FFN]:
        if not (isinstance(cls, type) and issubclass(cls, FFN)) or not cls.kind:
            raise ValueError(f"{cls!r} must be an FFN subclass with a `kind` name")
        old = FFNS.get(letter)
        if old is not None and old.__qualname__ != cls.__qualname__:
            raise ValueError(f"letter {letter!r} is taken by {old.__qualname__}")
        cls.letter = letter
        FFNS[letter] = cls
        return cls

    return wrap
