"""Building blocks shared by the blocks and the mixers: RMSNorm, SwiGLU, rotary embedding.

The mixers themselves (GLA, attention, ...) live in :mod:`hyla.model.mixers`.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """Root-mean-square norm over the last dim, computed in float32. ``zero_centred``: the
    weight is stored as an offset from 1 and applied as ``1 + w`` (Qwen3-Next's norms), so a
    file's weights load and export unchanged.

    Example:
        >>> RMSNorm(8)(torch.randn(2, 3, 8)).shape
        torch.Size([2, 3, 8])
    """

    def __init__(self, dim: int, eps: float = 1e-6, zero_centred: bool = False):
        super().__init__()
        self.eps = eps
        self.zero_centred = zero_centred
        self.weight = nn.Parameter(torch.zeros(dim) if zero_centred else torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype is torch.float32 and self.weight.dtype is torch.float32 \
                and not self.zero_centred:
            # one fused call where nothing needs converting (a decode step makes 60 of these)
            return torch.rms_norm(x, self.weight.shape, self.weight, self.eps)   # no wrapper
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        w = self.weight.float()
        return (xf * (1.0 + w if self.zero_centred else w)).to(x.dtype)


def norm_weight(weight: torch.Tensor, source: nn.Module, target: nn.Module) -> torch.Tensor:
    """``source``'s norm ``weight`` as ``target`` stores it (plain or zero-centred): the
    same scale. Example:
        >>> norm_weight(torch.tensor([1.5]), RMSNorm(1), RMSNorm(1, zero_centred=True))
        tensor([0.5000])
    """
    scale = weight + 1 if getattr(source, "zero_centred", False) else weight
    return scale - 1 if getattr(target, "zero_centred", False) else scale


class SwiGLU(nn.Module):
    """Gated MLP: down(silu(gate(x)) * up(x)); [..., d_model] -> [..., d_model]."""

    def __init__(self, d_model: int, ffn_dim: int):
        super().__init__()
        self.gate_proj = nn.Linear(d_model, ffn_dim, bias=False)
        self.up_proj = nn.Linear(d_model, ffn_dim, bias=False)
        self.down_proj = nn.Linear(ffn_dim, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


ROPE_TYPES = ("linear", "dynamic", "llama3", "yarn")      # scaled RoPE, transformers' names
_ROPE_KEYS = {      # required, optional (beside rope_type), as transformers validates them
    "linear": ({"factor"}, set()),
    "dynamic": ({"factor", "original_max_position_embeddings"}, set()),
    "llama3": ({"factor", "low_freq_factor", "high_freq_factor",
                "original_max_position_embeddings"}, set()),
    "yarn": ({"factor", "original_max_position_embeddings"},
             {"attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim",
              "truncate"}),
}


def check_rope_scaling(scaling: dict | None, name: str = "rope_scaling") -> None:
    """ValueError naming ``name`` unless ``scaling`` is None or a scaled RoPE hyla computes:
    ``{"rope_type": one of ROPE_TYPES, ...its parameters}``. ``dynamic``'s
    ``original_max_position_embeddings`` is the length beyond which it rescales
    (transformers' ``max_position_embeddings``).

    Example:
        >>> check_rope_scaling({"rope_type": "linear", "factor": 2.0})
        >>> check_rope_scaling({"rope_type": "longrope"})   # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: rope_scaling: rope_type 'longrope' is not supported: expected one of ...
    """
    if scaling is None:
        return
    if not isinstance(scaling, dict):
        raise ValueError(f"{name} must be a dict with a rope_type, got {scaling!r}")
    kind = scaling.get("rope_type")
    if kind not in _ROPE_KEYS:
        raise ValueError(f"{name}: rope_type {kind!r} is not supported: expected one of "
                         f"{ROPE_TYPES}")
    required, optional = _ROPE_KEYS[kind]
    missing = sorted(k for k in required if scaling.get(k) is None)
    extra = sorted(set(scaling) - required - optional - {"rope_type"})
    if missing or extra:
        raise ValueError(f"{name}: rope_type {kind!r} needs {sorted(required)} (optional "
                         f"{sorted(optional)}): missing {missing}, unknown {extra}")
    if not float(scaling["factor"]) > 0:
        raise ValueError(f"{name}: factor must be > 0, got {scaling['factor']}")



def rope_from_hf_config(hf: dict, source: str) -> tuple[float, dict | None]:
    """``(rope_theta, rope_scaling)`` for hyla from a transformers config's
    ``rope_parameters`` (transformers 5) or ``rope_scaling`` + ``rope_theta`` (older files);
    ValueError naming ``source`` for what hyla's rotary cannot compute.

    Example:
        >>> rope_from_hf_config({"rope_theta": 5e5}, "config.json")
        (500000.0, None)
        >>> rope_from_hf_config({"rope_parameters": {"rope_type": "linear", "factor": 2.0,
        ...                      "rope_theta": 1e4}}, "config.json")
        (10000.0, {'rope_type': 'linear', 'factor': 2.0})
    """
    params = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    if params and not isinstance(params.get("rope_type", params.get("type", "")), str):
        raise ValueError(f"{source}: rope_parameters per layer type are not supported")
    kind = params.pop("rope_type", params.pop("type", "default"))
    theta = float(params.pop("rope_theta", hf.get("rope_theta", 10000.0)))
    partial = params.pop("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    if partial not in (None, 1, 1.0):
        raise ValueError(f"{source}: partial_rotary_factor {partial} is not supported: hyla "
                         f"rotates the whole head")
    if kind == "default":
        return theta, None
    if kind in ("llama3", "yarn"):
        params["original_max_position_embeddings"] = hf.get(
            "original_max_position_embeddings",
            params.get("original_max_position_embeddings", hf.get("max_position_embeddings")))
    if kind == "yarn" and params.get("factor") is None and hf.get("max_position_embeddings"):
        params["factor"] = hf["max_position_embeddings"] / params[
            "original_max_position_embeddings"]
    if kind == "dynamic":      # transformers rescales beyond max_position_embeddings
        params["original_max_position_embeddings"] = hf.get("max_position_embeddings")
    scaling = {"rope_type": kind, **params}
    try:
        check_rope_scaling(scaling, f"{source}: rope_parameters")
    except ValueError as e:
        raise ValueError(str(e)) from None
    return theta, scaling


def rope_frequencies(dim: int, theta: float, scaling: dict | None = None, *, device=None,
                     lengths: torch.Tensor | None = None) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [dim / 2] float32 of a rotary embedding and the factor its cos/sin
    are multiplied by, with transformers' formulas for scaled RoPE (``linear``, ``dynamic``,
    ``llama3``, ``yarn``: see :func:`check_rope_scaling`).

    ``dynamic`` depends on the sequence length a token is computed with: ``lengths`` (any
    shape, one a token, as transformers' ``max(position_ids) + 1`` of that forward) gives
    frequencies [*lengths.shape, dim / 2].

    Example:
        >>> f, a = rope_frequencies(8, 1e4, {"rope_type": "linear", "factor": 4.0})
        >>> torch.allclose(f * 4, rope_frequencies(8, 1e4)[0]), a
        (True, 1.0)
    """
    exponents = torch.arange(0, dim, 2, device=device, dtype=torch.float32) / dim
    if scaling is None:
        return theta ** -exponents, 1.0
    kind, factor = scaling["rope_type"], float(scaling["factor"])
    inv_freq = 1.0 / (theta ** exponents)
    if kind == "linear":
        return inv_freq / factor, 1.0
    original = scaling["original_max_position_embeddings"]
    if kind == "dynamic":
        if lengths is None:
            return inv_freq, 1.0
        n = torch.clamp(lengths.to(device=device, dtype=torch.float32), min=original)
        base = theta * ((factor * n / original) - (factor - 1)) ** (dim / (dim - 2))
        return 1.0 / (base[..., None] ** exponents), 1.0
    if kind == "llama3":
        low_wavelen = original / scaling["low_freq_factor"]
        high_wavelen = original / scaling["high_freq_factor"]
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (original / wavelen - scaling["low_freq_factor"]) / (
            scaling["high_freq_factor"] - scaling["low_freq_factor"])
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled), 1.0
    return _yarn(dim, theta, factor, original, scaling, exponents)


def _yarn(dim, theta, factor, original, scaling, exponents):
    def mscale(scale, m=1.0):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = scaling.get("attention_factor")
    if attention is None:
        m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
        attention = (float(mscale(factor, m) / mscale(factor, m_all)) if m and m_all
                     else mscale(factor))
    beta_fast = scaling.get("beta_fast") or 32
    beta_slow = scaling.get("beta_slow") or 1

    def correction_dim(rotations):
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001                   # transformers' guard against a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32,
                                     device=exponents.device) - low) / (high - low), 0, 1)
    pos_freqs = theta ** exponents
    extrapolation = 1 - ramp
    inv_freq = ((1.0 / (factor * pos_freqs)) * (1 - extrapolation)
                + (1.0 / pos_freqs) * extrapolation)
    return inv_freq, float(attention)


