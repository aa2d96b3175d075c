"""Muon on FSDP2-sharded parameters: each rank holds row slices (``DTensor``, ``Shard(0)``).

FSDP2 cuts a matrix ``[A, B]`` along dim 0 the way ``torch.chunk`` does: rank ``r`` holds rows
``[r*s, min((r+1)*s, A))`` with ``s = ceil(A / W)``, which is exactly
:func:`hyla.train.optim.comm.row_range`. So the reduce-scattered gradient FSDP leaves in
``p.grad.to_local()`` is the row slice :class:`~hyla.train.optim.dist_muon.DistMuon` works on: the
momentum is updated on the slice (elementwise), every matrix goes whole to one owner rank
(``assign_owners``: largest first, to the least loaded rank) with one all-to-all, the owner
runs Newton-Schulz, and one all-to-all brings every rank its rows of the update. Each rank
then updates its own shard in place: no parameter gather is needed, FSDP gathers the
parameters itself before the next forward.

The momentum buffer is a ``DTensor`` sharded like its parameter, so a distributed checkpoint
(DCP) saves it as one logical matrix and a resume at another world size reshards it.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor

from hyla.train.optim.comm import row_range
from hyla.train.optim.dist_muon import DistMuon
from hyla.train.optim.muon import momentum_update, update_scale


def local(t: Tensor) -> Tensor:
    """This rank's part of ``t``: the local shard of a DTensor, else ``t`` itself (a view:
    in-place changes reach the parameter).

    Example:
        >>> local(torch.ones(2)).tolist()
        [1.0, 1.0]
    """
    return t.to_local() if isinstance(t, DTensor) else t


class ShardedMuon(DistMuon):
    """Muon for FSDP2 parameters sharded by rows; the same update as single-process Muon.

    ``params`` are ``DTensor`` matrices with placement ``Shard(0)`` on a one-dimensional mesh
    whose process group is ``group`` (plain tensors work too, as on one rank). Keyword
    arguments are :class:`~hyla.train.optim.dist_muon.DistMuon`'s (``strategy``, ``lr``,
    ``momentum``, ``weight_decay``, ``ns_dtype``, ``comm_dtype``...); ``counter`` holds the
    bytes this rank sent and received, ``comm_per_step()`` their mean per step.

    Example (a one-rank gloo group; under ``torchrun`` the parameters are FSDP2 shards):
        >>> import tempfile
        >>> import torch.distributed as dist
        >>> store = dist.FileStore(tempfile.mktemp(), 1)
        >>> dist.init_process_group("gloo", store=store, rank=0, world_size=1)
        >>> w = torch.nn.Parameter(torch.randn(8, 4)); w.grad = torch.randn(8, 4)
        >>> before = w.detach().clone()
        >>> ShardedMuon([w]).step()
        >>> dist.destroy_process_group(); bool((w != before).any())
        True
    """

    def __init__(self, params, **kwargs):
        if kwargs.pop("sync_params", False):
            raise ValueError("ShardedMuon updates shards in place: sync_params must be False")
        super().__init__(params, sync_params=False, **kwargs)

    def _range(self, i: int) -> tuple[int, int]:
        return row_range(self._shapes[i][0], self.rank, self.world)

    @torch.no_grad()
    def step(self, closure=None):  # type: ignore[override]
        """One update of every matrix from its (reduce-scattered) gradient shard."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        groups = [g for g in self.param_groups for _ in g["params"]]
        u = []
        for i, p in enumerate(self._params):
            if p.grad is None:
                raise ValueError(f"parameter {i} of shape {tuple(p.shape)} has no gradient: "
                                 f"every Muon matrix must take part in the loss")
            g = local(p.grad)
            lo, hi = self._range(i)
            if g.shape[0] != hi - lo:   # a placement other than FSDP2's Shard(0)
                raise ValueError(f"parameter {i} of shape {tuple(p.shape)}: this rank holds "
                                 f"{g.shape[0]} rows, expected rows [{lo}, {hi}) of a "
                                 f"Shard(0) placement over {self.world} ranks")
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(p)  # sharded like p
            x = momentum_update(g, local(state["momentum_buffer"]), groups[i]["momentum"],
                                groups[i]["nesterov"])
            padded = x.new_zeros(self._rows[i], self._shapes[i][1])  # equal sizes for the exchange
            padded[: hi - lo] = x
            u.append(padded.to(self.comm_dtype) if self.comm_dtype is not None else padded)
        slices = self._all_gather(u) if self.strategy == "all_gather" else self._all_to_all(u)
        for i, (p, o) in enumerate(zip(self._params, slices, strict=True)):
            lo, hi = self._range(i)
            w, group = local(p), groups[i]
            w.mul_(1 - group["lr"] * group["weight_decay"])
            w.add_(o[: hi - lo].to(w.dtype), alpha=-group["lr"] * update_scale(p.shape))
        self.steps += 1
        return loss
