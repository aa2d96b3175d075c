"""``hyla train`` checkpoints through ``torch.distributed.checkpoint`` (DCP), at any world size.

A ``ckpt-<step>/`` directory holds:

- ``config.json``, ``model.safetensors`` (+ ``tokenizer.json``): the whole model, consolidated
  on rank 0 at save time, so ``hyla export``, every ``--checkpoint`` and ``load_model`` read
  it as they read any hyla checkpoint;
- ``dcp/``: the model's and the optimizers' tensors as DCP writes them (``__<rank>_0.distcp``
  a rank, ``.metadata``). Each rank saves only its shards; a load at another world size reads
  whichever pieces its own shards need (DCP reshards), so W ranks resume at W';
- ``train_state.pt``: the rest (step, config, world size, LR schedules and the optimizers'
  learning rates, data position, RNG), small plain data read with ``weights_only=True``.

The directory is written under a hidden temporary name and renamed when complete (see
:func:`hyla.train.checkpointing.publish`). A resume checks that every shard the metadata
names is present and long enough before it trusts a checkpoint
(:func:`hyla.train.checkpointing.safe_reader.check_dcp`); one that is not is skipped,
naming the file, for the one before it.
"""

from __future__ import annotations

import contextlib
import pathlib
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from hyla.model.formats.checkpoint import save_checkpoint
from hyla.train.checkpointing.atomic import STATE, publish
from hyla.train.checkpointing.safe_reader import DCP, SafeReader
from hyla.train.process_group import barrier, reshard

KEPT_GROUP_KEYS = ("lr", "initial_lr")   # what the LR schedules change; the rest is config


def save_dcp_checkpoint(loop, target: pathlib.Path) -> pathlib.Path:
    """Write ``target`` (a ``ckpt-<step>`` directory) from every rank; see the module doc.

    ``loop`` is a :class:`~hyla.train.loop.Loop` (``model``, ``tokenizer``, ``step``, ``cfg``,
    ``optimizers``, ``schedulers``, ``blocks``, ``rank``, ``world``). Collective: every rank
    calls it.
    """
    model, rank, world = loop.model, loop.rank, loop.world
    reshard(model)
    tmp = target.with_name(f".{target.name}.tmp")   # one name on every rank
    if rank == 0:
        _rmtree(tmp)
        tmp.mkdir(parents=True)
    barrier(world)
    optim = [get_optimizer_state_dict(model, o) for o in loop.optimizers]
    tensors = {"model": get_model_state_dict(model),
               **{f"optimizer{i}": sd["state"] for i, sd in enumerate(optim)}}
    with _single_process_quiet():
        dcp.save(tensors, storage_writer=FileSystemWriter(tmp / DCP), no_dist=_no_dist())
    if world > 1:  # collective: gathers every shard to rank 0 (in CPU memory)
        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True,
                                                                    cpu_offload=True))
    else:
        full = {k: v.cpu() for k, v in model.state_dict().items()}
    if rank == 0:
        save_checkpoint(_Weights(model.cfg, full), tmp, loop.tokenizer)
        torch.save({
            "format": "dcp",
            "step": loop.step,
            "cfg": loop.cfg.to_dict(),
            "world_size": world,
            "param_groups": [[{k: g[k] for k in KEPT_GROUP_KEYS if k in g}
                              for g in sd["param_groups"]] for sd in optim],
            "schedulers": [s.state_dict() for s in loop.schedulers],
            "data_position": loop.blocks.position(),
            "rng": torch.get_rng_state(),
        }, tmp / STATE)
        publish(tmp, target, loop.step, loop.cfg.keep_last)
    barrier(world)
    return target


def restore_dcp(model: torch.nn.Module, optimizers: list, schedulers: list,
                state: dict) -> None:
    """Load a DCP checkpoint (``state`` from :func:`~hyla.train.checkpointing.load_train_state`)
    into ``model`` and its optimizers, sharded or not, at any world size. Collective."""
    optim = [get_optimizer_state_dict(model, o) for o in optimizers]  # creates empty state
    tensors = {"model": get_model_state_dict(model),
               **{f"optimizer{i}": sd["state"] for i, sd in enumerate(optim)}}
    with _single_process_quiet():
        dcp.load(tensors, storage_reader=SafeReader(state["dcp"]), no_dist=_no_dist())
    set_model_state_dict(model, tensors["model"])
    for opt, sd, groups in zip(optimizers, optim, state["param_groups"], strict=True):
        for group, saved in zip(sd["param_groups"], groups, strict=True):
            group.update(saved)
        set_optimizer_state_dict(model, opt, sd)
    for sch, sd in zip(schedulers, state["schedulers"], strict=True):
        sch.load_state_dict(sd)


class _Weights:
    """The consolidated weights as :func:`save_checkpoint` reads a model (cfg, state_dict)."""

    def __init__(self, cfg, state: dict):
        self.cfg, self._state = cfg, state

    def state_dict(self) -> dict:
        return self._state


def _no_dist() -> bool:
    return not (dist.is_available() and dist.is_initialized())


@contextlib.contextmanager
def _single_process_quiet():
    # Without a process group DCP warns on every call that it assumes one process: we mean it.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _rmtree(path: pathlib.Path) -> None:
    import shutil

    shutil.rmtree(path, ignore_errors=True)
