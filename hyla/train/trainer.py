"""``hyla train``: a language model trained from scratch, exactly resumable.

A run directory holds ``tokenizer.json``, ``metrics.jsonl`` (one JSON object a step),
``run.json`` (the config and what each rank holds) and ``ckpt-<step>/`` directories (the
consolidated model + a distributed checkpoint of model and optimizers + ``train_state.pt``:
schedulers, data position, RNG states; :mod:`hyla.train.checkpointing.dcp`). A resumed run
continues from the newest checkpoint, at the same or another world size, and, on CPU in fp32
at the same world size, reproduces the uninterrupted run's losses bit for bit. Under
``--strategy diloco`` / ``fomoe`` (:mod:`hyla.train.strategies.diloco`,
:mod:`hyla.train.strategies.fomoe`) every rank keeps its own copy and syncs every
``--sync-every`` steps; their checkpoints (:mod:`hyla.train.checkpointing.replicas`) resume
exactly at the world size that wrote them. How the run spreads over ranks is one
:class:`~hyla.train.strategies.base.Strategy`. The loop is :class:`hyla.train.loop.Loop`, with the
:class:`~hyla.train.objectives.LanguageModelling` objective.
"""

from __future__ import annotations

import dataclasses
import pathlib

import torch

from hyla.data.corpus import iter_documents
from hyla.data.packing import corpus_blocks
from hyla.data.tokenizer import load_tokenizer, train_bpe
from hyla.model import HylaLM, preset
from hyla.train import process_group
from hyla.train.checkpointing.resume import RESUME_FIXED, load_train_state, run_dir_of
from hyla.train.config import TrainConfig, wsd_lr_factor
from hyla.train.loop import Loop, Stage
from hyla.train.objectives import LanguageModelling, validation_loss
from hyla.train.optim.comm import CommCounter
from hyla.train.strategies.registry import build_strategy, strategy_class
from hyla.train.strategies.report import write_run_json

# A resume may change the world size, and with it batch_size x grad_accum (the global batch
# stays): process_group.resume_batch checks those two.
TRAIN_RESUME_FIXED = tuple(f for f in RESUME_FIXED if f not in ("batch_size", "grad_accum"))


class Trainer:
    """Build (or restore) a language-model run; ``fit`` trains it.

    Attributes: ``cfg``, ``out``, ``model``, ``tokenizer``, ``loop`` (the
    :class:`~hyla.train.loop.Loop`), ``step``, ``rank``, ``world`` and ``strategy`` (how
    the run spreads over its ranks: :func:`~hyla.train.strategies.registry.build_strategy`).

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
        self.rank, self.world = process_group.setup(strategy_class(cfg.strategy).timeout(cfg))
        state = (load_train_state(pathlib.Path(resume), cfg, fixed=TRAIN_RESUME_FIXED)
                 if resume else None)
        if state is not None:
            saved_world = int(state.get("world_size",
                                        state["data_position"].get("world_size", 1)))
            if ("dcp" not in state and state.get("format") != "replicas"
                    and max(self.world, saved_world) > 1):
                # hand-written data parallelism's layout: nothing maps it onto FSDP shards
                raise ValueError(f"{state['resumed_from']} predates distributed checkpoints "
                                 f"and was written at world size {saved_world}: only a "
                                 f"one-process checkpoint of that kind resumes, in one "
                                 f"process; start a new --out with --init "
                                 f"{state['resumed_from']} to keep its weights")
            asked = cfg
            cfg = process_group.resume_batch(state["cfg"], saved_world, asked, self.world,
                                             self.out)
            if asked.device != TrainConfig().device:   # a run may move to another device
                cfg = dataclasses.replace(cfg, device=asked.device)
        self.cfg = cfg
        device = process_group.train_device(cfg.device)   # refused before any work
        torch.manual_seed(cfg.seed)
        self.out.mkdir(parents=True, exist_ok=True)
        init = self._init_model() if cfg.init is not None else None
        with process_group.rank_zero_first(self.world):
            self.tokenizer = self._tokenizer(state is not None, init)
        if init is not None:
            self.model = init[0].train()
        else:
            model_cfg = dataclasses.replace(preset(cfg.preset),
                                            vocab_size=self.tokenizer.vocab_size)
            if cfg.layers is not None:
                model_cfg = dataclasses.replace(model_cfg, layers=cfg.layers)  # validated
            self.model = HylaLM(model_cfg)
        self.model.to(device)
        self.model.activation_checkpointing = cfg.activation_checkpointing
        self.strategy = build_strategy(self.model, cfg, rank=self.rank, world=self.world)
        counter = CommCounter()
        optimizers = self.strategy.prepare(self.model, device, counter)
        schedulers = [torch.optim.lr_scheduler.LambdaLR(o, lambda s: wsd_lr_factor(s, cfg))
                      for o in optimizers]
        step, position = 0, None
        if state is not None:
            self.strategy.restore(self.model, optimizers, schedulers, state)
            torch.set_rng_state(state["rng"])
            step, position = state["step"], state["data_position"]
        blocks = corpus_blocks(cfg.data, self.tokenizer, cfg.seq_len, split="train",
                               seed=cfg.seed, shuffle_buffer=cfg.shuffle_buffer,
                               position=position)
        if self.world > 1:
            blocks = process_group.StridedBlocks(blocks, self.rank, self.world,
                                                 chunk=cfg.batch_size)
        objective = LanguageModelling(self.model, precision=cfg.precision,
                                      offload_activations=cfg.offload_activations)
        stage = Stage(objective=objective, optimizers=optimizers, schedulers=schedulers,
                      blocks=blocks, end=cfg.steps, batch_size=cfg.batch_size,
                      grad_accum=cfg.grad_accum, tokens_per_step=cfg.tokens_per_step * self.world,
                      clip=cfg.clip, eval_every=cfg.eval_every)
        self.loop = Loop(out=self.out, cfg=cfg, model=self.model, tokenizer=self.tokenizer,
                         stage=stage, total=cfg.steps, step=step, rank=self.rank,
                         world=self.world,
                         counters=[counter] + [o.counter for o in optimizers
                                               if hasattr(o, "counter")],
                         validate=self._validate, **self.strategy.loop_hooks())
        from hyla.train.routing import routing_monitor  # MoE: balancing + routing metrics

        self.loop.routing = routing_monitor(self.model, self.tokenizer, cfg, counter)

    def _validate(self) -> float:
        loss = validation_loss(self.model, self.tokenizer, self.cfg)
        self.strategy.after_validation(self.model)
        return loss

    def _init_model(self):
        from hyla.model.load import load_model, require_tokenizer

        model, tok = load_model(self.cfg.init)
        require_tokenizer(tok, self.cfg.init, "hyla train --init")
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
        """Train to ``cfg.steps``, then write ``run.json`` (collective); returns the last
        metrics record (with ``val_loss``)."""
        before = self.loop.step
        record = self.strategy.fit(self.loop, progress)
        if self.loop.step != before:    # a finished run resumed: its run.json stays as it was
            self.write_run_json()
        return record

    def write_run_json(self) -> None:
        """``run.json``: the config and ``parallel`` (what each rank holds, its peak memory).
        Every rank calls it; rank 0 writes."""
        parallel = self.strategy.report(self.model, self.loop.optimizers)
        if self.rank == 0:
            write_run_json(self.out, {"command": "train", "step": self.step,
                                      "cfg": self.cfg.to_dict(), "parallel": parallel,
                                      "torch": torch.__version__})
