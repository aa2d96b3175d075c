"""Muon with row-sharded gradients over ``torch.distributed`` (gloo on CPU, NCCL on GPU).

Each rank holds a row slice of every matrix's gradient and momentum (see
:mod:`hyla.train.optim.comm` for the layout). Muon needs each *whole* matrix, so two strategies:

- ``"all_gather"``: every rank gathers every momentum-updated matrix, orthogonalises all of
  them and keeps its own rows. Traffic per rank ~ (W-1)/W of all matrices; every rank does
  all the Newton-Schulz work.
- ``"all_to_all"``: every matrix has one owner rank (balanced on NS FLOPs). One all-to-all
  sends the slices to the owners, each owner orthogonalises its whole matrices (equal shapes
  batched), a second all-to-all returns the slices. Traffic per rank ~ 2 (W-1)/W^2 of all
  matrices, i.e. W/2 times less; NS work split W ways.

Both then update their rows of each (replicated) parameter and, with ``sync_params``,
all-gather the rows so every replica matches; that step is the same for both strategies (a
ZeRO trainer does it anyway) and is counted apart, under ``"param_sync"``.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from hyla.train.optim.comm import (
    STRATEGIES,
    CommCounter,
    assign_owners,
    row_range,
    rows_per_rank,
    shard_rows,
)
from hyla.train.optim.muon import (
    NS_EPS,
    check_hyperparameters,
    momentum_update,
    newton_schulz,
    ns_flops,
    update_scale,
)


class DistMuon(torch.optim.Optimizer):
    """Muon over ``world`` ranks with row-sharded gradients; same result as :class:`Muon`.

    ``step(grad_shards)`` takes this rank's padded row slice of each parameter's gradient
    (``[ceil(A / world), B]``, in parameter order, e.g. from a reduce-scatter); without it the
    slice is cut from ``p.grad`` (a full, already averaged gradient). ``comm_dtype`` (default:
    the gradient's) is what travels; ``counter`` holds the bytes, ``ns_flops_total`` the NS
    FLOPs.

    Example (a one-rank gloo group; with W ranks each passes its own shards):
        >>> import tempfile
        >>> store = dist.FileStore(tempfile.mktemp(), 1)
        >>> dist.init_process_group("gloo", store=store, rank=0, world_size=1)
        >>> w = torch.nn.Parameter(torch.randn(8, 4)); w.grad = torch.randn(8, 4)
        >>> before = w.detach().clone()
        >>> DistMuon([w], strategy="all_to_all").step([shard_rows(w.grad, 0, 1)])
        >>> dist.destroy_process_group(); bool((w != before).any())
        True
    """

    def __init__(self, params: Iterable[Tensor] | Iterable[dict], *,
                 strategy: str = "all_to_all", group: dist.ProcessGroup | None = None,
                 lr: float = 0.02, momentum: float = 0.95, nesterov: bool = True,
                 ns_steps: int = 5, weight_decay: float = 0.0,
                 ns_dtype: torch.dtype = torch.bfloat16, comm_dtype: torch.dtype | None = None,
                 sync_params: bool = True, eps: float = NS_EPS):
        if strategy not in STRATEGIES:
            raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
        check_hyperparameters(lr, momentum, ns_steps, weight_decay)
        if not dist.is_initialized():
            raise ValueError("DistMuon needs an initialised torch.distributed process group")
        defaults = dict(lr=lr, momentum=momentum, nesterov=nesterov, weight_decay=weight_decay)
        super().__init__(params, defaults)
        self.strategy, self.group, self.sync_params = strategy, group, sync_params
        self.ns_steps, self.ns_dtype, self.eps = ns_steps, ns_dtype, eps
        self.comm_dtype = comm_dtype
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        self._params = [p for g in self.param_groups for p in g["params"]]
        for p in self._params:
            if p.ndim != 2:
                raise ValueError(f"params must all be 2-D matrices, got one of shape "
                                 f"{tuple(p.shape)}: route it to AdamW")
        self._shapes = [tuple(p.shape) for p in self._params]
        self._rows = [rows_per_rank(a, self.world) for a, _ in self._shapes]
        self.owners = assign_owners(self._shapes, self.world, ns_steps)
        self.counter = CommCounter(group)
        self.ns_flops_total = 0  # cumulative, this rank
        self.steps = 0

    # -- Newton-Schulz on whole matrices, equal shapes batched -------------------------------
    def _orthogonalise(self, mats: dict[int, Tensor]) -> dict[int, Tensor]:
        by_shape: dict[tuple[int, int], list[int]] = defaultdict(list)
        for i in mats:
            by_shape[self._shapes[i]].append(i)
        out = {}
        for shape, idx in by_shape.items():
            o = newton_schulz(torch.stack([mats[i] for i in idx]), self.ns_steps,
                              dtype=self.ns_dtype, eps=self.eps)
            out.update(zip(idx, o.unbind(0), strict=True))
            self.ns_flops_total += len(idx) * ns_flops(shape, self.ns_steps)
        return out

    def _whole(self, i: int, slices: Sequence[Tensor]) -> Tensor:
        """Matrix ``i`` from the ranks' flat padded slices, padding dropped."""
        s, (a, b) = self._rows[i], self._shapes[i]
        return torch.cat([x.view(s, b) for x in slices])[:a]

    # -- the two strategies: list of padded update slices -> list of orthogonalised slices --
    def _all_gather(self, u: list[Tensor]) -> list[Tensor]:
        sizes = [x.numel() for x in u]
        gathered = [g.split(sizes) for g in
                    self.counter.all_gather(torch.cat([x.flatten() for x in u]), "optimizer")]
        whole = {i: self._whole(i, [g[i] for g in gathered]) for i in range(len(u))}
        o = self._orthogonalise(whole)
        return [shard_rows(o[i], self.rank, self.world) for i in range(len(u))]

    def _all_to_all(self, u: list[Tensor]) -> list[Tensor]:
        w, me = self.world, self.rank
        to = [[i for i, o in enumerate(self.owners) if o == r] for r in range(w)]
        send_sizes = [sum(u[i].numel() for i in to[r]) for r in range(w)]
        mine = to[me]
        mine_sizes = [u[i].numel() for i in mine]  # every rank's slice of a matrix: one size
        # Exchange 1: my slice of each matrix goes to its owner (grouped by destination).
        flat = torch.cat([u[i].flatten() for r in range(w) for i in to[r]])
        recv = self.counter.all_to_all(flat, send_sizes, [sum(mine_sizes)] * w, "optimizer")
        per_src = [c.split(mine_sizes) for c in recv.split(sum(mine_sizes))] if mine else []
        o = self._orthogonalise({i: self._whole(i, [c[k] for c in per_src])
                                 for k, i in enumerate(mine)})
        # Exchange 2: every rank gets back its rows of the matrices I own.
        back = [shard_rows(o[i], r, w).flatten().to(u[i].dtype) for r in range(w) for i in mine]
        back_flat = torch.cat(back) if back else flat[:0]
        ret = self.counter.all_to_all(back_flat, [sum(mine_sizes)] * w, send_sizes, "optimizer")
        chunks = ret.split(send_sizes)
        out: list[Tensor] = [u[0]] * len(u)
        for r in range(w):
            for i, x in zip(to[r], chunks[r].split([u[i].numel() for i in to[r]]), strict=True):
                out[i] = x.view_as(u[i])
        return out

    @torch.no_grad()
    def step(self, grad_shards: Sequence[Tensor] | None = None):  # type: ignore[override]
        """One Muon update from this rank's gradient slices (see the class docstring)."""
        if grad_shards is None:
            if any(p.grad is None for p in self._params):
                raise ValueError("grad_shards not given and some params have no .grad")
            grad_shards = [shard_rows(p.grad, self.rank, self.world) for p in self._params]
        if len(grad_shards) != len(self._params):
            raise ValueError(f"grad_shards must have one slice per param ({len(self._params)}), "
                             f"got {len(grad_shards)}")
        # Looked up every step: load_state_dict replaces the group dicts (schedulers edit them).
        groups = [g for g in self.param_groups for _ in g["params"]]
        u = []
        for i, (p, g) in enumerate(zip(self._params, grad_shards, strict=True)):
            want = (self._rows[i], self._shapes[i][1])
            if tuple(g.shape) != want:
                raise ValueError(f"grad_shards[{i}] must have shape {want}, got "
                                 f"{tuple(g.shape)}")
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(g)
            group = groups[i]
            x = momentum_update(g, state["momentum_buffer"], group["momentum"],
                                group["nesterov"])
            u.append(x.to(self.comm_dtype) if self.comm_dtype is not None else x)
        slices = self._all_gather(u) if self.strategy == "all_gather" else self._all_to_all(u)
        for i, (p, o) in enumerate(zip(self._params, slices, strict=True)):
            group = groups[i]
            lo, hi = row_range(self._shapes[i][0], self.rank, self.world)
            rows = p[lo:hi]
            rows.mul_(1 - group["lr"] * group["weight_decay"])
            rows.add_(o[: hi - lo].to(p.dtype), alpha=-group["lr"] * update_scale(p.shape))
        if self.sync_params:
            self._sync_params()
        self.steps += 1

    def comm_per_step(self) -> dict[str, float]:
        """This rank's mean optimizer bytes sent/received and NS FLOPs per step so far.

        The parameter all-gather (``sync_params``) is reported apart as ``param_sync_*``.
        """
        n = max(self.steps, 1)
        out = {"ns_flops": self.ns_flops_total / n}
        for cat, row in self.counter.totals().items():
            prefix = "" if cat == "optimizer" else f"{cat}_"
            out[f"{prefix}bytes_sent"] = row["sent"] / n
            out[f"{prefix}bytes_received"] = row["received"] / n
        return out

    def _sync_params(self) -> None:
        # Every rank updated only its rows; gather them so all replicas agree (ZeRO's gather).
        mine = torch.cat([shard_rows(p.detach(), self.rank, self.world).flatten()
                          for p in self._params])
        parts = self.counter.all_gather(mine, "param_sync")
        sizes = [r * b for r, (_, b) in zip(self._rows, self._shapes, strict=True)]
        split = [x.split(sizes) for x in parts]
        for i, p in enumerate(self._params):
            p.copy_(self._whole(i, [s[i] for s in split]))
