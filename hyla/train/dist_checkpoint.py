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
(:func:`check_dcp`); one that is not is skipped, naming the file, for the one before it.
"""

from __future__ import annotations

import contextlib
import pathlib
import pickle
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import StorageMeta
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from hyla.model.formats.checkpoint import save_checkpoint
from hyla.train.checkpointing import STATE, publish
from hyla.train.distributed import barrier, reshard

DCP = "dcp"
METADATA = ".metadata"
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


def check_dcp(path: pathlib.Path) -> None:
    """ValueError naming the first file of the DCP checkpoint at ``path`` that is missing or
    shorter than its metadata says (a rank that died mid-save, a copy that lost a file).

    Example:
        >>> import tempfile
        >>> check_dcp(pathlib.Path(tempfile.mkdtemp()) / "dcp")
        Traceback (most recent call last):
        ...
        ValueError: dcp/.metadata is missing
    """
    path = pathlib.Path(path)
    if not (path / METADATA).is_file():
        raise ValueError(f"{path.name}/{METADATA} is missing")
    need: dict[str, int] = {}
    for info in SafeReader(path).read_metadata().storage_data.values():
        need[info.relative_path] = max(need.get(info.relative_path, 0),
                                       info.offset + info.length)
    for name, size in sorted(need.items()):
        file = path / name
        if not file.is_file():
            raise ValueError(f"shard {path.name}/{name} is missing")
        if file.stat().st_size < size:
            raise ValueError(f"shard {path.name}/{name} is truncated "
                             f"({file.stat().st_size} of {size} bytes)")


class _MetadataUnpickler(pickle.Unpickler):
    """DCP's ``.metadata`` is a pickle; only DCP's own metadata classes and torch's sizes and
    dtypes may be rebuilt from it (loading never runs arbitrary code)."""

    def find_class(self, module: str, name: str):
        if module.startswith("torch.distributed.checkpoint.") or (module, name) in _ALLOWED:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None),
                                            (torch.dtype, torch.memory_format, torch.layout)):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not allowed in DCP metadata")


_ALLOWED = {("torch", "Size"), ("torch", "device"), ("torch.serialization", "_get_layout"),
            ("collections", "OrderedDict"), ("pathlib", "PosixPath"),
            ("pathlib", "PurePosixPath"), ("pathlib", "WindowsPath")}


class SafeReader(FileSystemReader):
    """DCP's file reader, with the metadata read through an allow-list unpickler."""

    def read_metadata(self, *args, **kwargs):
        with open(pathlib.Path(self.path) / METADATA, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


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
