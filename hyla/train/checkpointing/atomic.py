"""Training checkpoints written whole or not at all, the newest K kept (``hyla train`` and
``hyla distill`` runs; reading them back: :mod:`hyla.train.checkpointing.resume`).

``ckpt-<step>/`` is first written as a hidden temporary directory and then renamed, so a crash
at any moment leaves either the complete new checkpoint or none of it, and the previous one
untouched. Training state is a ``torch.save`` of tensors and plain containers, read back with
``weights_only=True``; the weights themselves are safetensors.
"""

from __future__ import annotations

import contextlib
import errno
import os
import pathlib
import re
import shutil
import sys

import torch

from hyla.model.formats.checkpoint import save_checkpoint, step_dirs

STATE = "train_state.pt"


def save_train_checkpoint(trainer, target: pathlib.Path) -> pathlib.Path:
    """Write model, tokenizer and training state to ``target`` atomically; prune old ones.

    ``trainer`` is a :class:`~hyla.train.loop.Loop` (or anything with its ``model``,
    ``tokenizer``, ``step``, ``cfg``, ``optimizers``, ``schedulers`` and ``blocks``).
    Refuses (OSError, before writing anything) when the disk has less room than the
    checkpoint needs; on any failure its temporary directory is removed.
    """
    tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
    remove_stale_temps(target.parent)
    state = {
        "step": trainer.step,
        "cfg": trainer.cfg.to_dict(),
        "optimizers": [o.state_dict() for o in trainer.optimizers],
        "schedulers": [s.state_dict() for s in trainer.schedulers],
        "data_position": trainer.blocks.position(),
        "rng": torch.get_rng_state(),
    }
    need = tensor_bytes(trainer.model.state_dict()) + tensor_bytes(state)
    check_free_space(target.parent, need)
    with temp_dir(tmp), disk_full_named(target.parent, need):
        save_checkpoint(trainer.model, tmp, trainer.tokenizer)
        torch.save(state, tmp / STATE)
        return publish(tmp, target, trainer.step, trainer.cfg.keep_last)


def publish(tmp: pathlib.Path, target: pathlib.Path, step: int, keep_last: int) -> pathlib.Path:
    """Rename the complete temporary directory ``tmp`` to ``target``; keep the newest
    ``keep_last`` ``ckpt-*`` beside it (newest by step number, not by name)."""
    if os.environ.get("HYLA_TEST_CRASH_IN_SAVE") == str(step):  # a test kills us here
        os.kill(os.getpid(), 9)
    if target.exists():
        shutil.rmtree(target)
    os.replace(tmp, target)
    runs = step_dirs(target.parent)
    for old in runs[:-keep_last]:
        if old != target:
            shutil.rmtree(old, ignore_errors=True)
    return target


# Slack on top of the tensors' bytes: headers, config, tokenizer, filesystem blocks.
SPACE_MARGIN = 1.05
SPACE_EXTRA = 16 << 20


def tensor_bytes(obj) -> int:
    """Bytes of every tensor in ``obj`` (nested dicts, lists and tuples).

    Example:
        >>> tensor_bytes({"a": torch.zeros(4), "b": [torch.zeros(2, dtype=torch.int64)]})
        32
    """
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(tensor_bytes(v) for v in obj.values())
    if isinstance(obj, list | tuple):
        return sum(tensor_bytes(v) for v in obj)
    return 0


def check_free_space(directory: pathlib.Path, need: int) -> None:
    """OSError "not enough space on DEVICE: need N MB, have M MB" unless the filesystem of
    ``directory`` has room for ``need`` bytes (plus a margin) of checkpoint.

    Example:
        >>> import tempfile
        >>> check_free_space(pathlib.Path(tempfile.mkdtemp()), 1)
    """
    directory = pathlib.Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    want = int(need * SPACE_MARGIN) + SPACE_EXTRA
    free = shutil.disk_usage(directory).free
    if free < want:
        raise OSError(errno.ENOSPC, f"not enough space on {device_of(directory)}: need "
                                    f"{_mb(want)} MB, have {_mb(free)} MB to save a checkpoint "
                                    f"in {directory}")


