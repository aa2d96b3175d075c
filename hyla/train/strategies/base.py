"""The protocol every training strategy follows, and the one-process strategy.

A :class:`Strategy` is what ``hyla train`` does differently for how the run spreads over its
ranks: it prepares the model and builds the optimizers (sharding, broadcasting, holding
experts), restores them from a checkpoint, hooks into the loop (an outer sync after a step,
its own checkpoint writer), tidies after validation, runs the loop (turning a dead rank into a
clear error) and reports what each rank holds. The trainer calls these and nothing else, so
it has no branch on the strategy. :func:`hyla.train.strategies.registry.build_strategy` picks one.
"""

from __future__ import annotations

import torch

from hyla.train.checkpointing.resume import restore_optimizers, restore_weights, run_dir_of
from hyla.train.config import TrainConfig
from hyla.train.optim.build import run_optimizers
from hyla.train.optim.comm import CommCounter
from hyla.train.strategies.report import parallel_record


class Strategy:
    """One process, or the base of the multi-process strategies (``name``: ``run.json``'s
    ``parallel.strategy``).

    Example:
        >>> from hyla.model import HylaLM, preset
        >>> model = HylaLM(preset("debug"))
        >>> s = Strategy(TrainConfig(), rank=0, world=1)
        >>> [type(o).__name__ for o in s.prepare(model, torch.device("cpu"), CommCounter())]
        ['Muon', 'AdamW']
    """

    name = "single"
    mesh = None   # FSDP's DeviceMesh, for the report

    def __init__(self, cfg: TrainConfig, *, rank: int, world: int):
        self.cfg, self.rank, self.world = cfg, rank, world

    @classmethod
    def check(cls, model: torch.nn.Module, cfg: TrainConfig, world: int) -> None:
        """Refuse a model or settings this strategy cannot train (ValueError), at any world
        size, one process included, before any collective."""

    @staticmethod
    def timeout(cfg: TrainConfig) -> float | None:
        """Seconds a collective waits for a silent rank (None: torch's default)."""
        return None

    def prepare(self, model: torch.nn.Module, device: torch.device,
                counter: CommCounter) -> list[torch.optim.Optimizer]:
        """Ready ``model`` on this rank (in place) and return its optimizers, in the order
        checkpoints save them. ``counter`` counts what the strategy's collectives send."""
        return run_optimizers(model, self.cfg)

    def restore(self, model: torch.nn.Module, optimizers: list, schedulers: list,
                state: dict) -> None:
        """Load a checkpoint (``state``: :func:`~hyla.train.checkpointing.load_train_state`)
        into the prepared model, optimizers and schedules."""
        if state.get("format") == "replicas":
            raise ValueError(f"{state['resumed_from']} is a --strategy "
                             f"{state['cfg'].strategy} checkpoint of {state['world_size']} "
                             f"ranks: resume it under torchrun --nproc-per-node "
                             f"{state['world_size']}, or start a new --out with --init "
                             f"{state['resumed_from']} to keep its weights")
        if "dcp" in state:
            from hyla.train.checkpointing.dcp import restore_dcp

            restore_dcp(model, optimizers, schedulers, state)
        else:   # a checkpoint from before DCP (one process)
            run = run_dir_of(state["resumed_from"])
            restore_weights(model, state,
                            f"checkpoint in {run} does not match preset {self.cfg.preset}")
            restore_optimizers(optimizers, schedulers, state)

    def loop_hooks(self) -> dict:
        """Keyword arguments for :class:`~hyla.train.loop.Loop`: checkpoint writer, hooks."""
        return {"distributed_checkpoints": True}

    def after_validation(self, model: torch.nn.Module) -> None:
        """Put the model back the way the optimizers address it after a forward alone."""

    def fit(self, loop, progress: bool) -> dict:
        """Run the loop to its end; returns the last metrics record."""
        return loop.fit(progress=progress)

    def report(self, model: torch.nn.Module, optimizers: list) -> dict:
        """``run.json``'s ``parallel``: what each rank holds (collective)."""
        return parallel_record(model, optimizers, world=self.world, strategy=self.name,
                               mesh=self.mesh)
