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

The loop is :class:`hyla.train.loop.Loop`; the stages are its objectives
:class:`~hyla.train.distill_objectives.AttentionTransfer` and
:class:`~hyla.train.distill_objectives.VocabularyKL`.
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
from hyla.model.formats.checkpoint import save_checkpoint
from hyla.train.checkpointing import (
    load_train_state,
    restore_optimizers,
    restore_weights,
    run_dir_of,
)
from hyla.train.config import wsd_lr_factor
from hyla.train.distill_config import DistillConfig
from hyla.train.distill_init import (
    build_student,
    calibrate_student,
    probe_block,
    transfer_layers,
)
from hyla.train.distill_layers import choose_layers
from hyla.train.distill_objectives import (
    AttentionTransfer,
    Autocast,
    VocabularyKL,
    autocast_dtype,
    new_parameters,
)
from hyla.train.loop import Loop, Stage
from hyla.train.lora import add_lora, has_lora, lora_parameters, merge_lora
from hyla.train.objectives import validation_loss
from hyla.train.optim import run_optimizers


def load_teacher(path: str):
    """(teacher HylaLM in eval mode, tokenizer) from any :func:`hyla.model.load_model` source
    (a transformers directory, a .gguf file, a hyla checkpoint...) whose layers are all
    attention."""
    from hyla.model.load import load_model

    model, tok = load_model(path)
    if tok.vocab_size > model.cfg.vocab_size:
        raise ValueError(f"tokenizer mismatch: the tokenizer of --teacher {str(path)!r} has "
                         f"{tok.vocab_size} tokens, more than the model's vocab_size "
                         f"{model.cfg.vocab_size}")
    if set(model.cfg.layers) != {"A"}:
        raise ValueError(f"--teacher {str(path)!r} has layers={model.cfg.layers!r}: expected an "
                         f"all-attention model")
    for name in ("mixer_options", "layer_overrides"):
        if getattr(model.cfg, name):
            raise ValueError(f"--teacher {str(path)!r} has {name} (attention that differs by "
                             f"layer or has gates, sinks or other value dims, as MiMo-V2-Flash "
                             f"does): distillation starts students from plain attention "
                             f"layers only")
    return model.eval().requires_grad_(False), tok


