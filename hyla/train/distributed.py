"""Data-parallel training over ``torch.distributed``: what the Trainer does differently at W > 1.

Launched by ``torchrun --nproc-per-node W`` (or inside a process group a test set up), each
rank builds the same model from the same seed and:

- reads its own blocks: rank ``r`` takes block ``r`` of every group of ``W`` consecutive
  blocks, so the global batch is ``W x batch_size x grad_accum`` blocks and, after every
  micro-batch, all ranks stand at the same stream position (one position resumes them all);
- averages its gradients with one all-reduce per step (ZeRO-2 style sharding *after* the
  reduction: gloo has no reduce-scatter, so every rank receives the whole average and then
  keeps only its row slices for Muon; the clip norm is then the same on every rank);
- updates the hidden matrices with :class:`~hyla.train.muon_dist.DistMuon` (momentum sharded
  by rows, ``cfg.muon_strategy``) and the rest with AdamW, replicated on the averaged
  gradients; so parameters stay identical on every rank without being broadcast;
- lets rank 0 alone write the tokenizer, the metrics and the checkpoints. Muon's momentum
  slices are gathered into whole matrices for the checkpoint (the same layout single-process
  Muon saves) and the data position records the world size, which a resume must match.

FSDP2's ``fully_shard`` is not used: its reduce-scatter is missing on gloo (the CPU backend),
and Muon needs each matrix whole anyway, which DistMuon arranges.
"""

from __future__ import annotations

import atexit
import contextlib
import os

import torch
import torch.distributed as dist
from torch import Tensor

from hyla.ops.hardware import fast_low_precision_matmul
from hyla.train.comm import shard_rows
from hyla.train.config import TrainConfig
from hyla.train.muon_dist import DistMuon
from hyla.train.optim import run_optimizers
from hyla.train.param_groups import split_params


def setup() -> tuple[int, int]:
    """``(rank, world)``: an existing process group's, torchrun's (started here), or ``(0, 1)``.

    Example:
        >>> setup() if "WORLD_SIZE" not in os.environ else (0, 1)
        (0, 1)
    """
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return 0, 1
    # torchrun sets RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT: the env:// defaults.
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    atexit.register(_destroy)
    return dist.get_rank(), dist.get_world_size()


def _destroy() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


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
    """Rank ``rank``'s share of a block stream: block ``rank`` of every ``world`` blocks.

    Every rank reads (and tokenizes) the whole stream, skipping the others' blocks, so after
    each ``next`` all ranks share the inner position; ``position()`` adds the world size.

    Example:
        >>> class Count:
        ...     def __init__(self): self.i = 0
        ...     def __next__(self): self.i += 1; return self.i - 1
        ...     def position(self): return {"epoch": 0, "doc": self.i, "offset": 0}
        >>> s = StridedBlocks(Count(), rank=1, world=3)
        >>> [next(s) for _ in range(3)], s.position()["world_size"]
        ([1, 4, 7], 3)
    """

    def __init__(self, inner, rank: int, world: int):
        if not 0 <= rank < world:
            raise ValueError(f"rank must be in [0, {world}), got {rank}")
        self.inner, self.rank, self.world = inner, rank, world

    def __iter__(self):
        return self

    def __next__(self):
        for _ in range(self.rank):
            next(self.inner)
        block = next(self.inner)
        for _ in range(self.world - 1 - self.rank):
            next(self.inner)
        return block

    def position(self) -> dict:
        return {**self.inner.position(), "world_size": self.world}


def check_resume_world(state: dict, world: int, run_dir) -> None:
    """Raise ValueError unless the checkpoint in ``state`` was written at world size ``world``.

    The data position (each rank's stride through the stream) and Muon's row-sharded momentum
    are tied to the world size; single-process checkpoints carry none, i.e. world size 1.
    """
    saved = int(state["data_position"].get("world_size", 1))
    if saved != world:
        launch = ("plain `hyla train`" if saved == 1
                  else f"`torchrun --nproc-per-node {saved} -m hyla.cli train`")
        raise ValueError(f"{run_dir} was trained with world size {saved}, not {world}: resume it "
                         f"with {launch} --resume, or start a new --out")


