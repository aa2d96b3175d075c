"""Row sharding, owner assignment and byte accounting for distributed Muon.

Sharding (ZeRO-2 style, as after a reduce-scatter of the gradients): a matrix with ``A`` rows
is split along dim 0 into ``world`` slices of ``s = ceil(A / world)`` rows; rank ``r`` holds
rows ``[r*s, min((r+1)*s, A))``, zero-padded to ``s`` rows so every slice has one shape.
Momentum buffers are sharded the same way; parameters are replicated (DistMuon) or FSDP2
shards, which ``fully_shard`` cuts along dim 0 into exactly these rows (ShardedMuon).

Bytes are *logical*: what leaves (sent) or enters (received) a rank, its own slice excluded.
A ring all-gather or a pairwise all-to-all moves exactly that much through each rank's link.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from hyla.train.optim.muon import ns_flops

STRATEGIES = ("all_gather", "all_to_all")


def rows_per_rank(n_rows: int, world: int) -> int:
    """Rows of every rank's (padded) slice.

    Example:
        >>> rows_per_rank(10, 4)
        3
    """
    if world < 1:
        raise ValueError(f"world must be >= 1, got {world}")
    return -(-n_rows // world)


def row_range(n_rows: int, rank: int, world: int) -> tuple[int, int]:
    """The real (unpadded) rows ``[lo, hi)`` rank ``rank`` holds; empty past the end.

    Example:
        >>> [row_range(10, r, 4) for r in range(4)]
        [(0, 3), (3, 6), (6, 9), (9, 10)]
    """
    if not 0 <= rank < world:
        raise ValueError(f"rank must be in [0, {world}), got {rank}")
    s = rows_per_rank(n_rows, world)
    return min(rank * s, n_rows), min((rank + 1) * s, n_rows)


def shard_rows(t: Tensor, rank: int, world: int) -> Tensor:
    """Rank ``rank``'s slice of ``t`` along dim 0, zero-padded to ``rows_per_rank`` rows.

    Example:
        >>> shard_rows(torch.arange(5.)[:, None], 1, 2).flatten().tolist()
        [3.0, 4.0, 0.0]
    """
    lo, hi = row_range(t.size(0), rank, world)
    out = t.new_zeros((rows_per_rank(t.size(0), world), *t.shape[1:]))
    out[: hi - lo] = t[lo:hi]
    return out


def assign_owners(shapes: Sequence[tuple[int, int]], world: int, ns_steps: int = 5) -> list[int]:
    """Owner rank of each matrix: longest-processing-time-first on Newton-Schulz FLOPs.

    Greedy LPT keeps the busiest rank within 4/3 of the optimum; ties go to the lowest rank,
    so every rank computes the same plan without talking.

    Example:
        >>> assign_owners([(8, 8), (8, 8), (4, 4)], 2)
        [0, 1, 0]
    """
    load = [0] * world
    owners = [0] * len(shapes)
    order = sorted(range(len(shapes)), key=lambda i: (-ns_flops(shapes[i], ns_steps), i))
    for i in order:
        r = min(range(world), key=lambda k: (load[k], k))
        owners[i] = r
        load[r] += ns_flops(shapes[i], ns_steps)
    return owners


def planned_traffic(shapes: Sequence[tuple[int, int]], world: int, strategy: str,
                    element_size: int = 4, ns_steps: int = 5) -> list[dict[str, int]]:
    """Per-rank optimizer bytes and NS FLOPs of one step, without running anything.

    Returns one ``{"sent", "received", "ns_flops"}`` dict per rank: what
    :class:`hyla.train.optim.dist_muon.DistMuon` counts, so it extrapolates to shapes too big to
    run here.

    Example:
        >>> planned_traffic([(4, 4)], 2, "all_gather")[0]["sent"]  # 2 rows of 4 fp32 to 1 peer
        32
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
    shard = [rows_per_rank(a, world) * b * element_size for a, b in shapes]
    flops = [ns_flops(s, ns_steps) for s in shapes]
    if strategy == "all_gather":
        row = {"sent": (world - 1) * sum(shard), "received": (world - 1) * sum(shard),
               "ns_flops": sum(flops)}
        return [dict(row) for _ in range(world)]
    owners = assign_owners(shapes, world, ns_steps)
    out = []
    for r in range(world):
        others = sum(n for n, o in zip(shard, owners, strict=True) if o != r)
        mine = sum(n for n, o in zip(shard, owners, strict=True) if o == r)
        # Two exchanges: slices to owners, orthogonalised slices back. Each is symmetric.
        moved = others + (world - 1) * mine
        out.append({"sent": moved, "received": moved,
                    "ns_flops": sum(f for f, o in zip(flops, owners, strict=True) if o == r)})
    return out


