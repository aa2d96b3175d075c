"""Checkpoints of ``--strategy diloco`` and ``fomoe`` runs: exact resume at the same world size.

A ``ckpt-<step>/`` directory holds:

- ``config.json``, ``model.safetensors`` (+ ``tokenizer.json``): the whole model as last
  synced (the outer anchors), every expert included: under FoMoE rank 0 gathers each rank's
  held experts at save time (every rank holds as many, so one ``dist.gather`` a tensor) and
  places them by the placement. ``hyla export``, ``--checkpoint`` and ``load_model`` read it;
- ``rank-<r>.pt``, one a rank: its own model (between syncs the workers differ), inner
  optimizers, outer anchors and momentum, RNG; read with ``weights_only=True``;
- ``train_state.pt`` (``format: "replicas"``): step, config, world size, strategy,
  placement, LR schedules, data position, RNG.

Written under a hidden name and renamed when every rank has written
(:func:`hyla.train.checkpointing.publish`), so a rank that dies mid-save leaves the previous
checkpoint as it was.
"""

from __future__ import annotations

import pathlib
import shutil

import torch
import torch.distributed as dist

from hyla.model.formats.checkpoint import save_checkpoint
from hyla.train.checkpointing.atomic import STATE, publish
from hyla.train.process_group import barrier
from hyla.train.strategies.fomoe import HeldExperts, held_by

FORMAT = "replicas"


def rank_file(rank: int) -> str:
    """``rank-<r>.pt``.

    Example:
        >>> rank_file(3)
        'rank-3.pt'
    """
    return f"rank-{rank}.pt"


def consolidated(model: torch.nn.Module, sync, world: int) -> dict | None:
    """The last-synced model's state dict with every expert (rank 0; None elsewhere).
    Collective under FoMoE (one gather a held-expert tensor)."""
    rank = dist.get_rank() if world > 1 else 0
    anchors = {id(p): a for p, a in zip((p for p in model.parameters() if p.requires_grad),
                                         sync.anchors, strict=True)}
    experts = {}
    for m in model.modules():
        if isinstance(m, HeldExperts):
            for p in (m.gate_up, m.down):
                experts[id(p)] = m
    full = {}
    for name, t in model.state_dict(keep_vars=True).items():
        value = anchors.get(id(t), t).detach()
        layer = experts.get(id(t))
        if layer is not None and not layer.holds_all:
            parts = [torch.empty_like(value) for _ in range(world)] if rank == 0 else None
            dist.gather(value.contiguous(), parts, dst=0)
            if rank == 0:
                value = value.new_empty((layer.opts.num_experts, *value.shape[1:]))
                for r, part in enumerate(parts):
                    value[held_by(sync.placement, r)] = part
        full[name] = value.cpu().clone()
    return full if rank == 0 else None


def save_replicas_checkpoint(loop, target: pathlib.Path, sync) -> pathlib.Path:
    """Write ``target`` from every rank (collective); see the module docstring. ``loop`` is
    the :class:`~hyla.train.loop.Loop`, ``sync`` its
    :class:`~hyla.train.strategies.diloco.OuterSync`."""
    from hyla.train.checkpointing.dcp import _Weights

    rank, world = loop.rank, loop.world
    tmp = target.with_name(f".{target.name}.tmp")
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    barrier(world)
    torch.save({"model": loop.model.state_dict(),
                "optimizers": [o.state_dict() for o in loop.optimizers],
                "outer": sync.state_dict(), "rng": torch.get_rng_state()},
               tmp / rank_file(rank))
    full = consolidated(loop.model, sync, world)
    barrier(world)     # every rank's file is written before rank 0 publishes
    if rank == 0:
        save_checkpoint(_Weights(loop.model.cfg, full), tmp, loop.tokenizer)
        torch.save({"format": FORMAT, "step": loop.step, "cfg": loop.cfg.to_dict(),
                    "world_size": world, "strategy": loop.cfg.strategy,
                    "placement": sync.placement,
                    "schedulers": [s.state_dict() for s in loop.schedulers],
                    "data_position": loop.blocks.position(), "rng": torch.get_rng_state()},
                   tmp / STATE)
        publish(tmp, target, loop.step, loop.cfg.keep_last)
    barrier(world)
    return target


def restore_replicas(model, optimizers: list, schedulers: list, sync, state: dict, *,
                     rank: int, world: int, strategy: str) -> None:
    """Load this rank's part of a checkpoint :func:`save_replicas_checkpoint` wrote.

    ValueError when the world size, the strategy or the placement differs from the run's
    (a DiLoCo/FoMoE run resumes exactly at the world size that wrote it), or when this rank's
    file is missing.
    """
    ckpt = pathlib.Path(state["resumed_from"])
    saved_world = int(state["world_size"])
    if saved_world != world:
        raise ValueError(f"{ckpt} was written by {saved_world} {state['strategy']} workers and "
                         f"resumes only at that world size (each rank has its own model and "
                         f"optimizers): torchrun --nproc-per-node {saved_world}, not {world}")
    if state["strategy"] != strategy:
        raise ValueError(f"{ckpt} is a --strategy {state['strategy']} checkpoint: resume it "
                         f"with --strategy {state['strategy']}, not {strategy}")
    if state.get("placement") != sync.placement:
        raise ValueError(f"{ckpt} places experts as {state.get('placement')}, this run as "
                         f"{sync.placement}: resume with the run's --expert-replicas")
    path = ckpt / rank_file(rank)
    if not path.is_file():
        raise ValueError(f"{path} is missing: the checkpoint lacks rank {rank}'s part")
    mine = torch.load(path, weights_only=True)
    model.load_state_dict(mine["model"])
    for opt, sd in zip(optimizers, mine["optimizers"], strict=True):
        opt.load_state_dict(sd)
    for sch, sd in zip(schedulers, state["schedulers"], strict=True):
        sch.load_state_dict(sd)
    sync.load_state_dict(mine["outer"])
