"""Weight-only quantisation for inference: int8 per channel, int4 in groups.

The weights stay quantised in memory and the matmul dequantises them inside torch's own
kernels (``torch._weight_int8pack_mm``, ``aten._weight_int4pack_mm_for_cpu``), so a decode
step reads 4x (int8) or ~7x (int4) fewer bytes of weights than fp32. Activations run through
those kernels in bf16, the dtype they are fast in; everything outside the linear layers
(norms, the recurrent state, attention) keeps the model's dtype.

- ``int8``: symmetric, one scale per output channel (what torch's int8 kernel takes);
- ``int4``: asymmetric, one scale and zero per group of ``INT4_GROUP`` input weights, the
  layout of GGUF's Q4_0/Q4_1 blocks (32 weights along a row), so a Q4 GGUF re-quantises
  almost exactly.

A linear layer the int4 kernel cannot take (an input size not a multiple of the group, a
tiny low-rank gate) falls back to int8, and so does the output layer; the embedding table is
kept as int8 rows. A quantised
model is for inference only: it refuses to train.

Example:
    >>> from hyla.model import HylaLM, preset
    >>> model = HylaLM(preset("debug")).eval()
    >>> ids = torch.randint(0, 256, (1, 12))
    >>> ref = model(ids)
    >>> report = quantize_model(model, "int8")
    >>> report.scheme, report.layers > 0, report.bytes_after < report.bytes_before
    ('int8', True, True)
    >>> bool((model(ids) - ref).abs().max() < 0.05)
    True
"""

from __future__ import annotations

import dataclasses
import functools

import torch
import torch.nn.functional as F
from torch import nn

SCHEMES = ("none", "int8", "int4")
INT4_GROUP = 32
# torch's packed kernels are matrix-vector products: their time grows with every row. A
# decode batch (up to a few dozen rows) is still faster through them, but a prefill chunk is
# faster dequantising the one weight and running a dense GEMM (measured on SmolLM2's output
# layer: the kernel costs about as much as the dequantisation at 60-80 rows).
KERNEL_MAX_ROWS = 64
# The CPU int4 packing for out_features % 64 == 0: per block of 64 output rows and per input
# column, 32 bytes whose low nibbles are rows 0-31 and high nibbles rows 32-63.
INT4_BLOCK_N = 64


def _check_device(scheme: str, device: torch.device) -> None:
    # The packed kernels torch ships for CPU are the ones this module is tested with; the
    # CUDA ones take other packings and have not been run here.
    if device.type != "cpu":
        raise ValueError(f"--quantize {scheme}: weight-only {scheme} is implemented for CPU "
                         f"only, not {device.type}; serve with --quantize none on {device.type}")


