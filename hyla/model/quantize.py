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
tiny low-rank gate) falls back to int8. The output layer keeps 8 bits under both schemes: per
row, computed by fbgemm's int8 products on any x86 CPU with AVX2
(:mod:`hyla.model.vnni_int8`), else in groups of 32 through the int4 kernel
(:class:`Int8GroupLinear`); the embedding table is kept as int8 rows and an MoE router in
float. Projections of one input (q, k, v; gate, up) become one quantised weight
(:mod:`hyla.model.fused_projections`). Decode batches and short prompts (2-64 rows; from
one row where that measures faster, :func:`fbgemm_min_rows`) take fbgemm's int8 products,
and more rows (prefill) a dense GEMM
(:class:`WeightOnlyLinear`). A quantised model is for inference only: it refuses to train.

Example:
    >>> from hyla.model import HylaLM, preset
    >>> _ = torch.manual_seed(0)    # the bound below holds for this draw, not every one
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

import torch
import torch.nn.functional as F
from torch import nn

from hyla.model.activation_rotation import BlockHadamard
from hyla.model.fused_projections import fuse_siblings
from hyla.model.int4_packing import (
    INT4_GROUP,
    group_ranges,
    int4_block_n,
    int4_dequantized,
    int4_fits,
    int4_layout_known,
    int4_pack,
    scales_zeros,
)
from hyla.model.vnni_int8 import (
    VnniInt8Matmul,
    int8_products_available,
    per_row_int8,
    vnni_int8_available,
)
from hyla.ops.hardware import checked_once
from hyla.perf import release_freed_memory

# "-a8": where fbgemm's int8 products run (decode batches), 8-bit rotated activations
# instead of 16-bit ones (WeightOnlyLinear.activation_bits)
SCHEMES = ("none", "int8", "int4", "int8-a8", "int4-a8")
# torch's packed kernels are matrix-vector products: their time grows with every row. Past a
# few rows a dense GEMM on the dequantised weight is faster. Where bf16 GEMMs are fast (AMX,
# AVX512-BF16) the dense weight is kept in bf16 once made, and wins from 8 rows (measured on
# SmolLM2's shapes: int4 59 against bf16 71 us at 4 rows, 131 against 108 at 8, 219 against
# 133 at 16). Elsewhere it is dequantised to fp32 for each call, which pays from 64 rows.
DENSE_BF16_MIN_ROWS = 8
KERNEL_MAX_ROWS = 64
# torch 2.13's CPU int8 kernel returns garbage (inf, 1e27) unless the input size is a multiple
# of 16 (found on an MoE's 40-wide shared expert): other sizes take the dense path.
INT8_KERNEL_K = 16
# Set while one sequence's drafts are verified as a decode batch (one_row_products): each
# row then takes the products it would take alone, so speculation's greedy tokens are plain
# decoding's. A list, so that the flag is read (and guarded by torch.compile) as a value.
_ONE_ROW = [False]


def one_row_active() -> bool:
    """Whether :class:`one_row_products` is on (layers other than the quantised ones that
    batch rows, an MoE's experts, then take them one at a time too)."""
    return _ONE_ROW[0]


class one_row_products:
    """Within it, every row of a quantised layer's input is computed as one row alone would
    be (torch's int4 kernel in bf16, or fbgemm's 16-bit products where one row takes them:
    both row for row the same whatever the batch), not by the 8-bit products of a decode
    batch. Speculative decoding's batched verify (:meth:`hyla.serve.runner.Runner.verify`)
    runs in it: batch products round differently from one row's, so a greedy choice at a
    near-tie would depend on the drafts."""

    def __init__(self, on: bool = True):
        self.on = on

    def __enter__(self):
        self.before, _ONE_ROW[0] = _ONE_ROW[0], self.on

    def __exit__(self, *exc):
        _ONE_ROW[0] = self.before


def _placeholder() -> torch.Tensor:
    return torch.empty(0, device="meta")


def _meta_concat(parts: list[torch.Tensor]) -> torch.Tensor:
    rows = sum(p.shape[0] for p in parts)
    return torch.empty(rows, *parts[0].shape[1:], dtype=parts[0].dtype, device="meta")


