"""DiLoCo (``--strategy diloco``) and FoMoE (``--strategy fomoe``): their outer loop and the
two strategies.

Every worker trains its own copy (no FSDP) with the usual inner optimizers (Muon + AdamW, or
AdamW) on its share of the global batch. Every ``--sync-every H`` steps (and at the last step)
:class:`OuterSync` turns the parameter change since the last sync into a pseudo-gradient,
``anchor - local``, averages it over the workers that hold the parameter, and steps an outer
SGD with Nesterov momentum (``--outer-lr``, ``--outer-momentum``; plain SGD at momentum 0) on
the *anchors* (the last-synced parameters); every worker then copies the new anchors into its
model. The inner optimizers keep their state across syncs. At ``H = 1``, outer lr 1 and
momentum 0 the anchor becomes the workers' mean, which, with a linear inner optimizer (SGD,
no clipping), is exactly a data-parallel step.

Sync groups: a *unit* is a set of tensors averaged over one set of ranks. DiLoCo has one unit
(every parameter, all W ranks). FoMoE (:mod:`hyla.train.strategies.fomoe`) has the shared parameters
over all W ranks, plus one unit per distinct holder set of experts, averaged over a process
group of just those ranks (``dist.new_group``; experts held once are not sent at all). Each
unit is one flat all-reduce.

Bytes: an all-reduce of ``n`` bytes over ``g`` ranks counts ``2 (g - 1) n / g`` sent (and as
many received) per rank, what a ring all-reduce (reduce-scatter + all-gather) moves through
each rank's link: category ``"outer_sync"`` in the :class:`~hyla.train.optim.comm.CommCounter`.
Buffers are not synced: a router's ``score_bias`` moves by the same update on every rank
(:mod:`hyla.train.routing` sums the expert counts over the ranks), and its routing-stability
probe snapshots every ``cfg.sync_every`` steps and at the last step: right after these syncs.

A rank that dies or stops answering: a collective fails (gloo notices a closed connection at
once, a silent rank after ``--sync-timeout``, the process group's timeout); the Trainer then
raises :func:`stopped`'s error, which names the rank(s) that did not check in through the
process group's store, and the last checkpoint (written whole or not at all) stays.
"""

from __future__ import annotations

import datetime
import time

import torch
import torch.distributed as dist
from torch import nn

from hyla.model.formats.checkpoint import step_dirs
from hyla.train.optim.build import run_optimizers
from hyla.train.optim.comm import CommCounter
from hyla.train.process_group import broadcast_parameters, per_rank
from hyla.train.strategies.base import Strategy
from hyla.train.strategies.fomoe import (
    HeldExperts,
    expert_placement,
    full_param_bytes,
    held_by,
    hold_experts,
    require_moe,
)

CATEGORY = "outer_sync"


def ring_bytes(nbytes: int, group_size: int) -> int:
    """Bytes one rank sends in a ring all-reduce of ``nbytes`` over ``group_size`` ranks.

    Example:
        >>> ring_bytes(1000, 2), ring_bytes(1000, 4), ring_bytes(1000, 1)
        (1000, 1500, 0)
    """
    return 2 * (group_size - 1) * nbytes // group_size


class _Unit:
    """Tensors (parameter, anchor, pseudo-gradient views) averaged over ``ranks``."""

    def __init__(self, ranks: tuple[int, ...], group):
        self.ranks, self.group = ranks, group
        self.triples: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []

    def nbytes(self) -> int:
        return sum(g.numel() * g.element_size() for _, _, g in self.triples)


