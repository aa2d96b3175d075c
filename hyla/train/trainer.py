"""``hyla train``: a language model trained from scratch, exactly resumable.

A run directory holds ``tokenizer.json``, ``metrics.jsonl`` (one JSON object a step) and
``ckpt-<step>/`` directories (model checkpoint + ``train_state.pt``: optimizers, schedulers,
data position, RNG states). A resumed run continues from the newest checkpoint and, on CPU in
fp32, reproduces the uninterrupted run's losses bit for bit. The loop itself is
:class:`hyla.train.loop.Loop`, with the :class:`~hyla.train.objectives.LanguageModelling`
objective.
"""

from __future__ import annotations

import dataclasses
import pathlib

import torch

from hyla.data.corpus import iter_documents
from hyla.data.packing import corpus_blocks
from hyla.data.tokenizer import load_tokenizer, train_bpe
from hyla.model import HylaLM, preset
from hyla.train import distributed
from hyla.train.checkpointing import (
    load_train_state,
    restore_optimizers,
    restore_weights,
    run_dir_of,
)
from hyla.train.config import TrainConfig, wsd_lr_factor
from hyla.train.loop import Loop, Stage
from hyla.train.objectives import LanguageModelling, validation_loss
from hyla.train.optim import run_optimizers


class Trainer:
    """Build (or restore) a language-model run; ``fit`` trains it.

    Attributes: ``cfg``, ``out``, ``model``, ``tokenizer``, ``loop`` (the
    :class:`~hyla.train.loop.Loop`), ``step``, ``rank`` and ``world``.

    Example:
        >>> import tempfile
        >>> cfg = TrainConfig(preset="debug", steps=2, seq_len=32, batch_size=2,
        ...                   vocab_size=300, tokenizer_documents=5, out=tempfile.mkdtemp())
        >>> Trainer(cfg).fit(progress=False)["step"]
        2
    """

    def __init__(self, cfg: TrainConfig, resume: str | None = None):
        # --resume takes a run directory (its newest intact checkpoint) or one ckpt-<step>
        self.out = run_dir_of(resume) if resume else pathlib.Path(cfg.out)
        # World size 1 (no torchrun, no process group): every distributed hook is skipped.
        self.rank, self.world = distributed.setup()
        state = load_train_state(pathlib.Path(resume), cfg) if resume else None
        if state is not None:
            distributed.check_resume_world(state, self.world, self.out)
            cfg = state["cfg"]
        self.cfg = cfg
        torch.manual_seed(cfg.seed)
        self.out.mkdir(parents=True, exist_ok=True)
        init = self._init_model() if cfg.init is not None else None
        with distributed.rank_zero_first(self.world):
            self.tokenizer = self._tokenizer(state is not None, init)
        if init is not None:
            self.model = init[0].train()
        else:
            model_cfg = dataclasses.replace(preset(cfg.preset),
                                            vocab_size=self.tokenizer.vocab_size)
            if cfg.layers is not None:
                model_cfg = dataclasses.replace(model_cfg, layers=cfg.layers)  # validated
            self.model = HylaLM(model_cfg)
        self.model.activation_checkpointing = cfg.activation_checkpointing
        if self.world > 1:
            distributed.broadcast_parameters(self.model)
            optimizers = distributed.build_optimizers(self.model, cfg)
        else:
            optimizers = run_optimizers(self.model, cfg)
        schedulers = [torch.optim.lr_scheduler.LambdaLR(o, lambda s: wsd_lr_factor(s, cfg))
                      for o in optimizers]
        step, position = 0, None
        if state is not None:
            restore_weights(self.model, state,
                            f"checkpoint in {self.out} does not match preset {cfg.preset}")
            restore_optimizers(optimizers, schedulers, state)
            torch.set_rng_state(state["rng"])
            step, position = state["step"], state["data_position"]
        blocks = corpus_blocks(cfg.data, self.tokenizer, cfg.seq_len, split="train",
                               seed=cfg.seed, shuffle_buffer=cfg.shuffle_buffer,
                               position=position)
        if self.world > 1:
            blocks = distributed.StridedBlocks(blocks, self.rank, self.world)
        objective = LanguageModelling(self.model, precision=cfg.precision,
                                      offload_activations=cfg.offload_activations)
        stage = Stage(objective=objective, optimizers=optimizers, schedulers=schedulers,
                      blocks=blocks, end=cfg.steps, batch_size=cfg.batch_size,
                      grad_accum=cfg.grad_accum, tokens_per_step=cfg.tokens_per_step * self.world,
                      clip=cfg.clip, eval_every=cfg.eval_every)
        self.loop = Loop(out=self.out, cfg=cfg, model=self.model, tokenizer=self.tokenizer,
                         stage=stage, total=cfg.steps, step=step, rank=self.rank,
                         world=self.world,
                         validate=lambda: validation_loss(self.model, self.tokenizer, cfg))

    def _init_model(self):
        from hyla.model.load import load_model

        model, tok = load_model(self.cfg.init)
        if self.cfg.layers is not None and self.cfg.layers != model.cfg.layers:
            raise ValueError(f"layers={self.cfg.layers!r} differs from the layers of --init "
                             f"{self.cfg.init!r} ({model.cfg.layers!r}): leave layers unset "
                             f"(hyla distill changes a model's layers)")
        return model.requires_grad_(True), tok

    def _tokenizer(self, resuming: bool, init=None):
        path = self.out / "tokenizer.json"
        if init is not None:                  # the initial model's own, kept beside the run
            if self.rank == 0 and not path.is_file() and hasattr(init[1], "save"):
                init[1].save(path)
            return init[1]
        if resuming or path.is_file():
            return load_tokenizer(self.out)
        docs = iter_documents(self.cfg.data, "train")
        sample = (d for _, d in zip(range(self.cfg.tokenizer_documents), docs, strict=False))
        tok = train_bpe(sample, self.cfg.vocab_size)
        tok.save(path)
        return tok

    @property
    def step(self) -> int:
        return self.loop.step

    def train_step(self) -> float:
        """One optimizer step (with gradient accumulation); returns the mean loss."""
        return self.loop.train_step()["loss"]

    def save(self) -> pathlib.Path:
        """Write ``ckpt-<step>/`` now."""
        return self.loop.save()

    def fit(self, progress: bool = True) -> dict:
        """Train to ``cfg.steps``; returns the last metrics record (with ``val_loss``)."""
        return self.loop.fit(progress=progress)
