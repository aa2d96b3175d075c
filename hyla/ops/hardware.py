"""What the hardware multiplies quickly: decides when low precision is worth it."""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch


def checked_once(check: Callable[[], bool]) -> Callable[[], bool]:
    """``check()`` run on the first call only, its answer kept. Unlike ``functools.cache``,
    ``torch.compile`` sees a kept answer as a constant (it traces through a cache's wrapper
    and would run the check, or break the graph on it, in every compiled step), without
    importing the compiler at import time as ``torch.compiler.assume_constant_result``
    does (a second on start-up). Make the first call before compiling.

    Example:
        >>> calls = []
        >>> ready = checked_once(lambda: calls.append(1) or True)
        >>> ready(), ready(), len(calls)
        (True, True, 1)
    """
    answer: list[bool] = []

    @functools.wraps(check)
    def once() -> bool:
        if not answer:
            answer.append(bool(check()))
        return answer[0]
    return once


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
