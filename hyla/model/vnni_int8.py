"""8-bit products for a few rows through fbgemm's VNNI kernels: the output layer of a decode.

torch's weight-only kernels turn each weight back into a float and multiply in floats. On
SmolLM2's 49,152 x 576 output layer that took 3.9-4.5 ms a token on one thread, the largest
single cost of a decode step. fbgemm (torch's quantised engine on x86) multiplies int8 by
int8 with VNNI dot products, the way llama.cpp multiplies its Q8_0 output layer by 8-bit
activations: 2.2 ms for the same layer here, 10.7 against 13.1 ms for the bf16 GEMM at 16
rows (``benchmarks/vnni_int8.py``; the bare fbgemm call takes about 1 ms for one row, the
residual row below doubles its rows).

The price would be that the activations are quantised too, per call, and fbgemm takes one
range for all the rows of a call. So each row is first mapped onto [0, 1] by its own minimum
and span (fbgemm's grid is then k / 255 for every row), and what that grid misses goes in as
a second row, on the same grid: the product is ``W x = span (W u + (W r - W 1 / 2) / 255) +
min W 1``, activations at about 16 bits, in one call that reads the weight once. A request's
result does not depend on what else is in the batch. The weight keeps one scale per output
row (8 bits), the one error left: on SmolLM2 the decode path's perplexity moved 0.03% for
one sequence and 0.2% for 16 together.

Without VNNI (AVX2 alone), fbgemm sums pairs of products in int16, which saturates with
8-bit activations: there the grid is k / 127 (fbgemm's ``reduce_range``, 7 bits, two of
them a row with the residual: about 14 bits). On this project's AVX2 machine that still
beats torch's weight-only int8 kernel 10-30x for one row (bf16 activations have no fast
path there): 0.11 against 3.5 ms on a 3,376 x 768 weight, 6.8 against 112 ms on a
100,352 x 768 output layer (``benchmarks/vnni_int8.py`` on SmolLM2).
"""

from __future__ import annotations

import itertools
import warnings
import weakref

import torch

from hyla.model.activation_rotation import BlockHadamard
from hyla.ops.hardware import checked_once


