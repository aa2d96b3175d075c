"""Training checkpoints: written whole or not at all, the newest K kept, loaded with checks.

``ckpt-<step>/`` is first written as a hidden temporary directory and then renamed, so a crash
at any moment leaves either the complete new checkpoint or none of it, and the previous one
untouched. Training state is a ``torch.save`` of tensors and plain containers, read back with
``weights_only=True``; the weights themselves are safetensors.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import shutil

import torch

from hyla.model.checkpoint import latest_checkpoint, save_checkpoint
from hyla.train.config import TrainConfig

STATE = "train_state.pt"


def save_train_checkpoint(trainer, target: pathlib.Path) -> pathlib.Path:
    """Write model, tokenizer and training state to ``target`` atomically; prune old ones."""
    tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    save_checkpoint(trainer.model, tmp, trainer.tokenizer)
    state = {
        "step": trainer.step,
        "cfg": trainer.cfg.to_dict(),
        "optimizers": [o.state_dict() for o in trainer.optimizers],
        "schedulers": [s.state_dict() for s in trainer.schedulers],
        "data_position": trainer.blocks.position(),
        "rng": torch.get_rng_state(),
    }
    torch.save(state, tmp / STATE)
    if os.environ.get("HYLA_TEST_CRASH_IN_SAVE") == str(trainer.step):  # a test kills us here
        os.kill(os.getpid(), 9)
    if target.exists():
        shutil.rmtree(target)
    os.replace(tmp, target)
    runs = sorted(p for p in target.parent.glob("ckpt-*") if p.name[5:].isdigit())
    for old in runs[: -trainer.cfg.keep_last]:
        shutil.rmtree(old, ignore_errors=True)
    return target


def load_train_state(run_dir: pathlib.Path, cfg: TrainConfig | None = None) -> dict:
    """The newest complete checkpoint of a run, as a dict ready for the Trainer.

    ``cfg``, when given, must describe the same model and data as the run, or leave those
    fields at their defaults; otherwise a ValueError names the differing fields. A non-default
    ``steps`` replaces the run's.
    """
    from safetensors.torch import load_file

    ckpt = latest_checkpoint(run_dir)
    if ckpt == run_dir or not (ckpt / STATE).is_file():
        raise ValueError(f"{run_dir} has no complete ckpt-<step> directory to resume from: "
                         f"expected the --out directory of an earlier hyla train")
    try:
        state = torch.load(ckpt / STATE, weights_only=True)
        state["model"] = load_file(str(ckpt / "model.safetensors"))
    except Exception as e:
        raise ValueError(f"{ckpt} is corrupt ({e}): resume from an earlier checkpoint") from e
    saved = TrainConfig(**state["cfg"])
    if cfg is not None:
        fixed = ("preset", "seq_len", "batch_size", "grad_accum", "optimizer", "seed",
                 "vocab_size", "data")
        diff = [f for f in fixed if getattr(cfg, f) != getattr(saved, f)
                and getattr(cfg, f) != getattr(TrainConfig(), f)]
        if diff:
            raise ValueError(f"{ckpt} was trained with a different {', '.join(diff)}: resume "
                             f"with the run's own settings or start a new --out")
        if cfg.steps != TrainConfig().steps:  # --steps given: train further (or stop sooner)
            saved = dataclasses.replace(saved, steps=cfg.steps)
    state["cfg"] = saved
    return state
