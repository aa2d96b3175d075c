"""What each rank holds, measured on a run: ``run.json``'s ``parallel``.

:func:`parallel_record` (collective) gathers every rank's parameter, optimizer-state and
peak-memory bytes; :func:`write_run_json` writes them beside ``metrics.jsonl``. (The same
quantities planned on paper, for any model and world size: :mod:`hyla.eval.train_memory`.)
"""

from __future__ import annotations

import json
import pathlib
import resource
import sys

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor


def local_bytes(t: torch.Tensor) -> int:
    """Bytes of ``t`` this rank holds: a DTensor's local shard, else the whole tensor.

    Example:
        >>> local_bytes(torch.zeros(4, 2))
        32
    """
    t = t.to_local() if isinstance(t, DTensor) else t
    return t.numel() * t.element_size()


def param_bytes(model: torch.nn.Module) -> tuple[int, int]:
    """``(local, total)`` parameter bytes: this rank's shards, and the whole model's.

    Example:
        >>> param_bytes(torch.nn.Linear(4, 2, bias=False))
        (32, 32)
    """
    params = list(model.parameters())
    total = sum(p.numel() * p.element_size() for p in params)   # DTensor: global shape
    return sum(local_bytes(p) for p in params), total


def optimizer_bytes(optimizers) -> int:
    """Bytes of optimizer state (momenta, second moments, step counters) this rank holds."""
    return sum(local_bytes(v) for opt in optimizers for st in opt.state.values()
               for v in st.values() if isinstance(v, torch.Tensor))


def peak_memory_bytes(device: torch.device | str = "cpu") -> int:
    """This process's peak memory: CUDA's peak allocation on a GPU, else the peak RSS."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024   # Linux reports KiB


def parallel_record(model: torch.nn.Module, optimizers, *, strategy: str, world: int,
                    mesh=None) -> dict:
    """``run.json``'s ``parallel``: strategy, world size, mesh, and per-rank lists of
    ``param_bytes_local``, ``optimizer_bytes`` and ``peak_memory_bytes`` (collective at W > 1).

    Example:
        >>> m = torch.nn.Linear(4, 2)
        >>> r = parallel_record(m, [], strategy="single", world=1)
        >>> r["param_bytes_local"], r["param_bytes_total"]
        ([40], 40)
    """
    local, total = param_bytes(model)
    device = next(model.parameters()).device
    mine = [local, optimizer_bytes(optimizers), peak_memory_bytes(device)]
    if world > 1:
        rows = [None] * world
        dist.all_gather_object(rows, mine)
    else:
        rows = [mine]
    return {"strategy": strategy, "world_size": world,
            "mesh": ({"shape": list(mesh.shape), "dims": list(mesh.mesh_dim_names or ()),
                      "device_type": mesh.device_type} if mesh is not None else None),
            "param_bytes_total": total,
            "param_bytes_local": [r[0] for r in rows],
            "optimizer_bytes": [r[1] for r in rows],
            "peak_memory_bytes": [r[2] for r in rows],
            "peak_memory_kind": "cuda_max_allocated" if device.type == "cuda" else "rss"}


def write_run_json(out: pathlib.Path, fields: dict) -> pathlib.Path:
    """Write (replace) ``out/run.json`` with ``fields``; returns its path."""
    path = pathlib.Path(out) / "run.json"
    path.write_text(json.dumps(fields, indent=2, default=str) + "\n", encoding="utf-8")
    return path
