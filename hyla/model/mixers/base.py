"""The mixer protocol: one registry of layer kinds, each declaring its per-sequence state.

A mixer is the sequence-mixing half of a block (the other half is the MLP). Everything that
depends on the kind of a layer lives in its mixer class: the parameters, the state it keeps
per sequence (a :class:`StateSpec`), and one ``forward(x, ctx)`` that serves training,
prefill and decode alike (the :class:`~hyla.model.context.Context` says which). The model,
``SequenceState``, the serving runner, ``hyla memory`` and the simulator only ever read
``MIXERS`` and the specs, so a new kind is one file here plus its ops.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from hyla.model.options import parse_options


@dataclass(frozen=True)
class TensorSpec:
    """One named state tensor of a layer, for one sequence.

    ``shape`` is the whole tensor for a fixed-size entry and one token's row for a growing
    entry. ``dtype`` None means the model's dtype (attention caches follow the weights);
    recurrent states name float32 explicitly.

    Example:
        >>> TensorSpec("S", (4, 8, 16), torch.float32).nbytes()
        2048
    """

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype | None = None

    def nbytes(self, model_dtype: torch.dtype = torch.float32) -> int:
        """Bytes of the tensor (of one row, for a growing entry)."""
        return math.prod(self.shape) * (self.dtype or model_dtype).itemsize

    def resolve(self, model_dtype: torch.dtype) -> torch.dtype:
        return self.dtype or model_dtype


@dataclass(frozen=True)
class StateSpec:
    """What one layer keeps per sequence: fixed-size tensors and tensors that grow a row a
    token. A layer's bytes after ``n`` tokens are ``fixed + n * per_token``, known without
    running it.

    Example:
        >>> spec = StateSpec("attention", per_token=(TensorSpec("k", (2, 16)),
        ...                                          TensorSpec("v", (2, 16))))
        >>> spec.nbytes(10, torch.bfloat16), spec.names
        (1280, ('k', 'v'))
    """

    kind: str
    fixed: tuple[TensorSpec, ...] = ()
    per_token: tuple[TensorSpec, ...] = ()
    # a sliding-window layer: its fixed entries are rings of its last ``window`` tokens'
    # rows (the layer groups memory is counted by: full attention, window, recurrent)
    window: int | None = None

    @property
    def group(self) -> str:
        """The memory group: "full attention" (grows a row a token), "window" (a ring of
        the last ``window`` tokens) or "recurrent" (fixed size)."""
        if self.per_token:
            return "full attention"
        return "window" if self.window is not None else "recurrent"

    @property
    def entries(self) -> tuple[TensorSpec, ...]:
        """Fixed entries first, then growing ones: the order of a layer's tensors in a
        :class:`~hyla.model.state.SequenceState`."""
        return self.fixed + self.per_token

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(e.name for e in self.entries)

    def fixed_bytes(self, model_dtype: torch.dtype = torch.float32) -> int:
        return sum(e.nbytes(model_dtype) for e in self.fixed)

    def per_token_bytes(self, model_dtype: torch.dtype = torch.float32) -> int:
        return sum(e.nbytes(model_dtype) for e in self.per_token)

    def nbytes(self, num_tokens: int, model_dtype: torch.dtype = torch.float32) -> int:
        """Bytes after ``num_tokens`` tokens."""
        return self.fixed_bytes(model_dtype) + num_tokens * self.per_token_bytes(model_dtype)


class Mixer(nn.Module):
    """Base class of the layer kinds. Subclasses set ``kind`` (a readable name), register
    under a letter with :func:`register_mixer`, and implement :meth:`state_spec` and
    :meth:`forward`. ``layer_idx`` is the block the mixer sits in: it finds its state
    buffers in the context by it.

    Example:
        >>> {"A", "G"} <= set(MIXERS), MIXERS["G"].kind
        (True, 'gla')
    """

    letter: ClassVar[str] = ""
    kind: ClassVar[str] = ""            # a readable identifier: "gla", "attention"
    label: ClassVar[str] = ""           # for people: "GLA"; defaults to the kind
    state_label: ClassVar[str] = ""     # what its state is called: "GLA state"
    # The dataclass of this kind's ``cfg.mixer_options[kind]`` (None: it takes none).
    options_class: ClassVar[type | None] = None

    def __init__(self, cfg, layer_idx: int = 0):
        super().__init__()
        self.cfg = cfg
        self.layer_idx = layer_idx
        self.opts = self.options(cfg)

    @classmethod
    def options(cls, cfg) -> Any:
        """This kind's options under ``cfg`` (an ``options_class`` instance, or None)."""
        return parse_options(cls.options_class, cfg.mixer_options.get(cls.kind),
                             f"mixer_options[{cls.kind!r}]")

    @classmethod
    def check_config(cls, cfg) -> None:
        """ValueError naming the field unless ``cfg`` (one layer's config) builds this
        kind; the default parses its options."""
        cls.options(cfg)

    @classmethod
    def state_spec(cls, cfg) -> StateSpec:
        """The per-sequence state of one layer of this kind under ``cfg``."""
        raise NotImplementedError

    @classmethod
    def pair_flops(cls, cfg) -> float:
        """FLOPs per (query, key) pair of one layer: what grows with context (softmax
        attention's QK^T and PV); 0 for mixers with a fixed-size state."""
        return 0.0

    @classmethod
    def token_flops(cls, cfg) -> float:
        """FLOPs per token of one layer's state work besides its projections (the
        recurrent update and readout of a linear mixer)."""
        return 0.0

    def forward(self, x: torch.Tensor, ctx) -> torch.Tensor:
        """x [B, T, d_model] (the normed block input) -> [B, T, d_model].

        Training (``ctx.mode == "train"``) keeps no state. Prefill and decode read and
        update the layer's buffers ``ctx.buffers[self.layer_idx]`` (a dict by the names of
        :meth:`state_spec`): fixed entries ``[slots, *shape]`` indexed by ``ctx.slots``,
        growing entries paged ``[blocks, block_size, *shape]`` through ``ctx.block_tables``.
        """
        raise NotImplementedError

    @classmethod
    def copies_attention(cls, teacher_cfg, cfg) -> bool:
        """Whether :meth:`init_from_attention` makes this layer compute exactly what the
        teacher's attention layer did (so distillation has nothing to teach it)."""
        return False

    @torch.no_grad()
    def init_from_attention(self, teacher: nn.Module) -> None:
        """Take what fits from a softmax-attention teacher layer at the same place (its
        ``q_proj``, ``k_proj``, ``v_proj``, ``o_proj``, maybe with more KV heads), to start
        distillation close to it. The default keeps the fresh initialisation."""

    def attention_qk(self, x: torch.Tensor, ctx) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The (rotated) queries and keys [B, T, H, D] of a softmax-attention mixer, whose
        attention distribution distillation transfers; None for mixers without one."""
        return None


def merge_kv_heads(weight: torch.Tensor, heads: int, new_heads: int) -> torch.Tensor:
    """[heads * D, d] projection rows -> [new_heads * D, d], each new head the mean of a group.

    Example:
        >>> w = torch.arange(8.0)[:, None]          # 4 heads of D = 2
        >>> merge_kv_heads(w, 4, 2)[:, 0].tolist()
        [1.0, 2.0, 5.0, 6.0]
    """
    D = weight.shape[0] // heads
    return weight.view(new_heads, heads // new_heads, D, -1).mean(1).reshape(new_heads * D, -1)


def expand_kv_heads(weight: torch.Tensor, heads: int, new_heads: int) -> torch.Tensor:
    """[heads * D, d] -> [new_heads * D, d], head ``j`` repeated for its ``new_heads / heads``
    query heads (GQA order: query head ``h`` reads KV head ``h // (new_heads / heads)``).

    Example:
        >>> expand_kv_heads(torch.arange(4.0)[:, None], 2, 4)[:, 0].tolist()
        [0.0, 1.0, 0.0, 1.0, 2.0, 3.0, 2.0, 3.0]
    """
    D = weight.shape[0] // heads
    return weight.view(heads, D, -1).repeat_interleave(new_heads // heads, 0).reshape(
        new_heads * D, -1)


def mamba_decay_init(heads: int, decays: int | None = None
                     ) -> tuple[nn.Parameter, nn.Parameter]:
    """(A_log [heads], dt_bias [decays or heads]) as Mamba-2 initialises them: A in [1, 16],
    dt in [1e-3, 1e-1] log-uniformly, dt_bias its softplus inverse. Made on the CPU, then
    moved to the default device: on the meta device (a loader's skeleton) the first such
    pointwise op imports torch's Python meta kernels, 2-3 s of start-up."""
    device = torch.empty(0).device
    a = torch.empty(heads, device="cpu").uniform_(1, 16)
    dt = torch.exp(torch.empty(decays or heads, device="cpu").uniform_(math.log(1e-3),
                                                                     math.log(1e-1)))
    return (nn.Parameter(a.log().to(device)),
            nn.Parameter((dt + torch.log(-torch.expm1(-dt))).to(device)))


MIXERS: dict[str, type[Mixer]] = {}


def register_mixer(letter: str):
    """Class decorator: make a :class:`Mixer` the layer kind of ``letter`` in layer strings.

    Example:
        >>> "G" in MIXERS and MIXERS["G"].letter == "G"
        True
    """
    if not isinstance(letter, str) or len(letter) != 1 or not letter.isalpha():
        raise ValueError(f"a mixer letter must be one letter, got {letter!r}")

    def wrap(cls: type[Mixer]) -> type[Mixer]:
        if not (isinstance(cls, type) and issubclass(cls, Mixer)) or not cls.kind:
            raise ValueError(f"{cls!r} must be a Mixer subclass with a `kind` name")
        old = MIXERS.get(letter)
        if old is not None and old.__qualname__ != cls.__qualname__:
            raise ValueError(f"letter {letter!r} is taken by {old.__qualname__}")
        taken = {m.kind: k for k, m in MIXERS.items() if k != letter}
        if cls.kind in taken:
            raise ValueError(f"kind {cls.kind!r} is taken by letter {taken[cls.kind]!r}")
        cls.letter = letter
        cls.label = cls.__dict__.get("label") or cls.kind
        cls.state_label = cls.__dict__.get("state_label") or f"{cls.label} state"
        MIXERS[letter] = cls
        return cls

    return wrap


def mixer_of_kind(kind: str) -> type[Mixer]:
    """The registered mixer class whose ``kind`` is ``kind`` (ValueError if none)."""
    for cls in MIXERS.values():
        if cls.kind == kind:
            return cls
    raise ValueError(f"unknown layer kind {kind!r}: registered kinds are "
                     f"{sorted(m.kind for m in MIXERS.values())}")


def layer_specs(cfg) -> list[StateSpec]:
    """One StateSpec per layer of ``cfg.layers``: the single source of state sizes.

    Example:
        >>> from hyla.model.config import preset
        >>> [s.kind for s in layer_specs(preset("debug"))]
        ['gla', 'gla', 'gla', 'attention']
    """
    return [MIXERS[c].state_spec(cfg.layer_config(i)) for i, c in enumerate(cfg.layers)]