class OuterSync:
    """The outer loop of DiLoCo / FoMoE over ``model`` (see the module docstring).

    Args:
        model: this worker's model (with :class:`~hyla.train.strategies.fomoe.HeldExperts` layers
            under FoMoE; their rows follow ``placement``).
        every: inner steps between syncs (``--sync-every``); ``last``: also sync at this step.
        lr, momentum: the outer SGD (Nesterov when ``momentum > 0``).
        placement: FoMoE's holders of each expert
            (:func:`~hyla.train.strategies.fomoe.expert_placement`), None for DiLoCo.
        counter: counts the bytes sent (category ``"outer_sync"``).
        timeout: seconds the pre-sync barrier waits for a silent rank.

    Example (one process: the anchor moves by the outer step):
        >>> m = nn.Linear(2, 1, bias=False); m.weight.data[:] = 1.0
        >>> sync = OuterSync(m, every=1, lr=0.5, momentum=0.0)
        >>> m.weight.data[:] = 3.0               # what the inner steps did
        >>> sync.after_step(1); m.weight.data.tolist()
        [[2.0, 2.0]]
    """

    def __init__(self, model: nn.Module, *, every: int, lr: float, momentum: float,
                 last: int | None = None, placement: list[list[int]] | None = None,
                 counter: CommCounter | None = None, timeout: float = 600.0):
        self.model, self.every, self.last = model, every, last
        self.placement, self.timeout = placement, timeout
        self.counter = counter if counter is not None else CommCounter()
        self.rank, self.world = ((dist.get_rank(), dist.get_world_size())
                                 if dist.is_available() and dist.is_initialized() else (0, 1))
        self.syncs = 0
        params = [p for p in model.parameters() if p.requires_grad]   # a tied head once
        self.anchors = [p.detach().clone() for p in params]
        for a in self.anchors:
            a.grad = torch.zeros_like(a)
        nesterov = momentum > 0
        self.outer = torch.optim.SGD(self.anchors, lr=lr, momentum=momentum, nesterov=nesterov)
        self.units = self._units(model, params)

    def _units(self, model: nn.Module, params: list[nn.Parameter]) -> list[_Unit]:
        experts = {id(m.gate_up): m for m in model.modules() if isinstance(m, HeldExperts)}
        experts.update({id(m.down): m for m in experts.values()})
        everyone = tuple(range(self.world))
        units = {everyone: _Unit(everyone, None)}
        for p, a in zip(params, self.anchors, strict=True):
            layer = experts.get(id(p)) if self.placement is not None else None
            if layer is None:
                units[everyone].triples.append((p.data, a.data, a.grad))
                continue
            for row, e in enumerate(layer.held):
                ranks = tuple(self.placement[e])
                if ranks not in units:
                    units[ranks] = _Unit(ranks, None)
                units[ranks].triples.append((p.data[row], a.data[row], a.grad[row]))
        # every rank creates every holder set's group, in one order (new_group is collective
        # over the whole world, members or not)
        for ranks in sorted({tuple(r) for r in self.placement or []}):
            if 1 < len(ranks) < self.world:
                group = dist.new_group(list(ranks),
                                       timeout=datetime.timedelta(seconds=self.timeout))
                if ranks in units:
                    units[ranks].group = group
        return [u for r, u in sorted(units.items()) if self.rank in r]

    def due(self, step: int) -> bool:
        """Whether global step ``step`` (just done) ends an inner phase."""
        return step % self.every == 0 or step == self.last

    def after_step(self, step: int) -> None:
        """The loop's hook: sync when :meth:`due`."""
        if self.due(step):
            self.sync(step)

    @torch.no_grad()
    def sync(self, step: int = 0) -> None:
        """Average the pseudo-gradients over each unit's ranks, step the outer optimizer, load
        the new anchors into the model. Collective over all ranks."""
        for unit in self.units:
            for p, a, g in unit.triples:
                torch.sub(a, p, out=g)
            self._average([g for _, _, g in unit.triples], unit.ranks, unit.group)
        self.outer.step()
        for unit in self.units:
            for p, a, _ in unit.triples:
                p.copy_(a)
        self.syncs += 1

    def _average(self, tensors: list[torch.Tensor], ranks: tuple[int, ...], group) -> None:
        if len(ranks) < 2 or not tensors:
            return
        flat = torch.cat([t.reshape(-1) for t in tensors])
        dist.all_reduce(flat, group=group)
        flat /= len(ranks)
        n = ring_bytes(flat.numel() * flat.element_size(), len(ranks))
        self.counter.add(CATEGORY, sent=n, received=n)
        offset = 0
        for t in tensors:
            t.copy_(flat[offset:offset + t.numel()].view_as(t))
            offset += t.numel()

    def sync_bytes(self) -> int:
        """Bytes this rank sends at one sync (what the counter adds), without syncing."""
        return sum(ring_bytes(u.nbytes(), len(u.ranks)) for u in self.units)

    def state_dict(self) -> dict:
        """Anchors, the outer optimizer's state and the sync count (checkpointed per rank)."""
        return {"anchors": [a.detach().clone() for a in self.anchors],
                "outer": self.outer.state_dict(), "syncs": self.syncs}

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        for a, saved in zip(self.anchors, state["anchors"], strict=True):
            if a.shape != saved.shape:
                raise ValueError(f"checkpointed anchor of shape {tuple(saved.shape)} does not "
                                 f"fit {tuple(a.shape)}: resume with the run's placement")
            a.copy_(saved)
        self.outer.load_state_dict(state["outer"])
        self.syncs = int(state["syncs"])


SILENT = ("gloo", "connection", "timed out", "timeout", "monitoredbarrier", "nccl", "peer")


def stopped(error: BaseException, step: int, out, timeout: float) -> BaseException:
    """What a diloco / fomoe run raises when a collective fails: a RuntimeError naming the
    rank(s) that stopped answering (:func:`silent_ranks`), the step, and the last checkpoint
    (intact: written whole or not at all). Any other error is returned as it is.

    Example:
        >>> stopped(ValueError("x"), 3, "runs/a", 1.0)
        ValueError('x')
    """
    why = str(error)
    if not (isinstance(error, dist.DistError) or any(k in why.lower() for k in SILENT)):
        return error
    rank = dist.get_rank() if dist.is_initialized() else 0
    silent = silent_ranks(step, min(timeout, 30.0)) if dist.is_initialized() else None
    who = (f"rank(s) {', '.join(map(str, silent))}" if silent
           else "a rank (the store could not tell which)" if silent is None else "a rank")
    ckpts = [p.name for p in step_dirs(out)]
    last = f"{out}/{ckpts[-1]}" if ckpts else "none written yet"
    return RuntimeError(f"rank {rank} stopped after step {step}: {who} stopped answering "
                        f"within --sync-timeout {timeout:g}s ({why[:300]}). The last "
                        f"checkpoint ({last}) is intact: resume with --resume {out} at the "
                        f"same world size")


