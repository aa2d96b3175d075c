"""``hyla distill``: turn a softmax-attention teacher into a hybrid student, in two stages.

1. Attention transfer: the teacher is frozen; every student layer that differs from it
   (``G`` layers, ``A`` layers with fewer KV heads) is trained on the teacher's own hidden
   states to reproduce that teacher layer (:func:`hyla.train.distill_loss.layer_transfer_loss`:
   normalised output MSE, plus StreamKL on attention distributions for compressed ``A``
   layers). Layers are independent: each backward reaches one layer, and only one layer's
   graph lives at a time, so long sequences fit.
2. End to end: KL(teacher || student) over the vocabulary, computed in token chunks, plus the
   next-token cross-entropy; Muon + AdamW as ``hyla train``.

A run directory looks like a training run's: ``metrics.jsonl`` (``stage``, ``step``,
``loss``, ... a step; ``step`` counts both stages), ``tokenizer.json``, ``ckpt-<step>/``
(an ordinary hyla checkpoint plus ``train_state.pt``) and ``stage1/`` (the student after
stage 1). ``hyla generate|eval|serve`` load it; ``resume=`` continues exactly.
"""

from __future__ import annotations

import json
import math
import pathlib
import time
import types

import torch
from torch import nn

from hyla.data.packing import corpus_blocks
from hyla.model.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from hyla.model.hf import is_hf_directory, load_hf
from hyla.train.checkpointing import STATE, save_train_checkpoint
from hyla.train.config import wsd_lr_factor
from hyla.train.distill_config import DistillConfig
from hyla.train.distill_init import build_student, transfer_layers
from hyla.train.distill_loss import (
    _mixer,
    chunked_vocab_kl,
    final_hidden,
    layer_transfer_loss,
    positions_for,
)
from hyla.train.optim import run_optimizers
from hyla.train.trainer import stack_blocks, validation_loss


def load_teacher(path: str):
    """(teacher HylaLM in eval mode, tokenizer) from a transformers directory or a hyla
    checkpoint whose layers are all attention."""
    root = pathlib.Path(path)
    if not root.is_dir():
        raise ValueError(f"--teacher {str(path)!r} is not a directory: expected a transformers "
                         f"model directory (Llama, Mistral, Qwen2) or a hyla checkpoint")
    if is_hf_directory(root):
        model, tok = load_hf(root)
    elif (latest_checkpoint(root) / "config.json").is_file():
        model, tok = load_checkpoint(root)
        if tok.vocab_size > model.cfg.vocab_size:
            raise ValueError(f"tokenizer mismatch: {latest_checkpoint(root) / 'tokenizer.json'} "
                             f"has {tok.vocab_size} tokens, more than the model's vocab_size "
                             f"{model.cfg.vocab_size}")
    else:
        raise ValueError(f"--teacher {str(path)!r} has no config.json: expected a transformers "
                         f"model directory (Llama, Mistral, Qwen2) or a hyla checkpoint")
    if set(model.cfg.layers) != {"A"}:
        raise ValueError(f"--teacher {str(path)!r} has layers={model.cfg.layers!r}: expected an "
                         f"all-attention model")
    return model.eval().requires_grad_(False), tok


def load_distill_state(run_dir: pathlib.Path) -> dict:
    """The newest complete checkpoint of a distillation run (weights, optimizers, position)."""
    from safetensors.torch import load_file

    ckpt = latest_checkpoint(run_dir)
    if ckpt == run_dir or not (ckpt / STATE).is_file():
        raise ValueError(f"{run_dir} has no complete ckpt-<step> directory to resume from: "
                         f"expected the --out directory of an earlier hyla distill")
    try:
        state = torch.load(ckpt / STATE, weights_only=True)
        state["model"] = load_file(str(ckpt / "model.safetensors"))
        state["cfg"] = DistillConfig(**state["cfg"])
    except Exception as e:
        raise ValueError(f"{ckpt} is not a readable distillation checkpoint ({e})") from e
    return state


