"""The process group under a training run at W > 1, whatever the strategy: starting it
(``torchrun``'s environment, or a group a test set up), each rank's device and its share of
the data, and the small collectives the loop needs (a loss averaged over ranks, a count per
rank, gradient clipping on sharded gradients).

Data: micro-batch ``a`` of a step on rank ``r`` is the stream's micro-batch ``a * W + r``
(``batch_size`` consecutive blocks, :class:`StridedBlocks`). A step consumes the same
``W x batch_size x grad_accum`` blocks at every world size, so a checkpoint resumes at another
W (with ``grad_accum`` scaled: :func:`resume_batch`) on the same data, and all ranks share one
position. What each strategy does with the ranks: :mod:`hyla.train.strategies`.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import datetime
import os

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from hyla.train.config import TrainConfig


def setup(timeout: float | None = None) -> tuple[int, int]:
    """``(rank, world)``: an existing process group's, torchrun's (started here), or ``(0, 1)``.

    ``timeout``: seconds a collective waits for a silent rank before it fails (diloco/fomoe's
    ``--sync-timeout``); None: torch's default.

    Example:
        >>> setup() if "WORLD_SIZE" not in os.environ else (0, 1)
        (0, 1)
    """
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return 0, 1
    # torchrun sets RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT: the env:// defaults. CPU
    # tensors (the data, the loss, a CPU model) always have gloo; CUDA ones get nccl.
    dist.init_process_group("cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo",
                            timeout=None if timeout is None
                            else datetime.timedelta(seconds=timeout))
    atexit.register(_destroy)
    return dist.get_rank(), dist.get_world_size()


def train_device(name: str) -> torch.device:
    """Where this rank trains: the CPU, or (``"cuda"``) its own GPU, ``cuda:LOCAL_RANK``.

    Example:
        >>> train_device("cpu")
        device(type='cpu')
    """
    if name == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ValueError("--device cuda, but torch sees no CUDA device: use --device cpu")
    index = int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count()
    torch.cuda.set_device(index)    # nccl and DCP address "the current device"
    return torch.device("cuda", index)


def _destroy() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def barrier(world: int) -> None:
    """``dist.barrier()`` when there is more than one rank."""
    if world > 1:
        dist.barrier()


@contextlib.contextmanager
def rank_zero_first(world: int):
    """Run the body on rank 0, then on the others (e.g. rank 0 trains and saves a tokenizer,
    the others load it instead of racing to write the same file)."""
    if world > 1 and dist.get_rank() != 0:
        dist.barrier()
    yield
    if world > 1 and dist.get_rank() == 0:
        dist.barrier()


class StridedBlocks:
    """Rank ``rank``'s share of a block stream: chunk ``rank`` of every ``world`` chunks of
    ``chunk`` blocks (a chunk is one micro-batch).

    Every rank reads (and tokenizes) the whole stream, skipping the others' chunks, so after
    each whole chunk all ranks share the inner position; ``position()`` adds the world size.

    Example:
        >>> class Count:
        ...     def __init__(self): self.i = 0
        ...     def __next__(self): self.i += 1; return self.i - 1
        ...     def position(self): return {"epoch": 0, "doc": self.i, "offset": 0}
        >>> s = StridedBlocks(Count(), rank=1, world=3)
        >>> [next(s) for _ in range(3)], s.position()["world_size"]
        ([1, 4, 7], 3)
        >>> [next(StridedBlocks(Count(), rank=1, world=2, chunk=2)) for _ in range(1)]
        [2]
    """

    def __init__(self, inner, rank: int, world: int, chunk: int = 1):
        if not 0 <= rank < world:
            raise ValueError(f"rank must be in [0, {world}), got {rank}")
        if chunk < 1:
            raise ValueError(f"chunk must be >= 1, got {chunk}")
        self.inner, self.rank, self.world, self.chunk = inner, rank, world, chunk
        self._taken = 0     # blocks of the current chunk handed out

    def __iter__(self):
        return self

    def __next__(self):
        if self._taken == 0:
            for _ in range(self.rank * self.chunk):
                next(self.inner)
        block = next(self.inner)
        self._taken += 1
        if self._taken == self.chunk:
            self._taken = 0
            for _ in range((self.world - 1 - self.rank) * self.chunk):
                next(self.inner)
        return block

    def position(self) -> dict:
        return {**self.inner.position(), "world_size": self.world}


def reshard(model: torch.nn.Module) -> None:
    """Put FSDP2 modules back to their shards (nothing to do without them). A forward
    without backward (validation) leaves the root's parameters gathered, and the optimizers
    and checkpoints address the shards."""
    from torch.distributed.fsdp import FSDPModule

    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.reshard()


def mean_over_ranks(value: float, world: int) -> float:
    """The mean of a float over the ranks (one tiny all-reduce; ``value`` itself at W = 1)."""
    if world == 1:
        return value
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t)
    return t.item() / world


def per_rank(value: int, world: int) -> list[int]:
    """Every rank's ``value``, in rank order (one small all-reduce; ``[value]`` at W = 1)."""
    if world == 1:
        return [value]
    t = torch.zeros(world, dtype=torch.int64)
    t[dist.get_rank()] = value
    dist.all_reduce(t)
    return t.tolist()