def silent_ranks(tag, wait: float) -> list[int] | None:
    """The ranks that do not check in within ``wait`` seconds through the process group's
    store (which outlives broken gloo connections): every surviving rank writes
    ``hyla/alive/<tag>/<rank>`` and waits for the others'. None when the store itself is
    unreachable (under torchrun it lives on rank 0's host)."""
    try:
        store = dist.distributed_c10d._get_default_store()
        rank, world = dist.get_rank(), dist.get_world_size()
        store.set(f"hyla/alive/{tag}/{rank}", "1")
        missing = set(range(world)) - {rank}
        deadline = time.monotonic() + wait
        while missing and time.monotonic() < deadline:
            missing = {r for r in missing if not store.check([f"hyla/alive/{tag}/{r}"])}
            time.sleep(0.05)
        return sorted(missing)
    except Exception:  # noqa: BLE001 - no store, no names
        return None


class Diloco(Strategy):
    """``--strategy diloco``: a full copy a rank, its own inner optimizers, the
    :class:`OuterSync` every ``--sync-every`` steps and after the last, per-rank checkpoints
    (:mod:`hyla.train.checkpointing.replicas`) that resume at the same world size."""

    name = "diloco"

    @staticmethod
    def timeout(cfg) -> float | None:
        return cfg.sync_timeout

    def placement(self, model: nn.Module) -> list[list[int]] | None:
        """Which ranks hold each expert (FoMoE); None: every rank holds everything."""
        return None

    def prepare(self, model, device, counter):
        broadcast_parameters(model)
        placement = self.placement(model)
        optimizers = run_optimizers(model, self.cfg)
        cfg = self.cfg
        self.sync = OuterSync(model, every=cfg.sync_every, lr=cfg.outer_lr,
                              momentum=cfg.outer_momentum, last=cfg.steps,
                              placement=placement, counter=counter, timeout=cfg.sync_timeout)
        return optimizers

    def restore(self, model, optimizers, schedulers, state) -> None:
        from hyla.train.checkpointing.replicas import restore_replicas

        restore_replicas(model, optimizers, schedulers, self.sync, state, rank=self.rank,
                         world=self.world, strategy=self.name)

    def loop_hooks(self) -> dict:
        from hyla.train.checkpointing.replicas import save_replicas_checkpoint

        return {"after_step": self.sync.after_step,
                "save_fn": lambda loop, target: save_replicas_checkpoint(loop, target,
                                                                         self.sync)}

    def fit(self, loop, progress: bool) -> dict:
        try:
            return loop.fit(progress=progress)
        except (RuntimeError, dist.DistError) as e:   # a rank went silent
            raise stopped(e, loop.step, loop.out, self.cfg.sync_timeout) from e

    def report(self, model, optimizers) -> dict:
        """Every rank computes the same (the placement is deterministic)."""
        cfg, sync = self.cfg, self.sync
        report = super().report(model, optimizers)
        report.update(sync_every=cfg.sync_every, outer_lr=cfg.outer_lr,
                      outer_momentum=cfg.outer_momentum, syncs=sync.syncs,
                      param_bytes_total=full_param_bytes(model),
                      sync_bytes_per_sync=per_rank(sync.sync_bytes(), self.world))
        return report


class Fomoe(Diloco):
    """``--strategy fomoe``: DiLoCo where each expert lives on ``--expert-replicas`` of the
    ranks (:mod:`hyla.train.strategies.fomoe`), synced over just those."""

    name = "fomoe"

    @classmethod
    def check(cls, model, cfg, world) -> None:
        cls._placement(model, cfg, world)

    @staticmethod
    def _placement(model: nn.Module, cfg, world: int) -> list[list[int]]:
        experts = require_moe(model)[0].opts.num_experts
        return expert_placement(experts, world, cfg.expert_replicas or world)

    def placement(self, model: nn.Module) -> list[list[int]]:
        placement = self._placement(model, self.cfg, self.world)
        hold_experts(model, placement, self.rank, token_skipping=self.cfg.token_skipping)
        return placement

    def report(self, model, optimizers) -> dict:
        report = super().report(model, optimizers)
        placement = self.sync.placement
        report.update(expert_replicas=len(placement[0]), token_skipping=self.cfg.token_skipping,
                      placement=placement,
                      experts_held=[held_by(placement, r) for r in range(self.world)])
        return report