def rotary_tables(positions: torch.Tensor, dim: int, theta: float,
                  scaling: dict | None = None, lengths: torch.Tensor | None = None,
                  *, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and signed sin [(B or 1), T, 1, dim] float32 that :func:`rotate` turns a head by,
    for absolute ``positions`` [B, T] or [T]. Compute them once per forward and rotate every
    layer's q and k with them (:func:`shared_rotary_tables`): they are the costly half."""
    if scaling is None:
        inv_freq = theta ** (-torch.arange(0, dim, 2, device=device, dtype=torch.float32) / dim)
        factor = 1.0
    else:
        inv_freq, factor = rope_frequencies(dim, theta, scaling, device=device, lengths=lengths)
    angles = positions.to(device, torch.float32)[..., None] * inv_freq     # [(B,) T, D/2]
    angles = angles.reshape(-1 if positions.dim() == 2 else 1, positions.shape[-1], 1, dim // 2)
    cos, sin = angles.cos(), angles.sin()
    if factor != 1.0:                   # yarn: cos and sin scaled, as transformers does
        cos, sin = cos * factor, sin * factor
    return torch.cat([cos, cos], dim=-1), torch.cat([-sin, sin], dim=-1)


def shared_rotary_tables(memo: dict | None, positions: torch.Tensor, dim: int, theta: float,
                         scaling: dict | None = None, lengths: torch.Tensor | None = None,
                         *, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`rotary_tables`, computed once per forward: ``memo`` (the forward's
    ``Context.memo``; None: not shared) holds them for every other layer that turns heads of
    this size alike (a decode step of SmolLM2 spent about 2 ms a token on them otherwise)."""
    key = ("rotary", dim, theta, repr(scaling))
    tables = None if memo is None else memo.get(key)
    if tables is None:
        tables = rotary_tables(positions, dim, theta, scaling, lengths, device=device)
        if memo is not None:
            memo[key] = tables
    return tables


def rotate(x: torch.Tensor, tables: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """``x`` [B, T, H, D] turned by :func:`rotary_tables` (half-split layout):
    ``[x1 cos - x2 sin, x2 cos + x1 sin]``, as ``x cos + roll(x, D / 2) * (-sin, sin)``."""
    cos, sin = tables
    xf = x if x.dtype is torch.float32 else x.float()
    out = torch.addcmul(xf * cos, xf.roll(x.shape[-1] // 2, dims=-1), sin)
    return out if out.dtype is x.dtype else out.to(x.dtype)


def apply_rotary(x: torch.Tensor, positions: torch.Tensor, theta: float,
                 scaling: dict | None = None, lengths: torch.Tensor | None = None
                 ) -> torch.Tensor:
    """Rotate ``x`` [B, T, H, D] by absolute ``positions`` [B, T] or [T] (half-split layout).

    The half-split ("rotate_half") layout is Llama's / Hugging Face's, so weights port as is.
    Frequencies are computed on the fly in float32: no buffer to move between devices or to
    materialise after construction on the meta device. ``scaling``: a scaled RoPE
    (:func:`rope_frequencies`; ``lengths``, shaped as ``positions``, for ``dynamic``).

    Example:
        >>> x = torch.randn(1, 5, 2, 8)
        >>> torch.allclose(apply_rotary(x, torch.zeros(5, dtype=torch.long), 1e4), x)
        True
    """
    tables = rotary_tables(positions, x.shape[-1], theta, scaling, lengths, device=x.device)
    return rotate(x, tables)
