"""What the hardware multiplies quickly: decides when low precision is worth it."""

from __future__ import annotations

import torch


def fast_low_precision_matmul(dtype: torch.dtype, device: torch.device | str) -> bool:
    """True where ``dtype`` (bf16/fp16) GEMMs beat fp32: GPUs, and CPUs with AMX/AVX512-BF16.

    Elsewhere they are emulated: on an AMD EPYC without those units, bf16 matmuls measured
    about 1 GFLOP/s against 100+ for fp32, so fp32 is both faster and more accurate.

    Example:
        >>> fast_low_precision_matmul(torch.float32, "cpu")
        True
    """
    device = torch.device(device)
    if dtype == torch.float32 or device.type != "cpu":
        return True
    if dtype == torch.bfloat16:
        return torch.cpu._is_amx_tile_supported() or torch.cpu._is_avx512_bf16_supported()
    if dtype == torch.float16:
        return torch.cpu._is_amx_fp16_supported()
    return False