class CommCounter:
    """Issues collectives and counts their logical bytes per category (see module docstring).

    Example:
        >>> c = CommCounter()
        >>> c.add("optimizer", sent=8, received=8)
        >>> c.totals()["optimizer"]["sent"]
        8
    """

    def __init__(self, group: dist.ProcessGroup | None = None):
        self.group = group
        self._totals: dict[str, dict[str, int]] = defaultdict(
            lambda: {"sent": 0, "received": 0, "calls": 0})

    def add(self, category: str, *, sent: int, received: int) -> None:
        row = self._totals[category]
        row["sent"] += sent
        row["received"] += received
        row["calls"] += 1

    def totals(self) -> dict[str, dict[str, int]]:
        return {k: dict(v) for k, v in self._totals.items()}

    def reset(self) -> None:
        self._totals.clear()

    def all_gather(self, flat: Tensor, category: str) -> list[Tensor]:
        """Every rank's ``flat`` (equal sizes), in rank order."""
        world = dist.get_world_size(self.group)
        out = [torch.empty_like(flat) for _ in range(world)]
        dist.all_gather(out, flat.contiguous(), group=self.group)
        n = (world - 1) * flat.numel() * flat.element_size()
        self.add(category, sent=n, received=n)
        return out

    def all_to_all(self, flat: Tensor, send_sizes: list[int], recv_sizes: list[int],
                   category: str) -> Tensor:
        """Send ``flat``'s consecutive chunks of ``send_sizes`` elements to ranks 0, 1, ..."""
        rank = dist.get_rank(self.group)
        out = flat.new_empty(sum(recv_sizes))
        dist.all_to_all_single(out, flat.contiguous(), recv_sizes, send_sizes, group=self.group)
        size = flat.element_size()
        self.add(category, sent=(sum(send_sizes) - send_sizes[rank]) * size,
                 received=(sum(recv_sizes) - recv_sizes[rank]) * size)
        return out


def count_fsdp_traffic(model: torch.nn.Module, counter: CommCounter) -> None:
    """Count the all-gathers and reduce-scatters of ``model``'s FSDP2 modules in ``counter``
    (category ``"fsdp"``), through FSDP2's custom-collective hooks (the same collectives).

    A rank sends its shard to the W - 1 others in an all-gather and (W - 1)/W of its full
    gradient buffer in a reduce-scatter; the bytes are the buffers' own (bf16 parameters
    under mixed precision, the reduce dtype for gradients).
    """
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import (
        DefaultAllGather,
        DefaultReduceScatter,
    )

    class Gather(AllGather):
        inner = DefaultAllGather()

        def allocate(self, size, *, dtype, device):
            return self.inner.allocate(size, dtype=dtype, device=device)

        def __call__(self, output_tensor, input_tensor, group, async_op=False):
            n = ((dist.get_world_size(group) - 1) * input_tensor.numel()
                 * input_tensor.element_size())
            counter.add("fsdp", sent=n, received=n)
            return self.inner(output_tensor, input_tensor, group, async_op)

    class Scatter(ReduceScatter):
        inner = DefaultReduceScatter()

        def allocate(self, size, *, dtype, device):
            return self.inner.allocate(size, dtype=dtype, device=device)

        def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
            n = (input_tensor.numel() - output_tensor.numel()) * input_tensor.element_size()
            counter.add("fsdp", sent=n, received=n)
            return self.inner(output_tensor, input_tensor, group, op, async_op)

    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_custom_all_gather(Gather())
            m.set_custom_reduce_scatter(Scatter())