@checked_once
def int8_products_available() -> bool:
    """Whether fbgemm's int8 products run here (x86 with AVX2 or better)."""
    return ("fbgemm" in torch.backends.quantized.supported_engines
            and torch.backends.quantized.engine in ("x86", "fbgemm")
            and torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512"))


@checked_once
def vnni_int8_available() -> bool:
    """Whether they run on VNNI (AVX512-VNNI): 8-bit activations, int32 sums."""
    return int8_products_available() and torch.cpu._is_vnni_supported()


def activation_levels() -> int:
    """The activations' grid of fbgemm's products here: 255 steps with VNNI, else 127."""
    return 255 if vnni_int8_available() else 127


def per_row_int8(weight: torch.Tensor, rows: int = 2048) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 codes [out, in] and one fp32 scale per output row of ``weight``.

    ``rows`` at a time: each pass then stays in cache (a 248K-row embedding: 0.55 s against
    2.0 s in one piece on an AVX2 EPYC).
    """
    w = weight.detach()
    codes = torch.empty(w.shape, dtype=torch.int8, device=w.device)
    scale = torch.empty(w.shape[0], dtype=torch.float32, device=w.device)
    for i in range(0, w.shape[0], rows):
        part = w[i:i + rows].float()
        s = (part.abs().amax(dim=1) / 127).clamp_(min=1e-12)
        scale[i:i + rows] = s
        codes[i:i + rows] = torch.div(part, s[:, None]).round_().clamp_(-127, 127)
    return codes, scale


def code_row_sums(codes: torch.Tensor, rows: int = 2048) -> torch.Tensor:
    """Each row's sum of int8 ``codes``, exact (in float32: under 2^24 for rows of fewer than
    132K columns), ``rows`` at a time: 10x faster than one int32 sum over the whole matrix."""
    if codes.shape[1] * 127 >= 2 ** 24:
        return codes.sum(dim=1, dtype=torch.int64).float()
    return torch.cat([part.float().sum(dim=1) for part in codes.split(rows)])


# torch.compile cannot put fbgemm's packed weight (a TorchScript object) in a graph, so a
# compiled step calls the product through a custom op that names the weight by a number.
_PACKED: weakref.WeakValueDictionary[int, VnniInt8Matmul] = weakref.WeakValueDictionary()
_HANDLES = itertools.count()


# Defined through torch.library.Library rather than the custom_op decorator: its Python
# wrapper cost 11 us a call against under 1 us (a 16-wide SmolLM2 step makes 121 of them).
_LIB = torch.library.Library("hyla", "FRAGMENT")
_LIB.define("vnni_int8_linear(Tensor x, int handle) -> Tensor")


def _linear_impl(x: torch.Tensor, handle: int) -> torch.Tensor:
    mm = _PACKED[handle]
    return torch.ops.quantized.linear_dynamic(x, mm.packed, mm.reduce_range)


_LIB.impl("vnni_int8_linear", _linear_impl, "CPU")


@torch.library.register_fake("hyla::vnni_int8_linear")
def _(x: torch.Tensor, handle: int) -> torch.Tensor:
    return x.new_empty(x.shape[0], _PACKED[handle].out_features)


_linear_by_handle = torch.ops.hyla.vnni_int8_linear.default


class VnniInt8Matmul:
    """``x @ W.T`` for rows ``x`` [M, in] -> [M, out] fp32, ``W = codes * scales[:, None]``
    (int8 codes, one scale per output row: :func:`per_row_int8`), each row of activations
    quantised over its own range.

    Example (where VNNI runs):
        >>> g = torch.Generator().manual_seed(0)     # the bounds hold for this draw
        >>> w, x = torch.randn(64, 64, generator=g), torch.randn(3, 64, generator=g)
        >>> if vnni_int8_available():
        ...     y = VnniInt8Matmul(*per_row_int8(w))(x)
        ...     assert (y - x @ w.T).norm() / (x @ w.T).norm() < 0.02
        ...     y8 = VnniInt8Matmul(*per_row_int8(w), residual=False)(x)
        ...     assert (y - x @ w.T).norm() < (y8 - x @ w.T).norm() < 0.05 * (x @ w.T).norm()
        ...     w[:, 3] *= 30; x[:, 3] *= 30    # an outlier channel: rotation spreads it
        ...     y8 = VnniInt8Matmul(*per_row_int8(w), residual=False)(x)
        ...     y8r = VnniInt8Matmul.eight_bit(w)(x)
        ...     assert (y8r - x @ w.T).norm() < (y8 - x @ w.T).norm()
    """

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor, residual: bool = True,
                 rotation: BlockHadamard | None = None, levels: int | None = None):
        """``residual`` False: 8-bit activations, one row each (half the work; measured +1.5%
        decode-path perplexity on SmolLM2 at 16 rows, ``benchmarks/vnni_int8.py``).
        ``rotation``: applied to the activations first (the codes must be of the weight
        rotated alike: :meth:`eight_bit` makes both). ``levels``: the activations' grid,
        255 or 127 (None: :func:`activation_levels`; 127 runs on any AVX2 CPU)."""
        self.residual, self.rotation = residual, rotation
        self.levels = levels or activation_levels()
        if self.levels not in (127, 255):
            raise ValueError(f"levels must be 127 or 255, got {self.levels}")
        self.reduce_range = self.levels == 127     # 7-bit activations: no int16 overflow
        scales = scales.double()
        with warnings.catch_warnings():   # quantised tensors are deprecated, fbgemm is not
            warnings.simplefilter("ignore", UserWarning)
            q = torch._make_per_channel_quantized_tensor(
                codes, scales, torch.zeros(len(codes), dtype=torch.long), 0)
            self.packed = torch.ops.quantized.linear_prepack(q, None)
        self.out_features = len(codes)
        # what the packed copy holds (fbgemm keeps it out of torch's tensors, so a memory
        # count asks here): a byte a weight, and an int32 offset a column
        self.packed_bytes = codes.numel() + 4 * len(codes)
        self.handle = next(_HANDLES)
        _PACKED[self.handle] = self
        # W 1, of the weight as quantised (integer sums: exact and cheap)
        self.row_sums = (code_row_sums(codes).double() * scales).float()

    @classmethod
    def eight_bit(cls, weight: torch.Tensor) -> VnniInt8Matmul:
        """8-bit activations, rotated (:mod:`hyla.model.activation_rotation`) where the input
        size allows it: half the work of the 16-bit default for +0.11% decode-path perplexity
        on SmolLM2 (``benchmarks/activation_bits.py``). Where it does not, 16 bits: unrotated
        8-bit activations cost 1.5%."""
        if not BlockHadamard.fits(weight.shape[1]):
            return cls(*per_row_int8(weight))
        rotation = BlockHadamard(weight.shape[1])
        return cls(*per_row_int8(rotation(weight)), residual=False, rotation=rotation)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x = x if x.dtype is torch.float32 else x.float()
        if self.rotation is not None:
            x = self.rotation(x)
        M = x.shape[0]
        # amin and amax: torch.aminmax over rows measured 5-10x slower on CPU
        low = x.amin(dim=1, keepdim=True)
        span = (x.amax(dim=1, keepdim=True) - low).clamp_(min=1e-30)
        unit = (x - low).div_(span)          # [0, 1]: fbgemm's grid is k / L, L = levels
        if not self.residual:
            return self._product(unit).mul_(span).addcmul_(low, self.row_sums)
        L = self.levels
        scaled = unit * L
        residual = scaled.sub_(scaled.round()).add_(0.5)     # what the grid missed, in [0, 1]
        # one call for both (the weight is read once)
        y = self._product(torch.cat([unit, residual]))
        # W x = span (W unit + (W residual - W 1 / 2) / L) + low W 1
        out = torch.add(y[:M], y[M:], alpha=1 / L).mul_(span)
        return out.addcmul_(low - span / (2 * L), self.row_sums)

    def _product(self, rows: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            return _linear_by_handle(rows, self.handle)
        return torch.ops.quantized.linear_dynamic(rows, self.packed, self.reduce_range)