class Int8Linear(nn.Module):
    """``y = x @ dequant(W).T + b`` with W int8 [out, in] and one bf16 scale per output row."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        w = weight.detach().float()
        scale = (w.abs().amax(dim=1) / 127).clamp(min=1e-12)
        self.register_buffer("qweight", (w / scale[:, None]).round().clamp(-127, 127)
                             .to(torch.int8))
        self.register_buffer("scales", scale.to(torch.bfloat16))
        self.register_buffer("bias", None if bias is None else bias.detach().clone())
        self.in_features, self.out_features = w.shape[1], w.shape[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        if flat.shape[0] > KERNEL_MAX_ROWS:
            return F.linear(x, self.dequantized(x.dtype), self.bias)
        y = torch._weight_int8pack_mm(flat.to(torch.bfloat16), self.qweight, self.scales)
        y = y.to(x.dtype)
        if self.bias is not None:
            y = y + self.bias
        return y.view(*x.shape[:-1], self.out_features)

    def dequantized(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return self.qweight.to(dtype) * self.scales.to(dtype)[:, None]


def int4_fits(weight: torch.Tensor, group: int = INT4_GROUP) -> bool:
    """Whether the CPU int4 kernel takes a weight of this shape ([out, in])."""
    out_features, in_features = weight.shape
    return (in_features % group == 0 and in_features >= 2 * group
            and out_features % INT4_BLOCK_N == 0)


def _unpack_int4(packed: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """The [n, k] codes of a packed weight (the layout in ``INT4_BLOCK_N``'s comment)."""
    blocks = packed.view(n // INT4_BLOCK_N, k, INT4_BLOCK_N // 2)
    codes = torch.cat([blocks & 15, blocks >> 4], dim=-1)           # [n / 64, k, 64]
    return codes.transpose(1, 2).reshape(n, k)


@functools.cache
def _int4_layout_known() -> bool:
    # The packing is torch's internal choice: check once that it is the one unpacked here,
    # and otherwise keep to the kernel (slower for prefill, never wrong).
    codes = torch.randint(0, 16, (2 * INT4_BLOCK_N, 2 * INT4_GROUP), dtype=torch.int32,
                          generator=torch.Generator().manual_seed(0))
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
    return (packed.shape == (codes.shape[0], codes.shape[1] // 2)
            and torch.equal(_unpack_int4(packed, *codes.shape).to(torch.int32), codes))


class Int4Linear(nn.Module):
    """Weights as 4-bit codes in groups along the input: ``w = (q - 8) * scale + zero``."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, group: int = INT4_GROUP):
        super().__init__()
        w = weight.detach().float()
        n, k = w.shape
        groups = w.view(n, k // group, group)
        lo, hi = groups.amin(-1), groups.amax(-1)
        # The kernel takes bf16 scales and zeros: round them first and choose the codes
        # against the rounded values, or the rounding of the zero alone costs a step.
        scale = ((hi - lo) / 15).clamp(min=1e-12).to(torch.bfloat16).float()
        zero = (lo + 8 * scale).to(torch.bfloat16).float()   # the kernel centres codes on 8
        codes = ((groups - zero[..., None]) / scale[..., None] + 8).round().clamp(0, 15)
        self.register_buffer("packed", torch.ops.aten._convert_weight_to_int4pack_for_cpu(
            codes.view(n, k).to(torch.int32), 1))
        self.register_buffer("scales_zeros", torch.stack([scale, zero], -1).transpose(0, 1)
                             .contiguous().to(torch.bfloat16))     # [k / group, n, 2]
        self.register_buffer("bias", None if bias is None else bias.detach().clone())
        self.in_features, self.out_features, self.group = k, n, group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        if flat.shape[0] > KERNEL_MAX_ROWS and _int4_layout_known():
            return F.linear(x, self.dequantized(x.dtype), self.bias)
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(flat.to(torch.bfloat16), self.packed,
                                                        self.group, self.scales_zeros)
        y = y.to(x.dtype)
        if self.bias is not None:
            y = y + self.bias
        return y.view(*x.shape[:-1], self.out_features)

    def dequantized(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        n, k, g = self.out_features, self.in_features, self.group
        codes = _unpack_int4(self.packed, n, k).to(dtype).view(n, k // g, g) - 8
        scale, zero = self.scales_zeros.to(dtype).transpose(0, 1).unbind(-1)   # [n, k / g]
        return (codes * scale[..., None] + zero[..., None]).view(n, k)


class Int8Embedding(nn.Module):
    """An embedding table as int8 rows with one scale each (looked up, then scaled)."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        w = weight.detach().float()
        scale = (w.abs().amax(dim=1) / 127).clamp(min=1e-12)
        self.register_buffer("qweight", (w / scale[:, None]).round().clamp(-127, 127)
                             .to(torch.int8))
        self.register_buffer("scales", scale)
        self.dtype = weight.dtype
        self.num_embeddings, self.embedding_dim = w.shape

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = F.embedding(ids, self.qweight).to(self.dtype)
        return rows * self.scales[ids, None].to(self.dtype)


@dataclasses.dataclass(frozen=True)
class QuantReport:
    """What :func:`quantize_model` did: layers replaced, and weight bytes before and after."""

    scheme: str
    layers: int
    int4_layers: int
    bytes_before: int
    bytes_after: int


def _tensor_bytes(module: nn.Module) -> int:
    seen: set[int] = set()
    total = 0
    for t in list(module.parameters()) + list(module.buffers()):
        if id(t) not in seen:
            seen.add(id(t))
            total += t.numel() * t.element_size()
    return total


def quantize_model(model: nn.Module, scheme: str, *, group: int = INT4_GROUP) -> QuantReport:
    """Replace ``model``'s linear layers (and its embedding) in place by weight-only
    quantised ones. ``scheme``: ``none`` (nothing happens), ``int8`` or ``int4``.

    Raises ValueError naming the scheme for an unknown scheme or a device without kernels.
    """
    if scheme not in SCHEMES:
        raise ValueError(f"--quantize: unknown scheme {scheme!r}; choose from {SCHEMES}")
    before = _tensor_bytes(model)
    if scheme == "none":
        return QuantReport(scheme, 0, 0, before, before)
    first = next(model.parameters(), None)
    if first is not None:
        _check_device(scheme, first.device)
    if model.training:
        model.eval()
    replaced = int4 = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):
                # The output layer stays int8 under int4, as llama.cpp's 4-bit files keep it
                # at 6-8 bits: each of its errors lands directly on a logit.
                if scheme == "int4" and name != "lm_head" and int4_fits(child.weight, group):
                    new: nn.Module = Int4Linear(child.weight, child.bias, group)
                    int4 += 1
                else:
                    new = Int8Linear(child.weight, child.bias)
                setattr(parent, name, new)
                replaced += 1
            elif isinstance(child, nn.Embedding):
                setattr(parent, name, Int8Embedding(child.weight))
    model.requires_grad_(False)
    model.quantized = scheme  # what checkpoint writers and trainers check before they run
    return QuantReport(scheme, replaced, int4, before, _tensor_bytes(model))
