"""``hyla distill``: turn a softmax-attention teacher into a hybrid student, in two stages.

1. Attention transfer: the teacher is frozen; every student layer that differs from it
   (``G`` layers, ``A`` layers with fewer KV heads) is trained on the teacher's own hidden
   states to reproduce that teacher layer (:func:`hyla.train.distill.losses.layer_transfer_loss`:
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
:class:`~hyla.train.distill.objectives.AttentionTransfer` and
:class:`~hyla.train.distill.objectives.VocabularyKL`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import pathlib
import time
import types
from collections.abc import Callable

import torch
from torch import nn

from hyla.data.corpus import list_documents
from hyla.data.packing import PackedBlocks, corpus_blocks
from hyla.model.formats.checkpoint import save_checkpoint
from hyla.model.mixers.attention import AttentionMixer
from hyla.train.checkpointing import (
    load_train_state,
    restore_optimizers,
    restore_weights,
    run_dir_of,
)
from hyla.train.config import wsd_lr_factor
from hyla.train.distill.config import DistillConfig
from hyla.train.distill.layer_ranking import choose_layers
from hyla.train.distill.objectives import (
    AttentionTransfer,
    Autocast,
    VocabularyKL,
    autocast_dtype,
    new_parameters,
)
from hyla.train.distill.recipes import get_recipe
from hyla.train.distill.student import (
    build_student,
    calibrate_student,
    probe_block,
    transfer_layers,
)
from hyla.train.loop import Loop, Stage
from hyla.train.lora import add_lora, beside_lora, has_lora, lora_parameters, merge_lora
from hyla.train.objectives import validation_loss
from hyla.train.optim import run_optimizers


def load_teacher(path: str):
    """(teacher HylaLM in eval mode, tokenizer) from any :func:`hyla.model.load_model` source
    (a transformers directory, a .gguf file, a hyla checkpoint...) whose layers are all
    attention."""
    from hyla.model.load import load_model, require_tokenizer

    model, tok = load_model(path)
    require_tokenizer(tok, path, "hyla distill --teacher")
    if "A" not in model.cfg.layers:
        raise ValueError(f"--teacher {str(path)!r} has no attention layers "
                         f"(layers={model.cfg.layers!r}): distillation needs an all-attention "
                         f"teacher")
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

    def __init__(self, cfg: DistillConfig | None = None, resume: str | None = None, *,
                 log: Callable[[str], None] | None = None, answer: Callable | None = None):
        if cfg is None and resume is None:
            raise ValueError("Distiller needs a DistillConfig or resume=DIR")
        state = (load_train_state(pathlib.Path(resume), config_type=DistillConfig,
                                  command="hyla distill") if resume else None)
        if state is not None:
            cfg = state["cfg"]
            if cfg.chat_data is None:       # saved before --chat-data: it had none
                cfg = dataclasses.replace(cfg, chat_data=0)
        if not cfg.teacher:
            raise ValueError("--teacher is required (the all-attention model to distil)")
        self.log = log or (lambda _line: None)
        self.answer = answer      # how the teacher answers its chat data (chat_data.py)
        self.out = run_dir_of(resume) if resume else pathlib.Path(cfg.out)
        self.phases: dict[str, float] = {}
        if state is not None and (self.out / "phases.json").is_file():     # earlier sessions
            self.phases = json.loads((self.out / "phases.json").read_text())
        self._val_seconds = 0.0
        self.recipe = get_recipe(cfg.recipe)
        self.log(f"recipe {cfg.recipe}: {self.recipe.summary}")
        torch.manual_seed(cfg.seed)
        with self._phase("teacher_load"):
            self.teacher, self.tokenizer = load_teacher(cfg.teacher)
        # the recipe's settings, made concrete for this teacher: what is saved and reported
        self.cfg = cfg = cfg.resolve(self.teacher.cfg.n_layers)
        if cfg.eval_data and cfg.report_tokens and not pathlib.Path(cfg.eval_data).exists():
            raise ValueError(f"--eval-data {cfg.eval_data!r} does not exist (the report's "
                             f"held-out text: a file or folder)")
        if cfg.tasks and cfg.report_tokens:       # an unknown task fails before training
            from hyla.eval.harness import task_manager

            task_manager(cfg.tasks, cfg.include_path)
        self.layers = cfg.layers
        if state is not None:           # the pattern it was built with (auto:N chosen once)
            self.layers = json.loads((pathlib.Path(state["resumed_from"]) / "config.json")
                                     .read_text())["layers"]
        elif cfg.layers.startswith("auto"):          # the teacher picks its attention layers
            with self._phase("layer_ranking"):
                self.layers = self._choose_layers()
        self.model = build_student(self.teacher, self.layers, cfg.student_kv_heads,
                                   window=cfg.window, sinks=cfg.sinks,
                                   layout=self.recipe.layout)
        self.model.activation_checkpointing = cfg.activation_checkpointing
        self.out.mkdir(parents=True, exist_ok=True)
        self.documents = self._chat_mixture()
        self.transfer = transfer_layers(self.teacher.cfg, self.model.cfg)
        self.stage1_steps = cfg.stage1_steps if self.transfer else 0  # nothing to transfer
        self.total_steps = self.stage1_steps + cfg.stage2_steps
        self.autocast = autocast_dtype(cfg.autocast, next(self.model.parameters()).device)
        self._teacher_val: float | None = None
        step = 0
        calibration = self.out / "calibration.json"
        self.calibration = None
        if state is None and self.stage1_steps:
            with self._phase("calibration"):
                self.calibration = calibrate_student(self.teacher, self.model, self.transfer,
                                                     cfg, self.tokenizer)
            calibration.write_text(json.dumps(self.calibration))
        elif calibration.is_file():
            self.calibration = json.loads(calibration.read_text())
        self.log(self.plan())
        self.estimate: dict | None = None
        if state is None:
            with self._phase("estimate", quiet=True):
                self.estimate = self._estimate()
            self.log(self.estimate["line"])
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

    def _chat_mixture(self) -> list | None:
        """The training documents with the teacher's conversations mixed in
        (:mod:`hyla.train.distill.chat_data`; made once, kept in OUT/chat_data.json), or None
        (no chat data: the data source as it is)."""
        from hyla.train.distill import chat_data

        cfg = self.cfg
        if not cfg.chat_data:
            return None
        if not getattr(self.tokenizer, "chat_template", None):
            self.log("the teacher's tokenizer has no chat template: no teacher conversations "
                     "mixed in (--chat-data needs one)")
            return None
        files = list_documents(cfg.data, "train")
        if files is None:
            self.log(f"--data {cfg.data!r} is read as a stream: no teacher conversations mixed "
                     f"in (they mix with the stdlib corpus or a folder)")
            return None
        with self._phase("chat_data"):
            chats = chat_data.load_or_make(self.out / "chat_data.json", self.teacher,
                                           self.tokenizer, cfg.chat_data, cfg.seed, self.log,
                                           self.answer)
        return chat_data.mixture(chats, self.tokenizer, cfg.chat_share, files, cfg.seed)

    @contextlib.contextmanager
    def _phase(self, name: str, *, quiet: bool = False):
        """Time a phase of the run into ``phases`` (seconds, summed over resumed sessions,
        kept in ``phases.json``) and print it."""
        start, val_before = time.perf_counter(), self._val_seconds
        yield
        validation = self._val_seconds - val_before       # validation is its own phase
        self._add_phase(name, time.perf_counter() - start - validation, quiet=quiet,
                        note=f" (and validation {validation:.1f} s)" if validation else "")

    def _add_phase(self, name: str, seconds: float, *, quiet: bool = False,
                   note: str = "") -> None:
        self.phases[name] = self.phases.get(name, 0.0) + seconds
        if not quiet:
            label = name.replace("_", " ").replace("stage", "stage ")
            self.log(f"{label}: {seconds:.1f} s{note}")
        if self.out.is_dir():
            (self.out / "phases.json").write_text(json.dumps(self.phases, indent=1))

    def _choose_layers(self) -> str:
        """``auto:N`` -> a pattern: the teacher ranks its layers (``cfg.layer_ranking``) on
        the first training block; the others become the recipe's linear letter."""
        cfg = self.cfg
        return choose_layers(self.teacher, cfg.layers, probe_block(cfg, self.tokenizer),
                             window=cfg.window or 64, sinks=cfg.sinks,
                             ranking=cfg.layer_ranking, linear=self.recipe.linear)

    def plan(self) -> str:
        """What the run will do, in a few lines: layers, stages and their tokens."""
        cfg, layers = self.cfg, self.model.cfg.layers
        keep = [i for i, c in enumerate(layers) if c == AttentionMixer.letter]
        how = (f"{cfg.layers}, ranked by {cfg.layer_ranking}" if cfg.layers.startswith("auto")
               else "all linear" if not keep else "as given")
        lines = [f"layers {layers} ({how}): {len(keep)} of {len(layers)} stay attention"
                 + (f" ({', '.join(map(str, keep))})" if keep else "")
                 + (f"; window {cfg.window} + {cfg.sinks} sinks" if cfg.window else "")]
        s1 = self.stage1_steps * cfg.stage1_tokens_per_step
        s2 = cfg.stage2_steps * cfg.tokens_per_step
        lines.append(f"stage 1: {self.stage1_steps} steps x {cfg.batch_size} x "
                     f"{cfg.stage1_len:,} tokens = {s1:,} tokens (layers "
                     f"{', '.join(map(str, self.transfer)) or 'none'}); stage 2: "
                     f"{cfg.stage2_steps} steps x {cfg.batch_size} x {cfg.seq_len:,} = {s2:,} "
                     f"tokens, " + (f"LoRA rank {cfg.lora_rank}, lr {cfg.lr:g}" if cfg.lora_rank
                                    else f"full tuning ({cfg.optimizer}), lr {cfg.lr:g}"))
        return "\n".join(lines)

    @torch.no_grad()
    def _forward_seconds(self, ids: torch.Tensor) -> float:
        start = time.perf_counter()
        self.model(ids)
        return time.perf_counter() - start

    def _estimate(self) -> dict:
        """An estimate of the run's time: one forward and backward of one batch of each
        stage, timed before training (on random tokens, after a 16-token warm-up; gradients
        dropped, the RNG state restored, so the run is the same with or without it), times
        its steps; the validations and the report from one timed student forward, by their
        tokens. Not counted: optimizer steps and checkpoints."""
        cfg, rng = self.cfg, torch.get_rng_state()
        device = next(self.model.parameters()).device
        g = torch.Generator().manual_seed(cfg.seed)
        step_s = {}
        try:
            for stage, steps, length in ((1, self.stage1_steps, cfg.stage1_len),
                                         (2, cfg.stage2_steps, cfg.seq_len)):
                if not steps:
                    continue
                ids = torch.randint(0, self.teacher.cfg.vocab_size, (cfg.batch_size, length),
                                    generator=g).to(device)
                objective = self._timing_objective(stage)
                warm = ids[:1, :min(length, 16)]     # first-call costs out of the timing
                objective.backward((warm, warm, None))
                start = time.perf_counter()
                objective.backward((ids, ids, None))
                step_s[stage] = time.perf_counter() - start
                for p in self.model.parameters():
                    p.grad = None
            ids = torch.randint(0, self.teacher.cfg.vocab_size, (1, cfg.seq_len),
                                generator=g).to(device)
            per_token = self._forward_seconds(ids) / cfg.seq_len
        finally:
            self.model.requires_grad_(False)
            torch.set_rng_state(rng)
        evals = 2 if self.stage1_steps and cfg.stage2_steps else 1
        if cfg.eval_every:
            evals += self.total_steps // cfg.eval_every
        eval_tokens = (evals + 1) * cfg.eval_batches * cfg.batch_size * cfg.seq_len
        report_tokens = 2 * report_forward_tokens(cfg) if cfg.report_tokens else 0
        other = per_token * (eval_tokens + report_tokens)
        train = (self.stage1_steps * step_s.get(1, 0.0) + cfg.stage2_steps * step_s.get(2, 0.0))
        total = train + other
        parts = ", ".join(f"stage {k} {v:.1f} s/step" for k, v in step_s.items())
        line = (f"estimated time: about {_minutes(total)} ({parts}, from one timed step of "
                f"each; validation and report about {_minutes(other)}"
                + ("; the lm-eval tasks not counted" if cfg.tasks else "")
                + "): an estimate, measured before training")
        return {"stage_step_seconds": {str(k): v for k, v in step_s.items()},
                "forward_seconds_per_token": per_token, "train_seconds": train,
                "eval_and_report_seconds": other, "total_seconds": total, "line": line}

    def _timing_objective(self, stage: int):
        """The objective of ``stage`` with the gradients it will need switched on (stage 2
        under LoRA: the linearised layers' new parameters and the first block's norm, so
        the backward runs through the whole student as the adapters' does)."""
        cfg = self.cfg
        mixers = [self.model.blocks[i].mixer for i in self.transfer]
        self.model.requires_grad_(False)
        if stage == 1:
            params = [p for m in mixers for p in new_parameters(m)]
        elif cfg.lora_rank:
            params = [p for m in mixers if hasattr(m, "new_parameters")
                      for p in m.new_parameters()]
            params += list(self.model.blocks[0].mixer_norm.parameters())
        else:
            params = list(self.model.parameters())
        for p in params:
            p.requires_grad_(True)
        return self._objective(stage)

    def _objective(self, stage: int):
        """The loss of ``stage`` (attention transfer, or the vocabulary KL), under autocast
        where the run uses it."""
        cfg = self.cfg
        if stage == 1:
            objective = AttentionTransfer(self.teacher, self.model, self.transfer,
                                          kl_weight=cfg.attn_kl_weight)
        else:
            objective = VocabularyKL(self.model, self.teacher, kl_weight=cfg.kl_weight,
                                     ce_weight=cfg.ce_weight, chunk=cfg.vocab_chunk,
                                     temperature=cfg.temperature)
        return objective if self.autocast is None else Autocast(objective, self.autocast)

    def validate(self) -> dict:
        """Validation loss and perplexity of the student, beside the teacher's (computed
        once: it does not change)."""
        start = time.perf_counter()
        student = validation_loss(self.model, self.tokenizer, self.cfg)
        if self._teacher_val is None:
            self._teacher_val = validation_loss(self.teacher, self.tokenizer, self.cfg)
        seconds = time.perf_counter() - start
        self._val_seconds += seconds
        self._add_phase("validation", seconds, quiet=True)
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
        else:
            lrs = cfg
            if cfg.lora_rank:
                params = (lora_parameters(self.model) if has_lora(self.model) else
                          add_lora(self.model, cfg.lora_rank, cfg.lora_alpha))
                params += [p for m in mixers for p in beside_lora(m)]
                lrs = types.SimpleNamespace(optimizer="adamw", lr=cfg.lr,
                                            weight_decay=cfg.weight_decay)
            else:
                params = list(self.model.parameters())
            steps, seq_len, start = cfg.stage2_steps, cfg.seq_len, self.stage1_steps
        for p in params:
            p.requires_grad_(True)
        objective = self._objective(stage)
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
        if self.documents is not None:
            blocks = PackedBlocks(self.documents, self.tokenizer, seq_len,
                                  seed=cfg.seed + stage - 1, shuffle_buffer=buffer,
                                  position=position)
        else:
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

        Each stage's time (without its validations) goes into ``phases`` (``stage1``,
        ``stage2``; ``validation`` apart) and is printed. At the end of the run, LoRA
        adapters are merged into the weights of the last checkpoint (an ordinary model from
        then on) and, unless ``report_tokens`` is 0, ``report.json`` is written
        (:func:`hyla.train.distill.report.write_report`)."""
        start = time.perf_counter()
        end = self.total_steps if until is None else min(until, self.total_steps)
        record: dict = {}
        for stage, stop in ((1, self.stage1_steps), (2, end)):
            stop = min(stop, end)
            if self.step >= stop:
                continue
            with self._phase(f"stage{stage}"):
                record = self.loop.fit(until=stop, progress=progress)
        if not record:
            record = self.loop.fit(until=end, progress=False)     # nothing left to train
        if self.step == self.total_steps:
            if has_lora(self.model):
                merge_lora(self.model)
                save_checkpoint(self.model, self.out / f"ckpt-{self.step:06d}", self.tokenizer)
            if self.cfg.report_tokens:
                from hyla.train.distill.report import write_report

                train_seconds = time.perf_counter() - start
                with self._phase("report"):
                    report = write_report(self, train_seconds=train_seconds)
                report["phases"] = dict(self.phases)
                (self.out / "report.json").write_text(json.dumps(report, indent=1))
        return record


def report_forward_tokens(cfg: DistillConfig) -> int:
    """Tokens one model reads in ``report.json``'s perplexity and passkey tests."""
    from hyla.train.distill.report import report_lengths

    ppl, passkey = report_lengths(cfg)
    return (sum(max(cfg.report_tokens, n) for n in ppl)
            + sum(n * max(1, cfg.report_trials // 2) * 2 for n in passkey))


def _minutes(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.1f} min"
