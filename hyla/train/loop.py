"""The training loop, one for every objective: language modelling and both distillation stages.

A run trains one or more :class:`Stage`\\ s in sequence (``hyla train``: one; ``hyla
distill``: attention transfer, then end to end). Each step of a stage takes ``grad_accum``
micro-batches of ``batch_size`` packed blocks, lets the objective backpropagate each (under
``torchrun``, FSDP2 reduce-scatters the gradients), clips, steps the optimizers and the LR
schedules,
appends a record to ``metrics.jsonl``, validates at the stage's end (and every
``eval_every``), and writes ``ckpt-<step>/`` every ``cfg.save_every`` steps, at a stage's end
and where the run stops. A checkpoint holds everything a resume needs (weights, optimizers,
schedules, data position, RNG state), so a resumed run reproduces the uninterrupted one.
"""

from __future__ import annotations

import dataclasses
import math
import pathlib
import time
from collections.abc import Callable, Iterator

import torch

from hyla.train import process_group
from hyla.train.batches import next_batch
from hyla.train.checkpointing import guarded_save, remove_stale_temps, save_train_checkpoint
from hyla.train.metrics import MetricsLog
from hyla.train.objectives import Objective
from hyla.train.optim.comm import CommCounter
from hyla.train.progress import ProgressDisplay


@dataclasses.dataclass(kw_only=True)
class Stage:
    """A span of steps trained one way: objective, optimizers, LR schedules and data.

    Args:
        objective: what a micro-batch costs (:class:`~hyla.train.objectives.Objective`).
        optimizers, schedulers: stepped once a step, in order; the first scheduler's LR is
            logged. Saved in checkpoints in this order.
        blocks: the packed-block stream (``next`` gives ``{"input_ids", "labels",
            "cu_seqlens"}``; ``position()`` is where a resume restarts it).
        end: the global step the stage ends at (validated and checkpointed there).
        batch_size: blocks a micro-batch; grad_accum: micro-batches a step.
        tokens_per_step: tokens a step (every rank's); start / tokens_before: the global step
            the stage began at and the tokens trained on before it (for the ``tokens`` field).
        clip: clip each of ``objective.clip_groups()`` to this gradient norm (0: no clipping).
        eval_every: also validate every this many steps (0: only at ``end``).
        tags: fields leading every metrics record (e.g. ``{"stage": 1}``).
        label: the progress display's label.
        then: called when the stage ends; returns the stage that follows, or None.
    """

    objective: Objective
    optimizers: list[torch.optim.Optimizer]
    schedulers: list[torch.optim.lr_scheduler.LRScheduler]
    blocks: Iterator[dict]
    end: int
    batch_size: int
    tokens_per_step: int
    grad_accum: int = 1
    start: int = 0
    tokens_before: int = 0
    clip: float = 1.0
    eval_every: int = 0
    tags: dict = dataclasses.field(default_factory=dict)
    label: str = "step"
    then: Callable[[], Stage | None] | None = None


