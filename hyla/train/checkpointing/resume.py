"""Reading a run's newest complete checkpoint back (``hyla train --resume``, ``hyla distill
--resume``): which checkpoint, checked how, and putting its weights and optimizer states back.
"""

from __future__ import annotations

import dataclasses
import pathlib
import sys

import torch

from hyla.model.formats.checkpoint import step_dirs
from hyla.train.checkpointing.atomic import STATE
from hyla.train.checkpointing.safe_reader import DCP, check_dcp
from hyla.train.config import TrainConfig

# Settings a resumed run must share with its checkpoint (or leave at their defaults).
RESUME_FIXED = ("preset", "seq_len", "batch_size", "grad_accum", "optimizer", "seed",
                "vocab_size", "data")


class _ForeignRun(Exception):
    """A checkpoint whose settings are another command's."""


def load_train_state(run_dir: pathlib.Path, cfg=None, *, config_type: type = TrainConfig,
                     command: str = "hyla train", fixed: tuple[str, ...] = RESUME_FIXED) -> dict:
    """The newest complete checkpoint of a run (``hyla train`` or ``hyla distill``), as a dict:
    ``step``, ``cfg`` (a ``config_type``), ``schedulers``, ``data_position``, ``rng``, and
    either ``model`` (weights) and ``optimizers`` or, for a distributed checkpoint
    (:mod:`hyla.train.checkpointing.dcp`), ``dcp`` (its directory, every shard checked present)
    and ``param_groups``.

    ``cfg``, when given, must describe the same model and data as the run (the ``fixed``
    fields), or leave those fields at their defaults; otherwise a
    ValueError names the differing fields. A non-default ``steps`` replaces the run's.
    ``command`` names the command that wrote the run, for the error messages.

    Example:
        >>> import tempfile
        >>> load_train_state(tempfile.mkdtemp())
        Traceback (most recent call last):
        ...
        ValueError: ... has no complete ckpt-<step> directory to resume from: ...
    """
    from safetensors.torch import load_file

    run_dir = pathlib.Path(run_dir)
    if is_train_checkpoint(run_dir):            # a ckpt-<step> directory itself: that one
        candidates = [run_dir]
    else:
        candidates = step_dirs(run_dir)[::-1]      # newest step first
    skipped: list[str] = []
    for ckpt in candidates:
        if not (ckpt / STATE).is_file():
            skipped.append(f"{ckpt.name} (no {STATE})")
            continue
        try:
            state = torch.load(ckpt / STATE, weights_only=True)
            if state.get("format") == "dcp":
                check_dcp(ckpt / DCP)     # names a missing or truncated shard
                check_safetensors(ckpt / "model.safetensors")   # what export reads
                state["dcp"] = ckpt / DCP
            else:
                state["model"] = load_file(str(ckpt / "model.safetensors"))
            try:
                saved = config_type(**state["cfg"])
            except TypeError:
                raise _ForeignRun(ckpt) from None
            break
        except _ForeignRun:
            # settings another command writes (a train run resumed by distill): not corrupt,
            # so no older checkpoint would do either (it once said "unusable: TypeError")
            raise ValueError(f"{ckpt} is not a checkpoint of {command}: its settings are "
                             f"another command's; resume it with the command that wrote it, "
                             f"or give {command} another --out") from None
        except Exception as e:  # noqa: BLE001 - truncated or corrupt: try the one before
            skipped.append(f"{ckpt.name} ({type(e).__name__}: {str(e)[:120]})")
    else:
        why = f" (unusable: {'; '.join(skipped)})" if skipped else ""
        raise ValueError(f"{run_dir} has no complete ckpt-<step> directory to resume from: "
                         f"expected the --out directory of an earlier {command}, or one of "
                         f"its ckpt-<step> directories{why}")
    if skipped:     # say which one, and why the newer ones were passed over
        print(f"resuming from {ckpt}: skipped {'; '.join(skipped)}", file=sys.stderr)
    state["resumed_from"] = str(ckpt)
    if cfg is not None:
        default = config_type()
        diff = [f for f in fixed if hasattr(cfg, f) and getattr(cfg, f) != getattr(saved, f)
                and getattr(cfg, f) != getattr(default, f)]
        if diff:
            raise ValueError(f"{ckpt} was trained with a different {', '.join(diff)}: resume "
                             f"with the run's own settings or start a new --out")
        if getattr(cfg, "steps", None) not in (None, getattr(default, "steps", None)):
            saved = dataclasses.replace(saved, steps=cfg.steps)  # train further or stop sooner
    state["cfg"] = saved
    return state


def check_safetensors(path: pathlib.Path) -> None:
    """ValueError naming ``path`` unless it is a safetensors file as long as its header says
    (reads the header only: a checkpoint cut short mid-copy is caught without loading it).

    Example:
        >>> import tempfile
        >>> from safetensors.torch import save_file
        >>> path = pathlib.Path(tempfile.mkdtemp()) / "w.safetensors"
        >>> save_file({"w": torch.zeros(4)}, str(path))
        >>> check_safetensors(path)
        >>> path.write_bytes(path.read_bytes()[:-4]); check_safetensors(path)
        Traceback (most recent call last):
        ...
        ValueError: w.safetensors is truncated (76 of 80 bytes)
    """
    import json
    import struct

    path = pathlib.Path(path)
    if not path.is_file():
        raise ValueError(f"{path.name} is missing")
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        n = struct.unpack("<Q", head)[0] if len(head) == 8 else size
        if 8 + n > size:
            raise ValueError(f"{path.name} is truncated (its header is cut)")
        header = json.loads(f.read(n))
    end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"),
              default=0)
    if size < 8 + n + end:
        raise ValueError(f"{path.name} is truncated ({size} of {8 + n + end} bytes)")


def is_train_checkpoint(path: pathlib.Path) -> bool:
    """Whether ``path`` is one ``ckpt-<step>`` directory of a run (not the run itself)."""
    path = pathlib.Path(path)
    return path.name.startswith("ckpt-") and path.name[5:].isdigit() and (path / STATE).is_file()


def run_dir_of(path) -> pathlib.Path:
    """Where a resumed run writes: a ``ckpt-<step>`` directory's run, else ``path`` itself.

    Example:
        >>> run_dir_of("runs/a")
        PosixPath('runs/a')
    """
    path = pathlib.Path(path)
    return path.parent if is_train_checkpoint(path) else path


def restore_weights(model: torch.nn.Module, state: dict, what: str) -> None:
    """Load a checkpoint's weights into ``model``; ValueError ``"<what>"`` when they do not fit.

    A tied output head is stored once, as the embedding, so ``lm_head.weight`` may be missing.

    Example:
        >>> from hyla.model import HylaLM, preset
        >>> model = HylaLM(preset("debug"))
        >>> restore_weights(model, {"model": model.state_dict()}, "checkpoint does not match")
        >>> restore_weights(model, {"model": {}}, "checkpoint does not match")
        Traceback (most recent call last):
        ...
        ValueError: checkpoint does not match
    """
    missing, unexpected = model.load_state_dict(state["model"], strict=False)
    if unexpected or [k for k in missing if k != "lm_head.weight"]:
        raise ValueError(what)


def restore_optimizers(optimizers: list, schedulers: list, state: dict) -> None:
    """Load a checkpoint's optimizer and LR-schedule states (same number and order)."""
    for opt, sd in zip(optimizers, state["optimizers"], strict=True):
        opt.load_state_dict(sd)
    for sch, sd in zip(schedulers, state["schedulers"], strict=True):
        sch.load_state_dict(sd)