class ShardedMuon(DistMuon):
    """DistMuon whose checkpoints hold whole momentum matrices (the single-process layout).

    ``state_dict`` is collective: every rank must call it (it all-gathers the row slices).
    ``load_state_dict`` takes whole matrices and keeps this rank's rows.
    """

    def state_dict(self):
        sd = super().state_dict()
        for i, p in enumerate(self._params):
            buf = self.state[p].get("momentum_buffer")
            if buf is not None:
                parts = [torch.empty_like(buf) for _ in range(self.world)]
                dist.all_gather(parts, buf.contiguous(), group=self.group)
                sd["state"][i] = {**sd["state"][i],
                                  "momentum_buffer": torch.cat(parts)[: p.shape[0]]}
        return sd

    def load_state_dict(self, state_dict) -> None:
        super().load_state_dict(state_dict)
        for p in self._params:
            buf = self.state[p].get("momentum_buffer")
            if buf is not None and buf.shape == p.shape:
                self.state[p]["momentum_buffer"] = shard_rows(buf, self.rank, self.world)


def build_optimizers(model: torch.nn.Module, cfg: TrainConfig) -> list[torch.optim.Optimizer]:
    """The multi-rank counterpart of :func:`~hyla.train.optim.run_optimizers` (same order and
    hyperparameters): ShardedMuon + replicated AdamW, or replicated AdamW alone."""
    if cfg.optimizer == "adamw":
        return run_optimizers(model, cfg)
    device = next(model.parameters()).device
    ns_dtype = (torch.bfloat16 if fast_low_precision_matmul(torch.bfloat16, device)
                else torch.float32)
    muon_params, adamw_params = split_params(model)
    muon = ShardedMuon([p for _, p in muon_params], strategy=cfg.muon_strategy, lr=cfg.muon_lr,
                       momentum=0.95, weight_decay=cfg.weight_decay, ns_dtype=ns_dtype)
    decay = [p for _, p in adamw_params if p.ndim >= 2]
    no_decay = [p for _, p in adamw_params if p.ndim < 2]
    adamw = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                               {"params": no_decay, "weight_decay": 0.0}],
                              lr=cfg.lr, betas=(0.9, 0.95))
    return [muon, adamw]


@torch.no_grad()
def average_gradients(model: torch.nn.Module, loss: float, world: int) -> float:
    """Average every gradient (one flat all-reduce) and the loss over the ranks; returns the
    mean loss. Each rank's loss is already a mean over its equal share of tokens' blocks."""
    grads: list[Tensor] = [p.grad for p in model.parameters() if p.grad is not None]
    flat = torch.cat([g.flatten().float() for g in grads] + [torch.tensor([loss])])
    dist.all_reduce(flat)
    flat /= world
    for g, part in zip(grads, flat[:-1].split([g.numel() for g in grads]), strict=True):
        g.copy_(part.view_as(g))
    return flat[-1].item()


@torch.no_grad()
def broadcast_parameters(model: torch.nn.Module) -> None:
    """Copy rank 0's parameters everywhere (same seed builds the same model; this makes sure)."""
    for t in list(model.parameters()) + list(model.buffers()):
        dist.broadcast(t.data, src=0)


def save(trainer, target):
    """Every rank gathers the optimizer state; rank 0 writes the checkpoint; all wait."""
    from hyla.train.checkpointing import save_train_checkpoint

    states = [o.state_dict() for o in trainer.optimizers]  # collective for ShardedMuon
    if trainer.rank == 0:
        view = _SaveView(trainer, states)
        save_train_checkpoint(view, target)
    dist.barrier()
    return target


class _SaveView:
    """The trainer as save_train_checkpoint sees it, with the gathered optimizer states."""

    def __init__(self, trainer, states: list[dict]):
        self._trainer = trainer
        self.optimizers = [_Frozen(s) for s in states]

    def __getattr__(self, name):
        return getattr(self._trainer, name)


class _Frozen:
    def __init__(self, state: dict):
        self._state = state

    def state_dict(self) -> dict:
        return self._state
