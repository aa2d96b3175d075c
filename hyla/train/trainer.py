"""``hyla train``: a language model trained from scratch, exactly resumable.

A run directory holds ``tokenizer.json``, ``metrics.jsonl`` (one JSON object a step),
``run.json`` (the config and what each rank holds) and ``ckpt-<step>/`` directories (the
consolidated model + a distributed checkpoint of model and optimizers + ``train_state.pt``:
schedulers, data position, RNG states; :mod:`hyla.train.dist_checkpoint`). A resumed run
continues from the newest checkpoint, at the same or another world size, and, on CPU in fp32
at the same world size, reproduces the uninterrupted run's losses bit for bit. Under
``--strategy diloco`` / ``fomoe`` (:mod:`hyla.train.diloco`, :mod:`hyla.train.fomoe`) every
rank keeps its own copy and syncs every ``--sync-every`` steps; their checkpoints
(:mod:`hyla.train.replica_checkpoint`) resume exactly at the world size that wrote them.
The loop is :class:`hyla.train.loop.Loop`, with the
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
from hyla.train import distributed
from hyla.train.checkpointing import (
    RESUME_FIXED,
    load_train_state,
    restore_optimizers,
    restore_weights,
    run_dir_of,
)
from hyla.train.comm import CommCounter
from hyla.train.config import TrainConfig, wsd_lr_factor
from hyla.train.loop import Loop, Stage
from hyla.train.objectives import LanguageModelling, validation_loss
from hyla.train.optim import run_optimizers
from hyla.train.parallel_report import parallel_record, write_run_json

# A resume may change the world size, and with it batch_size x grad_accum (the global batch
# stays): distributed.resume_batch checks those two.
TRAIN_RESUME_FIXED = tuple(f for f in RESUME_FIXED if f not in ("batch_size", "grad_accum"))


class Trainer:
    """Build (or restore) a language-model run; ``fit`` trains it.

    Attributes: ``cfg``, ``out``, ``model``, ``tokenizer``, ``loop`` (the
    :class:`~hyla.train.loop.Loop`), ``step``, ``rank``, ``world`` and, at W > 1, ``mesh``
    (the model is FSDP2-sharded on it: ``cfg.strategy``).

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
        replicas = cfg.strategy in ("diloco", "fomoe")
        self.rank, self.world = distributed.setup(cfg.sync_timeout if replicas else None)
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
            cfg = distributed.resume_batch(state["cfg"], saved_world, asked, self.world,
                                           self.out)
            if asked.device != TrainConfig().device:   # a run may move to another device
                cfg = dataclasses.replace(cfg, device=asked.device)
        self.cfg = cfg
        device = distributed.train_device(cfg.device)   # refused before any work
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
        self.model.to(device)
        self.model.activation_checkpointing = cfg.activation_checkpointing
        self.mesh, counter, self.outer = None, CommCounter(), None
        if cfg.strategy == "fomoe" and self.world == 1:   # the bad inputs, even in one process
            from hyla.train.diloco import fomoe_placement

            fomoe_placement(self.model, cfg, self.world)
        if self.world > 1 and cfg.strategy in ("diloco", "fomoe"):   # a full copy a rank
            from hyla.train.diloco import replica_strategy

            distributed.broadcast_parameters(self.model)
            self.outer, optimizers = replica_strategy(self.model, cfg, self.rank, self.world,
                                                      counter)
        elif self.world > 1:
            distributed.broadcast_parameters(self.model)
            self.mesh = distributed.device_mesh(self.world, device)
            distributed.shard_model(self.model, cfg, self.mesh, counter)
            optimizers = distributed.build_optimizers(self.model, cfg, self.mesh)
        else:
            optimizers = run_optimizers(self.model, cfg)
        schedulers = [torch.optim.lr_scheduler.LambdaLR(o, lambda s: wsd_lr_factor(s, cfg))
                      for o in optimizers]
        step, position = 0, None
        if state is not None and self.outer is not None:
            from hyla.train.replica_checkpoint import restore_replicas

            restore_replicas(self.model, optimizers, schedulers, self.outer, state,
                             rank=self.rank, world=self.world, strategy=cfg.strategy)
        elif state is not None and state.get("format") == "replicas":
            raise ValueError(f"{state['resumed_from']} is a --strategy "
                             f"{state['cfg'].strategy} checkpoint of {state['world_size']} "
                             f"ranks: resume it under torchrun --nproc-per-node "
                             f"{state['world_size']}, or start a new --out with --init "
                             f"{state['resumed_from']} to keep its weights")
        elif state is not None and "dcp" in state:
            from hyla.train.dist_checkpoint import restore_dcp

            restore_dcp(self.model, optimizers, schedulers, state)
        elif state is not None:   # a checkpoint from before DCP (one process)
            restore_weights(self.model, state,
                            f"checkpoint in {self.out} does not match preset {cfg.preset}")
            restore_optimizers(optimizers, schedulers, state)
        if state is not None:
            torch.set_rng_state(state["rng"])
            step, position = state["step"], state["data_position"]
        blocks = corpus_blocks(cfg.data, self.tokenizer, cfg.seq_len, split="train",
                               seed=cfg.seed, shuffle_buffer=cfg.shuffle_buffer,
                               position=position)
        if self.world > 1:
            blocks = distributed.StridedBlocks(blocks, self.rank, self.world,
                                               chunk=cfg.batch_size)
        objective = LanguageModelling(self.model, precision=cfg.precision,
                                      offload_activations=cfg.offload_activations)
        stage = Stage(objective=objective, optimizers=optimizers, schedulers=schedulers,
                      blocks=blocks, end=cfg.steps, batch_size=cfg.batch_size,
                      grad_accum=cfg.grad_accum, tokens_per_step=cfg.tokens_per_step * self.world,
                      clip=cfg.clip, eval_every=cfg.eval_every)
        self.loop = Loop(out=self.out, cfg=cfg, model=self.model, tokenizer=self.tokenizer,
                         stage=stage, total=cfg.steps, step=step, rank=self.rank,
                         world=self.world, distributed_checkpoints=True,
                         counters=[counter] + [o.counter for o in optimizers
                                               if hasattr(o, "counter")],
                         validate=self._validate, **self._replica_hooks())
        from hyla.train.routing import routing_monitor  # MoE: balancing + routing metrics

        self.loop.routing = routing_monitor(self.model, self.tokenizer, cfg, counter)

    def _replica_hooks(self) -> dict:
        """diloco / fomoe: the outer sync after each step, their own checkpoints."""
        if self.outer is None:
            return {}
        from hyla.train.replica_checkpoint import save_replicas_checkpoint

        return {"after_step": self.outer.after_step,
                "save_fn": lambda loop, target: save_replicas_checkpoint(loop, target,
                                                                         self.outer)}

    def _validate(self) -> float:
        loss = validation_loss(self.model, self.tokenizer, self.cfg)
        if self.world > 1 and self.outer is None:
            distributed.reshard(self.model)
        return loss

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
        """Train to ``cfg.steps``, then write ``run.json`` (collective); returns the last
        metrics record (with ``val_loss``)."""
        if self.outer is None:
            record = self.loop.fit(progress=progress)
        else:
            from hyla.train.diloco import stopped

            try:
                record = self.loop.fit(progress=progress)
            except (RuntimeError, torch.distributed.DistError) as e:   # a rank went silent
                raise stopped(e, self.loop.step, self.out, self.cfg.sync_timeout) from e
        self.write_run_json()
        return record

    def write_run_json(self) -> None:
        """``run.json``: the config and ``parallel`` (what each rank holds, its peak memory).
        Every rank calls it; rank 0 writes."""
        parallel = parallel_record(self.model, self.loop.optimizers, world=self.world,
                                   strategy=self.cfg.strategy if self.world > 1 else "single",
                                   mesh=self.mesh)
        if self.outer is not None:
            from hyla.train.diloco import replica_report

            parallel.update(replica_report(self.outer, self.cfg, self.model))
            parallel["sync_bytes_per_sync"] = distributed.per_rank(self.outer.sync_bytes(),
                                                                   self.world)
        if self.rank == 0:
            write_run_json(self.out, {"command": "train", "step": self.step,
                                      "cfg": self.cfg.to_dict(), "parallel": parallel,
                                      "torch": torch.__version__})
