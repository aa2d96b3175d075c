"""The training loop: packed blocks in, checkpoints and a metrics log out, exactly resumable.

A run directory holds ``tokenizer.json``, ``metrics.jsonl`` (one JSON object a step) and
``ckpt-<step>/`` directories (model checkpoint + ``train_state.pt``: optimizers, schedulers,
data position, RNG states). A resumed run continues from the newest checkpoint and, on CPU in
fp32, reproduces the uninterrupted run's losses bit for bit.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import pathlib
import time

import torch
import torch.nn.functional as F

from hyla.data.corpus import iter_documents
from hyla.data.packing import corpus_blocks
from hyla.data.tokenizer import load_tokenizer, train_bpe
from hyla.model import HylaLM, preset
from hyla.train import distributed
from hyla.train.checkpointing import load_train_state, save_train_checkpoint
from hyla.train.config import TrainConfig, wsd_lr_factor
from hyla.train.optim import run_optimizers


def stack_blocks(blocks: list[dict]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """B blocks -> one packed row (input_ids [1, B*T], labels [1, B*T], cu_seqlens).

    The model's varlen path takes one row; every block edge is a document edge, so the state
    never leaks from one block into the next.
    """
    T = blocks[0]["input_ids"].numel()
    ids = torch.cat([b["input_ids"] for b in blocks])[None]
    labels = torch.cat([b["labels"] for b in blocks])[None]
    cu = torch.cat([blocks[0]["cu_seqlens"][:1]]
                   + [b["cu_seqlens"][1:] + i * T for i, b in enumerate(blocks)])
    return ids, labels, cu


def lm_loss(model: HylaLM, ids, labels, cu, precision: str) -> torch.Tensor:
    """Mean next-token cross-entropy over the labelled positions."""
    autocast = (torch.autocast(ids.device.type, dtype=torch.bfloat16) if precision == "bf16"
                else contextlib.nullcontext())
    with autocast:
        logits = model(ids, cu_seqlens=cu)
    return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=-100)


@torch.no_grad()
def validation_loss(model: HylaLM, tokenizer, cfg: TrainConfig) -> float:
    """Mean loss over the first ``eval_batches`` blocks of the validation split (fixed)."""
    was_training = model.training
    model.eval()
    blocks = corpus_blocks(cfg.data, tokenizer, cfg.seq_len, split="validation", seed=0)
    losses = [lm_loss(model, *stack_blocks([next(blocks) for _ in range(cfg.batch_size)]),
                      cfg.precision).item() for _ in range(cfg.eval_batches)]
    model.train(was_training)
    return sum(losses) / len(losses)


class Trainer:
    """Build (or restore) a run and train it.

    Example:
        >>> import tempfile
        >>> cfg = TrainConfig(preset="debug", steps=2, seq_len=32, batch_size=2,
        ...                   vocab_size=300, tokenizer_documents=5, out=tempfile.mkdtemp())
        >>> Trainer(cfg).fit(progress=False)["step"]
        2
    """

    def __init__(self, cfg: TrainConfig, resume: str | None = None):
        self.out = pathlib.Path(resume or cfg.out)
        # World size 1 (no torchrun, no process group): every distributed hook below is skipped.
        self.rank, self.world = distributed.setup()
        state = load_train_state(self.out, cfg) if resume else None
        if state is not None:
            distributed.check_resume_world(state, self.world, self.out)
            cfg = state["cfg"]
        self.cfg = cfg
        torch.manual_seed(cfg.seed)
        self.out.mkdir(parents=True, exist_ok=True)
        with distributed.rank_zero_first(self.world):
            self.tokenizer = self._tokenizer(state is not None)
        model_cfg = dataclasses.replace(preset(cfg.preset), vocab_size=self.tokenizer.vocab_size)
        if cfg.layers is not None:
            model_cfg = dataclasses.replace(model_cfg, layers=cfg.layers)  # validated there
        self.model = HylaLM(model_cfg)
        self.model.activation_checkpointing = cfg.activation_checkpointing
        if self.world > 1:
            distributed.broadcast_parameters(self.model)
            self.optimizers = distributed.build_optimizers(self.model, cfg)
        else:
            self.optimizers = run_optimizers(self.model, cfg)
        self.schedulers = [torch.optim.lr_scheduler.LambdaLR(o, lambda s: wsd_lr_factor(s, cfg))
                           for o in self.optimizers]
        self.step, position = 0, None
        if state is not None:
            # strict=False: a tied output head is stored once, as the embedding
            missing, unexpected = self.model.load_state_dict(state["model"], strict=False)
            if unexpected or [k for k in missing if k != "lm_head.weight"]:
                raise ValueError(f"checkpoint in {self.out} does not match preset {cfg.preset}")
            for opt, sd in zip(self.optimizers, state["optimizers"], strict=True):
                opt.load_state_dict(sd)
            for sch, sd in zip(self.schedulers, state["schedulers"], strict=True):
                sch.load_state_dict(sd)
            torch.set_rng_state(state["rng"])
            self.step, position = state["step"], state["data_position"]
        self.blocks = corpus_blocks(cfg.data, self.tokenizer, cfg.seq_len, split="train",
                                    seed=cfg.seed, position=position)
        if self.world > 1:
            self.blocks = distributed.StridedBlocks(self.blocks, self.rank, self.world)
        self.metrics_path = self.out / "metrics.jsonl"
        if self.rank == 0:
            self._truncate_metrics()

    def _tokenizer(self, resuming: bool):
        path = self.out / "tokenizer.json"
        if resuming or path.is_file():
            return load_tokenizer(self.out)
        docs = iter_documents(self.cfg.data, "train")
        sample = (d for _, d in zip(range(self.cfg.tokenizer_documents), docs, strict=False))
        tok = train_bpe(sample, self.cfg.vocab_size)
        tok.save(path)
        return tok

    def _truncate_metrics(self) -> None:
        # A resumed run rewrites the steps after its checkpoint: keep the log one line a step.
        if not self.metrics_path.is_file():
            return
        lines = self.metrics_path.read_text().splitlines()
        kept = [ln for ln in lines if ln and json.loads(ln)["step"] <= self.step]
        self.metrics_path.write_text("".join(ln + "\n" for ln in kept))

    def train_step(self) -> float:
        """One optimizer step (with gradient accumulation); returns the mean loss."""
        cfg = self.cfg
        self.model.train()
        total = 0.0
        offload = (torch.autograd.graph.save_on_cpu(pin_memory=torch.cuda.is_available())
                   if cfg.offload_activations else contextlib.nullcontext())
        for _ in range(cfg.grad_accum):
            batch = stack_blocks([next(self.blocks) for _ in range(cfg.batch_size)])
            with offload:
                loss = lm_loss(self.model, *batch, cfg.precision) / cfg.grad_accum
            loss.backward()
            total += loss.item()
        if self.world > 1:  # before clipping, so every rank clips the same averaged gradient
            total = distributed.average_gradients(self.model, total, self.world)
        if cfg.clip > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.clip)
        for opt in self.optimizers:
            opt.step()
            opt.zero_grad(set_to_none=True)
        for sch in self.schedulers:
            sch.step()
        self.step += 1
        return total

    def save(self) -> pathlib.Path:
        target = self.out / f"ckpt-{self.step:06d}"
        if self.world > 1:
            return distributed.save(self, target)
        return save_train_checkpoint(self, target)

    def fit(self, progress: bool = True) -> dict:
        """Train to ``cfg.steps``; returns the last metrics record (with ``val_loss``)."""
        cfg = self.cfg
        record: dict = {"step": self.step}
        tokens_per_step = cfg.tokens_per_step * self.world  # the global batch
        bar = _progress(progress and self.rank == 0)
        log_path = self.metrics_path if self.rank == 0 else os.devnull  # rank 0 logs alone
        with bar, open(log_path, "a") as log:
            task = bar.add_task("train", total=cfg.steps, completed=self.step, loss=math.nan,
                                tok_s=0.0, lr=0.0)
            while self.step < cfg.steps:
                start = time.perf_counter()
                loss = self.train_step()
                seconds = time.perf_counter() - start
                record = {"step": self.step, "loss": loss,
                          "lr": self.schedulers[0].get_last_lr()[0],
                          "tokens": self.step * tokens_per_step,
                          "tokens_per_s": tokens_per_step / seconds}
                last = self.step == cfg.steps
                if (cfg.eval_every and self.step % cfg.eval_every == 0) or last:
                    record["val_loss"] = validation_loss(self.model, self.tokenizer, cfg)
                log.write(json.dumps(record) + "\n")
                log.flush()
                bar.update(task, completed=self.step, loss=loss, tok_s=record["tokens_per_s"],
                           lr=record["lr"])
                if self.step % cfg.save_every == 0 or last:
                    self.save()
        return record


def _progress(enabled: bool):
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,
    )

    return Progress(TextColumn("step"), MofNCompleteColumn(), BarColumn(),
                    TextColumn("loss {task.fields[loss]:.3f}"),
                    TextColumn("{task.fields[tok_s]:,.0f} tok/s"),
                    TextColumn("lr {task.fields[lr]:.2e}"), TimeRemainingColumn(),
                    disable=not enabled)