class Loop:
    """Train ``model`` through its stages, logging and checkpointing into ``out``.

    Args:
        out: the run directory (``metrics.jsonl``, ``ckpt-<step>/``).
        cfg: the run's config (saved in checkpoints; ``save_every``, ``keep_last``).
        model, tokenizer: saved in checkpoints; ``model`` is what ranks average.
        stage: the current :class:`Stage`.
        total: the run's last step (all stages).
        step: the global step done so far (a resumed run's checkpoint step).
        validate: returns the validation loss (``val_loss``), or a dict of validation fields
            holding it; None: never validated.
        rank, world: this process's rank and the number of ranks (``torchrun``).
        distributed_checkpoints: write checkpoints through DCP
            (:mod:`hyla.train.checkpointing.dcp`, any world size) instead of one process's
            ``train_state.pt``.
        counters: the :class:`~hyla.train.optim.comm.CommCounter` s of what this rank sends; each
            record gets ``comm_bytes`` (the most any rank sent that step) and
            ``comm_bytes_per_rank``.
        after_step: called with the global step after each optimizer step, before its bytes
            are counted (DiLoCo's outer sync: :class:`~hyla.train.strategies.diloco.OuterSync`).
        save_fn: ``save_fn(loop, target)`` writes a checkpoint instead of the default writers
            (DiLoCo/FoMoE: :mod:`hyla.train.checkpointing.replicas`).

    Example:
        >>> import tempfile
        >>> from hyla.data.packing import corpus_blocks
        >>> from hyla.data.tokenizer import ByteTokenizer
        >>> from hyla.model import HylaLM, preset
        >>> from hyla.train.config import TrainConfig
        >>> from hyla.train.objectives import LanguageModelling
        >>> model = HylaLM(preset("debug"))
        >>> opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        >>> stage = Stage(objective=LanguageModelling(model), optimizers=[opt], schedulers=[],
        ...               blocks=corpus_blocks(None, ByteTokenizer(), 16), end=2,
        ...               batch_size=1, tokens_per_step=16)
        >>> cfg = TrainConfig(preset="debug", out=tempfile.mkdtemp())
        >>> loop = Loop(out=cfg.out, cfg=cfg, model=model, tokenizer=None, stage=stage, total=2)
        >>> loop.fit(progress=False)["step"], sorted(p.name for p in loop.out.iterdir())
        (2, ['ckpt-000002', 'metrics.jsonl'])
    """

    def __init__(self, *, out, cfg, model: torch.nn.Module, tokenizer, stage: Stage, total: int,
                 step: int = 0, validate: Callable[[], float | dict] | None = None, rank: int = 0,
                 world: int = 1, distributed_checkpoints: bool = False,
                 counters: list[CommCounter] | None = None,
                 after_step: Callable[[int], None] | None = None,
                 save_fn: Callable[[Loop, pathlib.Path], pathlib.Path] | None = None):
        self.out, self.cfg, self.model, self.tokenizer = pathlib.Path(out), cfg, model, tokenizer
        self.stage, self.total, self.step = stage, total, step
        self.validate, self.rank, self.world = validate, rank, world
        self.distributed_checkpoints = distributed_checkpoints
        self.counters = counters or []
        self.after_step, self.save_fn = after_step, save_fn
        self.routing = None   # MoE models: a hyla.train.routing.RoutingMonitor (the Trainer's)
        self.metrics = MetricsLog(self.out / "metrics.jsonl", step, enabled=rank == 0)
        if rank == 0:       # saves that a killed earlier run left half-written
            remove_stale_temps(self.out, shared=True)

    # What a checkpoint saves (save_train_checkpoint reads these).
    @property
    def optimizers(self) -> list[torch.optim.Optimizer]:
        return self.stage.optimizers

    @property
    def schedulers(self) -> list:
        return self.stage.schedulers

    @property
    def blocks(self):
        return self.stage.blocks

    def train_step(self) -> dict:
        """One optimizer step of the current stage; returns its metrics (mean ``loss``, ...)."""
        stage = self.stage
        record: dict = {}
        sent_before = self._bytes_sent()
        device = next(self.model.parameters()).device
        for _ in range(stage.grad_accum):
            batch = next_batch(stage.blocks, stage.batch_size)
            if device.type != "cpu":
                batch = tuple(t.to(device, non_blocking=True) for t in batch)
            metrics = stage.objective.backward(batch, stage.grad_accum)
            record = {k: record[k] + v if k in record and isinstance(v, float) else v
                      for k, v in metrics.items()}
        record["loss"] = process_group.mean_over_ranks(record["loss"], self.world)
        if stage.clip > 0:
            for group in stage.objective.clip_groups():
                process_group.clip_grad_norm_(group, stage.clip)
        for opt in stage.optimizers:
            opt.step()
            opt.zero_grad(set_to_none=True)
        for sch in stage.schedulers:
            sch.step()
        self.step += 1
        if self.after_step is not None:
            self.after_step(self.step)
        if self.routing is not None:   # balance the experts; load and routing metrics
            record.update(self.routing.after_step(self.step, final=self.step == self.total))
        if self.counters and self.world > 1:
            sent = process_group.per_rank(self._bytes_sent() - sent_before, self.world)
            record["comm_bytes"], record["comm_bytes_per_rank"] = max(sent), sent
        return record

    def _bytes_sent(self) -> int:
        return sum(row["sent"] for c in self.counters for row in c.totals().values())

    def save(self) -> pathlib.Path:
        """Write ``ckpt-<step>/`` (every rank must call it under ``torchrun``)."""
        target = self.out / f"ckpt-{self.step:06d}"
        if self.save_fn is not None:
            return guarded_save(self.save_fn, self, target)
        if self.distributed_checkpoints:
            from hyla.train.checkpointing.dcp import save_dcp_checkpoint

            return guarded_save(save_dcp_checkpoint, self, target)
        return save_train_checkpoint(self, target)

    def _weights_finite(self) -> bool:
        """Whether every rank's parameters (its shards) are finite: checked before a save,
        since a loss can still be finite on the step whose update overflowed."""
        bad = any(not bool(torch.isfinite(getattr(p, "to_local", lambda p=p: p)()).all())
                  for p in self.model.parameters())
        return process_group.mean_over_ranks(float(bad), self.world) == 0

    def _diverged(self, what: str) -> ValueError:
        """The error that ends a diverged run before its bad weights are saved: they would
        become its newest checkpoint (a NaN run once saved them and went on)."""
        return ValueError(f"step {self.step}: {what} (the run diverged); this step is not "
                          f"saved and the run's checkpoints are kept (the newest may already "
                          f"hold weights too large to use: if it fails, remove it and resume "
                          f"from the one before); a new run with a lower learning rate or "
                          f"--clip can start from a good one with --init")

    def fit(self, until: int | None = None, progress: bool = True) -> dict:
        """Train to the run's last step (or to global step ``until``); returns the last
        metrics record (with ``val_loss`` where the run ends a stage)."""
        end = self.total if until is None else min(until, self.total)
        record: dict = {**self.stage.tags, "step": self.step}
        bar = ProgressDisplay(self.total, self.step, label=self.stage.label,
                              enabled=progress and self.rank == 0)
        with bar:
            while self.step < end:
                stage = self.stage
                # the rate this step uses (read after it, it would be the next step's: 0 at
                # the end of a decay, which the progress bar then shows)
                lr = (stage.schedulers[0].get_last_lr()[0] if stage.schedulers
                      else stage.optimizers[0].param_groups[0]["lr"])
                start = time.perf_counter()
                metrics = self.train_step()
                seconds = time.perf_counter() - start
                if not math.isfinite(metrics["loss"]):
                    # every rank sees the same mean loss: all stop here
                    raise self._diverged(f"the training loss is {metrics['loss']}")
                record = {**stage.tags, "step": self.step, **metrics, "lr": lr,
                          "tokens": stage.tokens_before
                          + (self.step - stage.start) * stage.tokens_per_step,
                          "tokens_per_s": stage.tokens_per_step / seconds}
                stage_end = self.step == stage.end
                if self.validate is not None and (
                        stage_end or (stage.eval_every and self.step % stage.eval_every == 0)):
                    found = self.validate()
                    # a float, or a dict of validation fields with "val_loss" among them
                    record.update(found if isinstance(found, dict) else {"val_loss": found})
                self.metrics.write(record)
                bar.update(self.step, record, stage.label)
                if self.step % self.cfg.save_every == 0 or stage_end or self.step == end:
                    if not self._weights_finite():
                        raise self._diverged("a weight is NaN or infinite")
                    self.save()
                if stage_end and stage.then is not None:
                    self.stage = stage.then() or stage
        return record