class Distiller:
    """Build (or restore) a distillation run and train it.

    Example:
        >>> d = Distiller(DistillConfig(teacher="t", layers="GGGA"))  # doctest: +SKIP
        >>> d.fit()["stage"]                                           # doctest: +SKIP
        2
    """

    def __init__(self, cfg: DistillConfig | None = None, resume: str | None = None):
        if cfg is None and resume is None:
            raise ValueError("Distiller needs a DistillConfig or resume=DIR")
        state = load_distill_state(pathlib.Path(resume)) if resume else None
        if state is not None:
            cfg = state["cfg"]
        if not cfg.teacher or not cfg.layers:
            raise ValueError("--teacher DIR and --layers PATTERN are required")
        self.cfg = cfg
        self.out = pathlib.Path(resume or cfg.out)
        torch.manual_seed(cfg.seed)
        self.teacher, self.tokenizer = load_teacher(cfg.teacher)
        self.model = build_student(self.teacher, cfg.layers, cfg.student_kv_heads)
        self.model.activation_checkpointing = cfg.activation_checkpointing
        self.transfer = transfer_layers(self.teacher.cfg, self.model.cfg)
        self.stage1_steps = cfg.stage1_steps if self.transfer else 0  # nothing to transfer
        self.total_steps = self.stage1_steps + cfg.stage2_steps
        self.step = 0
        if state is not None:
            missing, unexpected = self.model.load_state_dict(state["model"], strict=False)
            if unexpected or [k for k in missing if k != "lm_head.weight"]:
                raise ValueError(f"checkpoint in {self.out} does not match the student")
            self.step = state["step"]
        self.out.mkdir(parents=True, exist_ok=True)
        if hasattr(self.tokenizer, "save"):
            self.tokenizer.save(self.out / "tokenizer.json")
        self._setup_stage(state)
        if state is not None:
            torch.set_rng_state(state["rng"])
        self.metrics_path = self.out / "metrics.jsonl"
        self._truncate_metrics()

    @property
    def stage(self) -> int:
        return 1 if self.step < self.stage1_steps else 2

    def _setup_stage(self, state: dict | None) -> None:
        """Optimizers, schedulers and data of the current stage (restored from ``state`` when
        it was saved inside this stage, fresh at the stage's first step)."""
        cfg, stage = self.cfg, self.stage
        if stage == 1:
            self.trainable = nn.ModuleList(self.model.blocks[i].mixer for i in self.transfer)
            lrs = types.SimpleNamespace(optimizer=cfg.optimizer, lr=cfg.stage1_lr,
                                        muon_lr=cfg.stage1_muon_lr,
                                        weight_decay=cfg.weight_decay)
            steps, seq_len, start = self.stage1_steps, cfg.stage1_len, 0
        else:
            self.trainable = self.model
            lrs = cfg
            steps, seq_len, start = cfg.stage2_steps, cfg.seq_len, self.stage1_steps
        self.model.requires_grad_(stage == 2)
        self.trainable.requires_grad_(True)
        self.optimizers = run_optimizers(self.trainable, lrs)
        sched = types.SimpleNamespace(steps=steps, warmup_steps=min(cfg.warmup_steps, steps),
                                      decay_fraction=cfg.decay_fraction)
        self.schedulers = [torch.optim.lr_scheduler.LambdaLR(o, lambda s: wsd_lr_factor(s, sched))
                           for o in self.optimizers]
        position = None
        if state is not None and state["step"] > start:  # saved inside this stage
            for opt, sd in zip(self.optimizers, state["optimizers"], strict=True):
                opt.load_state_dict(sd)
            for sch, sd in zip(self.schedulers, state["schedulers"], strict=True):
                sch.load_state_dict(sd)
            position = state["data_position"]
        self.blocks = corpus_blocks(cfg.data, self.tokenizer, seq_len, split="train",
                                    seed=cfg.seed + stage - 1, position=position)

    def _truncate_metrics(self) -> None:
        if not self.metrics_path.is_file():
            return
        lines = self.metrics_path.read_text().splitlines()
        kept = [ln for ln in lines if ln and json.loads(ln)["step"] <= self.step]
        self.metrics_path.write_text("".join(ln + "\n" for ln in kept))

    def _batch(self):
        return stack_blocks([next(self.blocks) for _ in range(self.cfg.batch_size)])

    def stage1_step(self) -> dict:
        """One attention-transfer step; returns the mean layer loss and each layer's parts."""
        ids, _, cu = self._batch()
        positions = positions_for(ids, cu)
        teacher, student = self.teacher.blocks, self.model.blocks
        layers = {}
        with torch.no_grad():
            x = self.teacher.embed(ids)
        for i, t_block in enumerate(teacher):
            with torch.no_grad():
                h = t_block.mixer_norm(x)
                y_t = _mixer(t_block.mixer, h, positions, cu)
            if i in self.transfer:
                loss, parts = layer_transfer_loss(t_block.mixer, student[i].mixer, h, positions,
                                                  cu, kl_weight=self.cfg.attn_kl_weight,
                                                  y_teacher=y_t)
                loss.backward()
                if self.cfg.clip > 0:  # per layer: layers stay independent
                    nn.utils.clip_grad_norm_(student[i].mixer.parameters(), self.cfg.clip)
                layers[str(i)] = {"loss": loss.item(), **parts}
            with torch.no_grad():
                x = x + y_t
                x = x + t_block.mlp(t_block.mlp_norm(x))
        self._optimizer_step()
        return {"loss": sum(v["loss"] for v in layers.values()) / len(layers), "layers": layers}

    def stage2_step(self) -> dict:
        """One end-to-end step: chunked vocabulary KL to the teacher plus cross-entropy."""
        ids, labels, cu = self._batch()
        with torch.no_grad():
            h_t = final_hidden(self.teacher, ids, cu)
        h_s = final_hidden(self.model, ids, cu)
        loss, kl, ce = chunked_vocab_kl(h_s.flatten(0, 1), self.model.lm_head.weight,
                                        h_t.flatten(0, 1), self.teacher.lm_head.weight,
                                        labels.flatten(), kl_weight=self.cfg.kl_weight,
                                        ce_weight=self.cfg.ce_weight, chunk=self.cfg.vocab_chunk,
                                        temperature=self.cfg.temperature)
        loss.backward()
        if self.cfg.clip > 0:
            nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.clip)
        self._optimizer_step()
        return {"loss": loss.item(), "kl": kl.item(), "ce": ce.item()}

    def _optimizer_step(self) -> None:
        for opt in self.optimizers:
            opt.step()
            opt.zero_grad(set_to_none=True)
        for sch in self.schedulers:
            sch.step()
        self.step += 1

    def _tokens_seen(self) -> int:
        s1 = min(self.step, self.stage1_steps)
        return s1 * self.cfg.stage1_tokens_per_step + (self.step - s1) * self.cfg.tokens_per_step

    def save(self) -> pathlib.Path:
        return save_train_checkpoint(self, self.out / f"ckpt-{self.step:06d}")

    def fit(self, progress: bool = True, until: int | None = None) -> dict:
        """Run both stages to the end (or to global step ``until``); returns the last record."""
        cfg = self.cfg
        end = self.total_steps if until is None else min(until, self.total_steps)
        record: dict = {"stage": self.stage, "step": self.step}
        with _progress(progress) as bar, open(self.metrics_path, "a") as log:
            task = bar.add_task("distill", total=self.total_steps, completed=self.step,
                                stage=self.stage, loss=math.nan)
            while self.step < end:
                stage = self.stage
                start = time.perf_counter()
                record = self.stage1_step() if stage == 1 else self.stage2_step()
                tokens = cfg.stage1_tokens_per_step if stage == 1 else cfg.tokens_per_step
                record = {"stage": stage, "step": self.step, **record,
                          "lr": self.schedulers[0].get_last_lr()[0],
                          "tokens": self._tokens_seen(),
                          "tokens_per_s": tokens / (time.perf_counter() - start)}
                stage_end = self.step in (self.stage1_steps, self.total_steps)
                if stage_end:
                    record["val_loss"] = validation_loss(self.model, self.tokenizer, cfg)
                log.write(json.dumps(record) + "\n")
                log.flush()
                bar.update(task, completed=self.step, stage=stage, loss=record["loss"])
                if self.step % cfg.save_every == 0 or stage_end or self.step == end:
                    self.save()
                if stage == 1 and self.step == self.stage1_steps:
                    save_checkpoint(self.model, self.out / "stage1", self.tokenizer)
                    self._setup_stage(None)
        return record


def _progress(enabled: bool):
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,
    )

    return Progress(TextColumn("distill stage {task.fields[stage]}"), MofNCompleteColumn(),
                    BarColumn(), TextColumn("loss {task.fields[loss]:.4f}"),
                    TimeRemainingColumn(), disable=not enabled)