def _check_device(scheme: str, device: torch.device) -> None:
    # The packed kernels torch ships for CPU are the ones this module is tested with; the
    # CUDA ones take other packings and have not been run here.
    if device.type != "cpu":
        raise ValueError(f"--quantize {scheme}: weight-only {scheme} is implemented for CPU "
                         f"only, not {device.type}; serve with --quantize none on {device.type}")


@checked_once
def _dense_in_bf16() -> bool:
    from hyla.ops.hardware import fast_low_precision_matmul

    return fast_low_precision_matmul(torch.bfloat16, "cpu")


class WeightOnlyLinear(nn.Module):
    """What :class:`Int8Linear` and :class:`Int4Linear` share: a few rows (decode) through
    torch's packed kernel, in bf16 activations; many rows (prefill, wide batches) through a
    dense GEMM on the dequantised weight (kept in bf16 where bf16 is fast: memory for speed,
    made on first use, so a model that only decodes one row never holds it)."""

    in_features: int
    out_features: int
    # From how many rows (up to KERNEL_MAX_ROWS) fbgemm's int8 products (VnniInt8Matmul) take
    # over where they run: the output layer from one (set at quantisation), the others from
    # two where their own kernel is as fast for one row (it needs no int8 copy), from one
    # where it is not (fbgemm_min_rows: measured once on the CPU at hand).
    vnni_min_rows = 2
    # Whether int8_rows are the layer's own codes (Int8Linear), so that fbgemm computes
    # exactly its weight: only then does one row take fbgemm where fbgemm_min_rows says so,
    # and only then without VNNI. Others' codes are requantised (int4 groups onto one int8
    # scale a row), which on AVX2's 7-bit grid cost SmolLM2 +1.5% decode-path perplexity at
    # 16 rows (benchmarks/vnni_int8.py) for 11% more tokens/s: their own kernel stays.
    exact_int8_rows = False
    # The activations' bits in those products for decode batches: 16 (a row and its
    # residual) or 8 (rotated first, half the work: VnniInt8Matmul.eight_bit), set by
    # quantize_model's "-a8" schemes. Other rows (prompts) take 16 bits on the plain copy,
    # as without -a8: the two copies cost SmolLM2 about 110 MB.
    activation_bits = 16
    # the buffers a subclass registers besides ``bias``, and whether it has a ``group``:
    # what skeleton makes
    BUFFERS: tuple[str, ...] = ()
    grouped = False

    @classmethod
    def skeleton(cls, weight: torch.Tensor, bias: torch.Tensor | None,
                 group: int = INT4_GROUP) -> WeightOnlyLinear:
        """The layer ``cls(weight, bias, ...)`` would make, with no computation: its buffers
        are empty meta placeholders, for a saved quantised state to fill
        (:mod:`hyla.model.prepared`)."""
        m = cls.__new__(cls)
        nn.Module.__init__(m)
        for name in cls.BUFFERS:
            m.register_buffer(name, _placeholder())
        m.register_buffer("bias", None if bias is None else _placeholder())
        m.out_features, m.in_features = weight.shape
        if cls.grouped:
            m.group = group
        return m

    def _kernel(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def dequantized(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        raise NotImplementedError

    def int8_rows(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The weight as int8 codes with one scale per output row (what fbgemm takes)."""
        return per_row_int8(self.dequantized())

    # The copies below are made on first use (a model that only decodes one row never
    # holds them) or ahead by prepare_copies. Plain attributes: not in the state dict, not
    # moved by .to.
    def vnni_matmul(self, eight_bit: bool = False) -> VnniInt8Matmul:
        """fbgemm's packed int8 copy of the weight; ``eight_bit``: the rotated copy for 8-bit
        activations (:meth:`VnniInt8Matmul.eight_bit`)."""
        if eight_bit and not BlockHadamard.fits(self.in_features):
            return self.vnni_matmul()       # eight_bit keeps 16 bits there: the same copy
        key = "_vnni8" if eight_bit else "_vnni"
        vnni = self.__dict__.get(key)
        if vnni is None:
            vnni = self.__dict__[key] = (
                VnniInt8Matmul.eight_bit(self.dequantized()) if eight_bit
                else VnniInt8Matmul(*self.int8_rows()))
        return vnni

    def dense_bf16(self) -> torch.Tensor:
        """The dequantised weight in bf16, for many rows at a time."""
        dense = self.__dict__.get("_dense_bf16")
        if dense is None:
            dense = self.__dict__["_dense_bf16"] = self.dequantized(torch.bfloat16)
        return dense

    def eight_bit_only(self) -> bool:
        """Whether fbgemm takes only decode batches, 8-bit ("-a8" on requantised codes): the
        layer then never makes the 16-bit copy."""
        return self.activation_bits == 8 and not self.exact_int8_rows

    def int8_products_from(self) -> int:
        """From how many rows fbgemm's int8 products take this layer's matmul (up to
        ``KERNEL_MAX_ROWS``; more than that: never, so its int8 copy is never made)."""
        if self.exact_int8_rows:
            return min(self.vnni_min_rows, fbgemm_min_rows())
        if vnni_int8_available():
            return self.vnni_min_rows
        # requantised codes and a 7-bit grid: +1.5% perplexity for 11% speed
        return KERNEL_MAX_ROWS + 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        # the kind of products follows from the rows: as one row's, within one_row_products
        rows = 1 if _ONE_ROW[0] else flat.shape[0]
        # dtype checks before .to: a no-op conversion still costs a dispatch (~1 us), and a
        # decode step makes hundreds of these calls
        least = self.int8_products_from()
        # "-a8" takes 8-bit activations in decode batches alone, where the throughput is:
        # several sequences of one row each ([B, 1, in]). A prompt's rows keep 16 bits (they
        # set the state every later token reads), from the layer's own weights: a 16-bit
        # fbgemm copy for them alone cost SmolLM2 106 MB for short prompts' speed.
        decode_batch = rows > 1 and x.dim() > 1 and x.shape[-2] == 1
        eight_bit = self.activation_bits == 8 and decode_batch
        # (not more rows: fbgemm's int8 GEMM with the residual rows took 12.1 s against 9.8 s
        # for fp32 GEMMs on Granite-4.0-H-350M's 1K-token prefill, this AVX2 EPYC)
        if least <= rows <= KERNEL_MAX_ROWS and int8_products_available() and (
                eight_bit or not self.eight_bit_only()):
            y = self.vnni_matmul(eight_bit)(flat)
        elif rows >= DENSE_BF16_MIN_ROWS and _dense_in_bf16() and int4_layout_known():
            y = F.linear(flat if flat.dtype is torch.bfloat16 else flat.to(torch.bfloat16),
                         self.dense_bf16())
        elif rows > KERNEL_MAX_ROWS and int4_layout_known():
            y = F.linear(flat, self.dequantized(x.dtype))
        else:
            y = self._kernel(flat if flat.dtype is torch.bfloat16 else flat.to(torch.bfloat16))
        if y.dtype is not x.dtype:
            y = y.to(x.dtype)
        if self.bias is not None:
            y = y + self.bias
        return y.view(*x.shape[:-1], self.out_features)


@checked_once
def fbgemm_min_rows() -> int:
    """1 where fbgemm's int8 products beat torch's int8 kernel (bf16 activations) on one row
    by 1.5x or more on this CPU, else 2: timed once, on a 1,024 x 1,024 weight (a few ms).
    An AVX2 CPU without fast bf16: 1 (10-30x); AVX512 with VNNI and bf16: 2 (about equal,
    and the kernel needs no second copy)."""
    import time

    if not int8_products_available():
        return 2
    g = torch.Generator().manual_seed(0)
    codes, scales = per_row_int8(torch.randn(1024, 1024, generator=g))
    x = torch.randn(1, 1024, generator=g)
    xb, sb, fb = x.bfloat16(), scales.bfloat16(), VnniInt8Matmul(codes, scales)

    def best(fn) -> float:
        fn()
        times = []
        for _ in range(5):
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
        return min(times)
    own = best(lambda: torch._weight_int8pack_mm(xb, codes, sb))
    return 1 if best(lambda: fb(x)) * 1.5 <= own else 2


class Int8Linear(WeightOnlyLinear):
    """``y = x @ dequant(W).T + b`` with W int8 [out, in] and one bf16 scale per output row."""

    exact_int8_rows = True
    BUFFERS = ("qweight", "scales")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None,
                 rows: tuple[torch.Tensor, torch.Tensor] | None = None):
        """``rows``: ``per_row_int8(weight)`` when already made (a tied embedding's)."""
        super().__init__()
        codes, scale = rows if rows is not None else per_row_int8(weight)
        self.register_buffer("qweight", codes)
        self.register_buffer("scales", scale.to(torch.bfloat16))
        self.register_buffer("bias", None if bias is None else bias.detach().clone())
        self.out_features, self.in_features = codes.shape

    def vnni_matmul(self, eight_bit: bool = False) -> VnniInt8Matmul:
        vnni = super().vnni_matmul(eight_bit)
        if not eight_bit and self.qweight is not None and fbgemm_min_rows() == 1 \
                and not _dense_in_bf16():
            # fbgemm's packed copy now serves every row count (from one row, and prefill
            # dequantises from it): the layer's own codes would be a second copy of the
            # weight (Granite-4.0-H-350M: 350 MB)
            self.qweight = None
        return vnni

    def _unpacked(self) -> torch.Tensor:
        """The weight as fbgemm holds it (a quantised tensor), once the codes are dropped."""
        return torch.ops.quantized.linear_unpack(self.__dict__["_vnni"].packed)[0]

    def int8_rows(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.qweight is None:
            return self._unpacked().int_repr(), self.scales.float()
        return self.qweight, self.scales.float()

    def _kernel(self, x: torch.Tensor) -> torch.Tensor:
        if self.in_features % INT8_KERNEL_K or self.qweight is None:
            return F.linear(x, self.dequantized(x.dtype))
        return torch._weight_int8pack_mm(x, self.qweight, self.scales)

    def dequantized(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        if self.qweight is None:
            return self._unpacked().dequantize().to(dtype)
        return (self.qweight.float() * self.scales.float()[:, None]).to(dtype)


def machine_layout() -> tuple:
    """What the quantised modules' classes and packed layouts depend on besides shapes: the
    int4 packing's block on this CPU and whether fbgemm's int8 products (and VNNI) run.
    Prepared weights (:mod:`hyla.model.prepared`) are kept per layout."""
    return int4_block_n(), int8_products_available(), vnni_int8_available()


class Int4Linear(WeightOnlyLinear):
    """Weights as 4-bit codes in groups along the input: ``w = (q - 8) * scale + zero``."""

    BUFFERS = ("packed", "scales_zeros")
    grouped = True

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, group: int = INT4_GROUP):
        super().__init__()
        groups, lo, hi = group_ranges(weight, group)
        n, k = weight.shape
        # The kernel takes bf16 scales and zeros: round them first and choose the codes
        # against the rounded values, or the rounding of the zero alone costs a step.
        scale = ((hi - lo) / 15).clamp(min=1e-12).to(torch.bfloat16).float()
        zero = (lo + 8 * scale).to(torch.bfloat16).float()   # the kernel centres codes on 8
        codes = (groups - zero[..., None]).div_(scale[..., None]).add_(8).round_().clamp_(0, 15)
        self.register_buffer("packed", int4_pack(codes.view(n, k)))
        self.register_buffer("scales_zeros", scales_zeros(scale, zero))   # [k / group, n, 2]
        self.register_buffer("bias", None if bias is None else bias.detach().clone())
        self.in_features, self.out_features, self.group = k, n, group

    def _kernel(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.packed, self.group,
                                                           self.scales_zeros)

    def dequantized(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return int4_dequantized(self.packed, self.scales_zeros, self.out_features,
                                 self.in_features, self.group).to(dtype)


class Int8GroupLinear(WeightOnlyLinear):
    """8-bit codes in groups of 32 along the input, ``w = scale * q + offset``, run as two
    4-bit halves (``q = 16 h + l``) through torch's int4 kernel: on SmolLM2's 49,152 x 576
    output layer the two passes take 3.8 ms a token against 5.2 ms for torch's int8 kernel
    (one thread, the weight alone; within a whole decode step, where it comes from memory,
    the two measure about the same), at 8 bits per weight and a finer grid than one scale
    per row."""

    BUFFERS = ("high", "low", "highscales_zeros", "lowscales_zeros")
    grouped = True

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, group: int = INT4_GROUP):
        super().__init__()
        groups, lo, hi = group_ranges(weight, group)
        n, k = weight.shape
        # 253 steps over the range, not 255, and the scale rounded up: the bf16 rounding of
        # the scale (over 255 steps) and of the zero must not push a weight off the grid
        scale = ((hi - lo) / 253 * (1 + 2 ** -7)).clamp(min=1e-12).to(torch.bfloat16).float()
        # the kernel centres each half's codes on 8: the halves add -8 * (16 + 1) * scale,
        # which the high half's zero gives back (the low half's zero is 0); code 1 is lo.
        # Codes are chosen against the bf16-rounded zero, as Int4Linear does.
        zero = (lo + 135 * scale).to(torch.bfloat16).float()
        codes = (groups - (zero - 136 * scale)[..., None]).div_(scale[..., None]).round_()
        codes = codes.clamp_(0, 255).view(n, k).to(torch.int32)
        self.register_buffer("high", int4_pack(codes >> 4))
        self.register_buffer("low", int4_pack(codes & 15))
        self.register_buffer("highscales_zeros", scales_zeros(16 * scale, zero))
        self.register_buffer("lowscales_zeros", scales_zeros(scale, torch.zeros_like(zero)))
        self.register_buffer("bias", None if bias is None else bias.detach().clone())
        self.in_features, self.out_features, self.group = k, n, group

    def _kernel(self, x: torch.Tensor) -> torch.Tensor:
        mm = torch.ops.aten._weight_int4pack_mm_for_cpu
        return (mm(x, self.high, self.group, self.highscales_zeros)
                + mm(x, self.low, self.group, self.lowscales_zeros))

    def dequantized(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        shape = self.out_features, self.in_features, self.group
        return (int4_dequantized(self.high, self.highscales_zeros, *shape)
                + int4_dequantized(self.low, self.lowscales_zeros, *shape)).to(dtype)


class Int8Embedding(nn.Module):
    """An embedding table as int8 rows with one scale each (looked up, then scaled)."""

    def __init__(self, weight: torch.Tensor,
                 rows: tuple[torch.Tensor, torch.Tensor] | None = None):
        super().__init__()
        codes, scale = rows if rows is not None else per_row_int8(weight)
        self.register_buffer("qweight", codes)
        self.register_buffer("scales", scale)
        self.dtype = weight.dtype
        self.num_embeddings, self.embedding_dim = codes.shape

    @classmethod
    def skeleton(cls, weight: torch.Tensor) -> Int8Embedding:
        """The table ``cls(weight)`` would make, its buffers empty meta placeholders
        (:meth:`WeightOnlyLinear.skeleton`)."""
        m = cls.__new__(cls)
        nn.Module.__init__(m)
        m.register_buffer("qweight", _placeholder())
        m.register_buffer("scales", _placeholder())
        m.dtype = weight.dtype
        m.num_embeddings, m.embedding_dim = weight.shape
        return m

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


def prepare_copies(model: nn.Module) -> int:
    """Make now the copies each quantised layer of ``model`` would make on first use (the
    int8 one for fbgemm's products, the dense bf16 one for prefill), so that no request
    pays for them: about a second for SmolLM2-135M, which a server spends after it is ready
    rather than on some client's first long prompt. Returns how many layers it prepared."""
    # the checks forward makes, answered now: a compiled step then sees constants
    int8_products_available(), fbgemm_min_rows(), _dense_in_bf16(), int4_layout_known()
    layers = [m for m in model.modules() if isinstance(m, WeightOnlyLinear)]
    output = getattr(model, "lm_head", None)
    for m in layers:
        # only where forward takes them: without VNNI, int4 layers' requantised codes never
        # do, and their copies cost SmolLM2 ~215 MB for nothing (this AVX2 EPYC)
        if int8_products_available() and m.int8_products_from() <= KERNEL_MAX_ROWS:
            if not m.eight_bit_only():
                m.vnni_matmul()
            if m.activation_bits == 8:
                m.vnni_matmul(eight_bit=True)
        # not the output layer's: a prompt needs its logits at the last row alone (scored
        # prompts make it on first use); SmolLM2's cost 57 MB
        if _dense_in_bf16() and int4_layout_known() and m is not output:
            m.dense_bf16()
    release_freed_memory()        # codes the packed copies replaced (Int8Linear.vnni_matmul)
    return len(layers)


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
    quantised ones. ``scheme``: ``none`` (nothing happens), ``int8`` or ``int4``; with
    ``-a8`` (``int4-a8``), decode batches' products take 8-bit rotated activations.

    Raises ValueError naming the scheme for an unknown scheme or a device without kernels.
    """
    report = _quantize_in_place(model, scheme, group)
    # the float weights just dropped, once nothing of the work holds them (its locals kept
    # SmolLM2's 113 MB float embedding alive): give their pages back
    release_freed_memory()
    return report


def quantized_skeleton(model: nn.Module, scheme: str, *, group: int = INT4_GROUP) -> nn.Module:
    """``model`` (on the meta device) with the modules :func:`quantize_model` would put in
    it, computing nothing: their tensors are empty meta placeholders, for a saved quantised
    state to fill (:mod:`hyla.model.prepared`). Which module each layer becomes depends on
    shapes and on this machine alone, as in :func:`quantize_model`."""
    _quantize_in_place(model, scheme, group, skeleton=True)
    return model


def _quantize_in_place(model: nn.Module, scheme: str, group: int, *,
                       skeleton: bool = False) -> QuantReport:
    if scheme not in SCHEMES:
        raise ValueError(f"--quantize: unknown scheme {scheme!r}; choose from {SCHEMES}")
    before = _tensor_bytes(model)
    if scheme == "none":
        return QuantReport(scheme, 0, 0, before, before)
    weights, eight_bit = scheme.removesuffix("-a8"), scheme.endswith("-a8")
    first = next(model.parameters(), None)
    if first is not None and not skeleton:
        _check_device(scheme, first.device)
    if eight_bit and not vnni_int8_available():
        raise ValueError(f"--quantize {scheme}: 8-bit activations run through fbgemm's int8 "
                         f"x int8 products, which need AVX512-VNNI, and this CPU (or torch "
                         f"build) has none; use --quantize {weights}")
    if model.training:
        model.eval()
    # a tied output layer and embedding share one int8 copy (SmolLM2: 28 MB, 0.17 s)
    int8_of: dict[int, tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]] = {}

    def int8_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if id(weight) not in int8_of:         # the weight kept alive: its id stays its own
            int8_of[id(weight)] = weight, per_row_int8(weight)
        return int8_of[id(weight)][1]

    def build(cls, weight: torch.Tensor, bias: torch.Tensor | None, *,
              rows: bool = False) -> nn.Module:
        if skeleton:
            return cls.skeleton(weight, bias, group)
        if cls is Int8Linear:
            return cls(weight, bias, int8_rows(weight) if rows else None)
        return cls(weight, bias, group)

    def make(weight: torch.Tensor, bias: torch.Tensor | None, name: str = "") -> nn.Module:
        # The output layer keeps 8 bits under int4, as llama.cpp's 4-bit files keep it at 6-8
        # bits: each of its errors lands directly on a logit (4 bits there cost SmolLM2 4%
        # perplexity). Per row through fbgemm (int8 x int8 from one row: 4x faster with
        # VNNI, 16x on AVX2 alone; vnni_int8's doc), else in groups through the int4 kernel:
        # faster than torch's int8 kernel.
        fits = int4_fits(weight, group)
        if name == "lm_head":
            if int8_products_available():
                head = build(Int8Linear, weight, bias, rows=True)
                head.vnni_min_rows = 1
                return head
            return build(Int8GroupLinear if fits else Int8Linear, weight, bias)
        return build(Int4Linear if weights == "int4" and fits else Int8Linear, weight, bias)

    # on meta tensors torch.cat would import torch._dynamo (seconds): a skeleton needs only
    # the fused weight's shape
    concat = _meta_concat if skeleton else torch.cat
    replaced = 0
    for parent in list(model.modules()):
        replaced += fuse_siblings(parent, make, concat)
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            # An MoE router stays as it is: it reads its weight directly, in float32, since
            # its top-k choices flip on small errors.
            if isinstance(child, nn.Linear) and name != "router":
                setattr(parent, name, make(child.weight, child.bias, name))
                replaced += 1
            elif isinstance(child, nn.Embedding):
                setattr(parent, name, Int8Embedding.skeleton(child.weight) if skeleton else
                        Int8Embedding(child.weight, int8_rows(child.weight)))
    int4 = sum(isinstance(m, Int4Linear) for m in model.modules())
    if eight_bit:
        for m in model.modules():
            if isinstance(m, WeightOnlyLinear):
                m.activation_bits = 8
    model.requires_grad_(False)
    model.quantized = scheme  # what checkpoint writers and trainers check before they run
    return QuantReport(scheme, replaced, int4, before, _tensor_bytes(model))