def _mb(n: int) -> int:
    return -(-n // (1 << 20))


def device_of(path: pathlib.Path) -> str:
    """The device (from /proc/mounts) holding ``path``, with its mount point; the mount point
    alone where /proc/mounts is not there."""
    mount = pathlib.Path(os.path.abspath(path))
    while not os.path.ismount(mount) and mount != mount.parent:
        mount = mount.parent
    try:
        with open("/proc/mounts", encoding="utf-8") as f:
            for line in f:
                parts = line.split()
                if len(parts) > 1 and parts[1] == str(mount):
                    return f"{parts[0]} ({mount})"
    except OSError:
        pass
    return str(mount)


@contextlib.contextmanager
def disk_full_named(directory: pathlib.Path, need: int):
    """Re-raise a failed write (torch's ``unexpected pos``, a stream error, ENOSPC) as the
    OSError "not enough space on DEVICE: ..." when the disk is what ran out."""
    try:
        yield
    except BaseException as e:
        try:
            free = shutil.disk_usage(directory).free
        except OSError:
            raise e from None
        full = free < SPACE_EXTRA or getattr(e, "errno", None) == errno.ENOSPC
        if not full or isinstance(e, KeyboardInterrupt | SystemExit):
            raise
        lines = str(e).strip().splitlines()
        detail = f"{type(e).__name__}: {lines[-1][:200] if lines else ''}"
        raise OSError(errno.ENOSPC, f"not enough space on {device_of(directory)}: need "
                                    f"{_mb(int(need * SPACE_MARGIN) + SPACE_EXTRA)} MB, have "
                                    f"{_mb(free)} MB left while saving a checkpoint in "
                                    f"{directory} ({detail})") from e


@contextlib.contextmanager
def temp_dir(tmp: pathlib.Path):
    """A fresh directory ``tmp`` for the body to fill; removed if the body raises anything
    (a full disk, a bad tensor, KeyboardInterrupt). A process killed outright leaves it,
    for :func:`remove_stale_temps` to take at the next save."""
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def guarded_save(save, loop, target: pathlib.Path) -> pathlib.Path:
    """``save(loop, target)`` for the savers every rank runs (DCP, replicas), which write
    ``.ckpt-<step>.tmp`` (one name for all ranks): the free space checked first (the model
    twice, sharded and consolidated, plus the optimizers' state), the temporary directory
    removed by rank 0 if the save fails."""
    need = 2 * tensor_bytes(loop.model.state_dict()) + sum(
        tensor_bytes(o.state_dict()) for o in loop.optimizers)
    check_free_space(target.parent, need)
    try:
        with disk_full_named(target.parent, need):
            return save(loop, target)
    except BaseException:
        if loop.rank == 0:
            shutil.rmtree(target.with_name(f".{target.name}.tmp"), ignore_errors=True)
        raise


_TEMP = re.compile(r"^\.ckpt-\d+\.tmp(?:-(\d+))?$")


def remove_stale_temps(run_dir: pathlib.Path, shared: bool = False) -> list[pathlib.Path]:
    """Remove the ``.ckpt-<step>.tmp-<pid>`` directories of ``run_dir`` whose process is no
    longer alive (a save that was killed, or failed before cleaning up); returns them.
    A temporary directory of a live process (another save in progress) is left alone.
    ``shared``: the ranks' common ``.ckpt-<step>.tmp`` too (at a run's start, when no save
    of it can be in progress).

    Example:
        >>> import tempfile
        >>> d = pathlib.Path(tempfile.mkdtemp())
        >>> (d / ".ckpt-000010.tmp-999999999").mkdir()
        >>> [p.name for p in remove_stale_temps(d)]
        ['.ckpt-000010.tmp-999999999']
    """
    run_dir = pathlib.Path(run_dir)
    removed = []
    if not run_dir.is_dir():
        return removed
    for p in run_dir.iterdir():
        m = _TEMP.match(p.name)
        if not m or not p.is_dir():
            continue
        pid = m.group(1)
        if (shared and pid is None) or (
                pid is not None and int(pid) != os.getpid() and not _alive(int(pid))):
            shutil.rmtree(p, ignore_errors=True)
            removed.append(p)
    if removed:
        print(f"removed {len(removed)} stale temporary checkpoint director"
              f"{'y' if len(removed) == 1 else 'ies'} of dead processes in {run_dir}: "
              f"{', '.join(p.name for p in removed)}", file=sys.stderr)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, OverflowError):
        return False
    except PermissionError:     # it exists, run by another user
        return True
    return True
