"""torch's CPU int4 packing (``aten._convert_weight_to_int4pack_for_cpu``) read and written
in groups: packing codes, finding the layout this CPU's kernel uses, and unpacking it again
for the dense path and for checks. Used by :mod:`hyla.model.quantize`."""

from __future__ import annotations

import functools

import torch

from hyla.ops.hardware import checked_once

INT4_GROUP = 32
# The CPU int4 packing for out_features % 64 == 0: per block of N output rows and per input
# column, N / 2 bytes whose low nibbles are the block's first N / 2 rows and high nibbles the
# rest. N is the kernel's vector width: 64 where torch's kernel is built for AVX-512, 32 on
# AVX2-only CPUs (found on an AMD EPYC without AVX-512: int4_block_n measures it).
INT4_BLOCK_N = 64


def int4_fits(weight: torch.Tensor, group: int = INT4_GROUP) -> bool:
    """Whether the CPU int4 kernel takes a weight of this shape ([out, in])."""
    out_features, in_features = weight.shape
    return (in_features % group == 0 and in_features >= 2 * group
            and out_features % INT4_BLOCK_N == 0)


def unpack_int4(packed: torch.Tensor, n: int, k: int, block: int | None = None
                ) -> torch.Tensor:
    """The [n, k] codes of a packed weight (the layout in ``INT4_BLOCK_N``'s comment)."""
    block = block or int4_block_n() or INT4_BLOCK_N
    blocks = packed.view(n // block, k, block // 2)
    codes = torch.cat([blocks & 15, blocks >> 4], dim=-1)           # [n / block, k, block]
    return codes.transpose(1, 2).reshape(n, k)


@functools.cache
def int4_block_n() -> int | None:
    """The rows a block of torch's CPU int4 packing holds on this CPU, found by unpacking a
    probe; None when no layout known here fits (then only the kernel reads the codes)."""
    codes = torch.randint(0, 16, (2 * INT4_BLOCK_N, 2 * INT4_GROUP), dtype=torch.int32,
                          generator=torch.Generator().manual_seed(0))
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
    if packed.shape != (codes.shape[0], codes.shape[1] // 2):
        return None
    return next((b for b in (INT4_BLOCK_N, INT4_BLOCK_N // 2) if torch.equal(
        unpack_int4(packed, *codes.shape, block=b).to(torch.int32), codes)), None)


@checked_once
def int4_layout_known() -> bool:
    # The packing is torch's internal choice: check once that it is one unpacked here, and
    # otherwise keep to the kernel (slower for prefill, never wrong).
    return int4_block_n() is not None


def group_ranges(weight: torch.Tensor, group: int):
    """A weight [n, k] as float groups [n, k / group, group] and each group's min and max."""
    w = weight.detach().float()
    n, k = w.shape
    groups = w.view(n, k // group, group)
    return groups, groups.amin(-1), groups.amax(-1)


def int4_pack(codes: torch.Tensor) -> torch.Tensor:
    return torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), 1)


def scales_zeros(scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """[n, groups] scales and zeros as the int4 kernel takes them: [groups, n, 2] bf16."""
    return torch.stack([scale, zero], -1).transpose(0, 1).contiguous().to(torch.bfloat16)


def int4_dequantized(packed: torch.Tensor, scales_zeros: torch.Tensor, n: int, k: int,
                      g: int) -> torch.Tensor:
    """What the int4 kernel multiplies by: ``(code - 8) * scale + zero``, [n, k] float32."""
    codes = unpack_int4(packed, n, k).float().view(n, k // g, g) - 8
    scale, zero = scales_zeros.float().transpose(0, 1).unbind(-1)          # [n, k / g]
    return (codes * scale[..., None] + zero[..., None]).view(n, k)