@torch.no_grad()
def clip_grad_norm_(params, max_norm: float) -> float:
    """Scale the gradients of ``params`` so their joint norm is at most ``max_norm``; returns
    the norm before clipping. Sharded (DTensor) gradients are reduced to one norm first, so
    every rank scales by the same factor (what ``clip_grad_norm_`` on one process does).

    Example:
        >>> w = torch.nn.Parameter(torch.zeros(2)); w.grad = torch.tensor([3.0, 4.0])
        >>> clip_grad_norm_([w], 1.0), [round(g, 4) for g in w.grad.tolist()]
        (5.0, [0.6, 0.8])
    """
    params = [p for p in params if p.grad is not None]
    if not params:
        return 0.0
    total = torch.nn.utils.get_total_norm([p.grad for p in params])
    if isinstance(total, DTensor):
        total = total.full_tensor()
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    return total.item()


@torch.no_grad()
def broadcast_parameters(model: torch.nn.Module) -> None:
    """Copy rank 0's parameters and buffers everywhere before sharding (the same seed builds
    the same model; this makes sure)."""
    for t in list(model.parameters()) + list(model.buffers()):
        dist.broadcast(t.data, src=0)


def resume_batch(saved: TrainConfig, saved_world: int, asked: TrainConfig | None,
                 world: int, run_dir) -> TrainConfig:
    """``saved`` with ``batch_size``/``grad_accum`` for ``world`` ranks, keeping the global batch.

    ``asked`` (the resume's flags) may set either; what it leaves at the default is taken from
    the run, and ``grad_accum`` is scaled by ``saved_world / world``. A ValueError names the
    flags to change when ``world x batch_size x grad_accum`` cannot equal the run's.

    Example:
        >>> run = TrainConfig(batch_size=2, grad_accum=1)
        >>> resume_batch(run, 2, None, 1, "runs/a").grad_accum
        2
        >>> resume_batch(run, 2, None, 3, "runs/a")
        Traceback (most recent call last):
        ...
        ValueError: runs/a was trained with a global batch of 4 blocks a step ...
    """
    total = saved_world * saved.batch_size * saved.grad_accum
    default = TrainConfig()
    bs = saved.batch_size
    if asked is not None and asked.batch_size != default.batch_size:
        bs = asked.batch_size
    if asked is not None and asked.grad_accum != default.grad_accum:
        accum = asked.grad_accum
    else:
        accum = max(total // (world * bs), 1)
    if world * bs * accum != total:
        raise ValueError(
            f"{run_dir} was trained with a global batch of {total} blocks a step (world size "
            f"{saved_world} x --batch-size {saved.batch_size} x --grad-accum "
            f"{saved.grad_accum}); at world size {world}, --batch-size {bs} x --grad-accum "
            f"{accum} gives {world * bs * accum}: pass --batch-size B and --grad-accum A with "
            f"{world} x B x A = {total}, or resume at a world size that divides {total}")
    return dataclasses.replace(saved, batch_size=bs, grad_accum=accum)
