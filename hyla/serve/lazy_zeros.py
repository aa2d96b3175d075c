"""Zeros that cost resident memory only as they are written: the engine's KV reservation."""

from __future__ import annotations

import torch


def lazy_zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Zeros whose pages the OS maps only when first written, so a large KV reservation
    costs resident memory only as blocks fill. An anonymous mmap of its own, not ``calloc``:
    calloc may hand back memory the process freed (the float weights quantisation dropped)
    and must then zero it, all resident. Off the CPU, plain zeros."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    import math
    import mmap

    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    pages = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(pages, dtype=dtype).view(shape)   # the tensor keeps the map