class Distiller:
    """Build (or restore) a distillation run; ``fit`` trains both stages.

    Attributes: ``cfg``, ``out``, ``teacher``, ``model`` (the student), ``tokenizer``,
    ``transfer`` (the layers stage 1 trains), ``stage1_steps``, ``total_steps``, ``loop``
    (the :class:`~hyla.train.loop.Loop`), ``step`` and ``stage``.

    Example:
        >>> import dataclasses, tempfile, pathlib
        >>> from hyla.model import HylaLM, preset
        >>> d = pathlib.Path(tempfile.mkdtemp())
        >>> teacher = HylaLM(dataclasses.replace(preset("debug"), layers="AA"))
        >>> _ = save_checkpoint(teacher, d / "teacher")
        >>> cfg = DistillConfig(teacher=str(d / "teacher"), layers="GA", stage1_steps=1,
        ...                     stage2_steps=1, seq_len=16, batch_size=1, eval_batches=1,
        ...                     vocab_chunk=8, out=str(d / "student"))
        >>> Distiller(cfg).fit(progress=False)["stage"]
        2
    """

    def __init__(self, cfg: DistillConfig | None = None, resume: str | None = None):
        if cfg is None and resume is None:
            raise ValueError("Distiller needs a DistillConfig or resume=DIR")
        state = (load_train_state(pathlib.Path(resume), config_type=DistillConfig,
                                  command="hyla distill") if resume else None)
        if state is not None:
            cfg = state["cfg"]
        if not cfg.teacher or not cfg.layers:
            raise ValueError("--teacher DIR and --layers PATTERN are required")
        self.cfg = cfg
        self.out = run_dir_of(resume) if resume else pathlib.Path(cfg.out)
        torch.manual_seed(cfg.seed)
        self.teacher, self.tokenizer = load_teacher(cfg.teacher)
        if cfg.eval_data and cfg.report_tokens and not pathlib.Path(cfg.eval_data).exists():
            raise ValueError(f"--eval-data {cfg.eval_data!r} does not exist (the report's "
                             f"held-out text: a file or folder)")
        self.layers = cfg.layers
        if state is not None:           # the pattern it was built with (auto:N chosen once)
            self.layers = json.loads((pathlib.Path(state["resumed_from"]) / "config.json")
                                     .read_text())["layers"]
        elif cfg.layers.startswith("auto"):          # the teacher picks its attention layers
            self.layers = choose_layers(self.teacher, cfg.layers, probe_block(cfg, self.tokenizer),
                                        window=cfg.window or 64, sinks=cfg.sinks)
        self.model = build_student(self.teacher, self.layers, cfg.student_kv_heads,
                                   window=cfg.window, sinks=cfg.sinks)
        self.model.activation_checkpointing = cfg.activation_checkpointing
        self.transfer = transfer_layers(self.teacher.cfg, self.model.cfg)
        self.stage1_steps = cfg.stage1_steps if self.transfer else 0  # nothing to transfer
        self.total_steps = self.stage1_steps + cfg.stage2_steps
        self.autocast = autocast_dtype(cfg.autocast, next(self.model.parameters()).device)
        self._teacher_val: float | None = None
        step = 0
        self.out.mkdir(parents=True, exist_ok=True)
        calibration = self.out / "calibration.json"
        self.calibration = None
        if state is None and self.stage1_steps:
            self.calibration = calibrate_student(self.teacher, self.model, self.transfer, cfg,
                                                 self.tokenizer)
            calibration.write_text(json.dumps(self.calibration))
        elif calibration.is_file():
            self.calibration = json.loads(calibration.read_text())
        if state is not None:
            if any(".lora." in k for k in state["model"]):     # saved inside a LoRA stage 2
                add_lora(self.model, cfg.lora_rank, cfg.lora_alpha)
            restore_weights(self.model, state, f"checkpoint in {self.out} does not match the "
                                               f"student")
            step = state["step"]
        if hasattr(self.tokenizer, "save"):
            self.tokenizer.save(self.out / "tokenizer.json")
        stage = self._stage(step, state)
        if state is not None:
            torch.set_rng_state(state["rng"])
        self.loop = Loop(out=self.out, cfg=cfg, model=self.model, tokenizer=self.tokenizer,
                         stage=stage, total=self.total_steps, step=step, validate=self.validate)

    def validate(self) -> dict:
        """Validation loss and perplexity of the student, beside the teacher's (computed
        once: it does not change)."""
        student = validation_loss(self.model, self.tokenizer, self.cfg)
        if self._teacher_val is None:
            self._teacher_val = validation_loss(self.teacher, self.tokenizer, self.cfg)
        return {"val_loss": student, "val_ppl": math.exp(min(student, 700.0)),
                "teacher_val_loss": self._teacher_val,
                "teacher_val_ppl": math.exp(min(self._teacher_val, 700.0))}

    @property
    def step(self) -> int:
        return self.loop.step

    @property
    def stage(self) -> int:
        return 1 if self.step < self.stage1_steps else 2

    def _stage(self, step: int, state: dict | None) -> Stage:
        """The stage holding ``step``: its objective, optimizers, schedulers and data (restored
        from ``state`` when it was saved inside this stage, fresh at the stage's first step)."""
        cfg = self.cfg
        stage = 1 if step < self.stage1_steps else 2
        mixers = [self.model.blocks[i].mixer for i in self.transfer]
        self.model.requires_grad_(False)
        if stage == 1:
            # only what the teacher did not give (a linearised layer's feature maps, gates
            # and mix), or the whole mixer where nothing was given
            params = [p for m in mixers for p in new_parameters(m)]
            lrs = types.SimpleNamespace(optimizer=cfg.optimizer, lr=cfg.stage1_lr,
                                        muon_lr=cfg.stage1_muon_lr,
                                        weight_decay=cfg.weight_decay)
            steps, seq_len, start = self.stage1_steps, cfg.stage1_len, 0
            objective = AttentionTransfer(self.teacher, self.model, self.transfer,
                                          kl_weight=cfg.attn_kl_weight)
        else:
            lrs = cfg
            if cfg.lora_rank:
                params = (lora_parameters(self.model) if has_lora(self.model) else
                          add_lora(self.model, cfg.lora_rank, cfg.lora_alpha))
                params += [p for m in mixers if hasattr(m, "new_parameters")
                           for p in m.new_parameters()]
                lrs = types.SimpleNamespace(optimizer="adamw", lr=cfg.lr,
                                            weight_decay=cfg.weight_decay)
            else:
                params = list(self.model.parameters())
            steps, seq_len, start = cfg.stage2_steps, cfg.seq_len, self.stage1_steps
            objective = VocabularyKL(self.model, self.teacher, kl_weight=cfg.kl_weight,
                                     ce_weight=cfg.ce_weight, chunk=cfg.vocab_chunk,
                                     temperature=cfg.temperature)
        for p in params:
            p.requires_grad_(True)
        if self.autocast is not None:
            objective = Autocast(objective, self.autocast)
        # stage 1 optimises the transferred mixers (as before: same optimizer layout)
        optimizers = run_optimizers(nn.ModuleList(mixers) if stage == 1 else self.model, lrs)
        sched = types.SimpleNamespace(steps=steps, warmup_steps=min(cfg.warmup_steps, steps),
                                      decay_fraction=cfg.decay_fraction)
        schedulers = [torch.optim.lr_scheduler.LambdaLR(o, lambda s: wsd_lr_factor(s, sched))
                      for o in optimizers]
        position = None
        if state is not None and state["step"] > start:  # saved inside this stage
            restore_optimizers(optimizers, schedulers, state)
            position = state["data_position"]
        # The buffer holds the same number of tokens in both stages (stage 1's blocks may be
        # much longer).
        buffer = max(1, cfg.shuffle_buffer * cfg.seq_len // seq_len) if cfg.shuffle_buffer else 0
        blocks = corpus_blocks(cfg.data, self.tokenizer, seq_len, split="train",
                               seed=cfg.seed + stage - 1, shuffle_buffer=buffer,
                               position=position)
        tokens = cfg.stage1_tokens_per_step if stage == 1 else cfg.tokens_per_step
        return Stage(objective=objective, optimizers=optimizers, schedulers=schedulers,
                     blocks=blocks, end=start + steps, batch_size=cfg.batch_size,
                     tokens_per_step=tokens, start=start,
                     tokens_before=start * cfg.stage1_tokens_per_step, clip=cfg.clip,
                     eval_every=cfg.eval_every,
                     tags={"stage": stage}, label=f"distill stage {stage}",
                     then=self._end_stage1 if stage == 1 else None)

    def _end_stage1(self) -> Stage:
        save_checkpoint(self.model, self.out / "stage1", self.tokenizer)
        return self._stage(self.step, None)

    def train_step(self) -> dict:
        """One step of the current stage; returns its metrics (``loss``, and ``layers`` in
        stage 1 or ``kl`` and ``ce`` in stage 2)."""
        return self.loop.train_step()

    def save(self) -> pathlib.Path:
        """Write ``ckpt-<step>/`` now."""
        return self.loop.save()

    def fit(self, progress: bool = True, until: int | None = None) -> dict:
        """Run both stages to the end (or to global step ``until``); returns the last record.

        At the end of the run, LoRA adapters are merged into the weights of the last
        checkpoint (an ordinary model from then on) and, unless ``report_tokens`` is 0,
        ``report.json`` is written (:func:`hyla.train.distill_report.write_report`)."""
        start = time.perf_counter()
        record = self.loop.fit(until=until, progress=progress)
        if self.step == self.total_steps:
            if has_lora(self.model):
                merge_lora(self.model)
                save_checkpoint(self.model, self.out / f"ckpt-{self.step:06d}", self.tokenizer)
            if self.cfg.report_tokens:
                from hyla.train.distill_report import write_report

                write_report(self, train_seconds=time.perf_counter() - start)
        return record
