"""Checkpoints are ordered by their parsed step everywhere (issue 32, item 1); saves check
the free space first, clean up after themselves on any failure, and the next start removes
the temporary directories of dead processes (item 2)."""

import errno
import shutil
import subprocess
import sys
from collections import namedtuple

import pytest
import torch
from torch.distributed.checkpoint.api import CheckpointException

from hyla.model.formats.checkpoint import latest_checkpoint, step_dirs
from hyla.model.load import load_model
from hyla.train.checkpointing import atomic as checkpointing
from hyla.train.checkpointing import load_train_state, publish, remove_stale_temps
from hyla.train.config import TrainConfig
from hyla.train.trainer import Trainer

STEPS = ("ckpt-998000", "ckpt-999000", "ckpt-1000000")


def tiny(out, **kw) -> TrainConfig:
    base = dict(preset="debug", steps=2, seq_len=32, batch_size=2, vocab_size=300,
                tokenizer_documents=5, save_every=2, eval_batches=1, warmup_steps=1,
                keep_last=2, out=str(out))
    return TrainConfig(**(base | kw))


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A run directory whose checkpoints cross step 999,999."""
    out = tmp_path_factory.mktemp("order") / "run"
    Trainer(tiny(out)).fit(progress=False)
    for name in STEPS:
        shutil.copytree(out / "ckpt-000002", out / name)
    shutil.rmtree(out / "ckpt-000002")
    return out


def test_newest_is_the_highest_step_not_the_last_name(run):
    assert [p.name for p in step_dirs(run)] == list(STEPS)
    assert latest_checkpoint(run).name == "ckpt-1000000"
    assert load_train_state(run)["resumed_from"].endswith("ckpt-1000000")
    load_model(run)        # serve/generate/eval load the run's newest


def test_pruning_keeps_the_newest_steps(tmp_path):
    for name in STEPS[:2]:
        (tmp_path / name).mkdir()
    tmp = tmp_path / ".ckpt-1000000.tmp-1"
    tmp.mkdir()
    publish(tmp, tmp_path / "ckpt-1000000", 1000000, keep_last=2)
    assert [p.name for p in step_dirs(tmp_path)] == ["ckpt-999000", "ckpt-1000000"]


@pytest.fixture
def trainer(tmp_path):
    t = Trainer(tiny(tmp_path / "run", steps=4))
    t.fit(progress=False)       # ckpt-000002 and ckpt-000004
    return t


def test_full_disk_is_refused_before_writing(trainer, monkeypatch):
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(checkpointing.shutil, "disk_usage",
                        lambda p: usage(100 << 20, 99 << 20, 1 << 20))
    trainer.loop.step = 6
    with pytest.raises(OSError, match=r"not enough space on .*: need \d+ MB, have 1 MB"):
        trainer.save()
    out = trainer.loop.out
    with pytest.raises(OSError, match="not enough space on"):     # the one-process saver
        checkpointing.save_train_checkpoint(trainer.loop, out / "ckpt-000006")
    assert [p.name for p in step_dirs(out)] == ["ckpt-000002", "ckpt-000004"]
    assert not list(out.glob(".ckpt-*"))
    assert load_train_state(out)["step"] == 4


def test_a_failing_save_removes_its_temporary_directory(trainer, monkeypatch):
    def full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(checkpointing.torch, "save", full)
    trainer.loop.step = 6
    for _ in range(3):          # retries add nothing either
        with pytest.raises(CheckpointException):   # DCP's wrapping of the OSError
            trainer.save()
    out = trainer.loop.out
    with pytest.raises(OSError, match="No space"):
        checkpointing.save_train_checkpoint(trainer.loop, out / "ckpt-000006")
    assert not list(out.glob(".ckpt-*"))
    assert [p.name for p in step_dirs(out)] == ["ckpt-000002", "ckpt-000004"]


def test_stale_temporaries_of_dead_processes_go_at_the_next_start(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", ""])
    proc.wait()                                 # a pid that is certainly dead
    dead = tmp_path / f".ckpt-000010.tmp-{proc.pid}"
    live = tmp_path / f".ckpt-000012.tmp-{subprocess.os.getppid()}"   # a save in progress
    for d in (dead, live):
        d.mkdir()
        torch.save({"x": torch.zeros(4)}, d / "train_state.pt")
    Trainer(tiny(tmp_path))                     # starting a run in that directory
    assert not dead.exists() and live.exists()
    assert remove_stale_temps(tmp_path) == []


@pytest.fixture
def tiny_disk(tmp_path):
    """A 1 MB tmpfs (root only; skipped where mounting is not allowed)."""
    mnt = tmp_path / "disk"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)],
                       capture_output=True)
    if r.returncode:
        pytest.skip("cannot mount a tmpfs here")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=False)     # lazy: even if still busy


def test_a_real_full_disk(trainer, tiny_disk, monkeypatch):
    trainer.loop.out = tiny_disk / "run"
    trainer.loop.step = 6
    with pytest.raises(OSError, match=r"not enough space on tmpfs .*need \d+ MB, have 1 MB"):
        trainer.save()
    # past the check (as if the disk filled up meanwhile): the write fails, nothing is left
    monkeypatch.setattr(checkpointing, "check_free_space", lambda *a: None)
    with pytest.raises(OSError, match=r"not enough space on tmpfs .*left while saving"):
        trainer.save()          # DCP's own error (CheckpointException) named for what it is
    assert list((tiny_disk / "run").iterdir()) == []
    with pytest.raises(OSError, match=r"not enough space on tmpfs .*left while saving"):
        checkpointing.save_train_checkpoint(trainer.loop, tiny_disk / "run" / "ckpt-000006")
    assert list((tiny_disk / "run").iterdir()) == []


def test_hyla_train_on_a_full_disk_ends_in_one_line_not_a_traceback(tmp_path, monkeypatch,
                                                                      capsys):
    from hyla.cli.main import main

    usage = namedtuple("usage", "total used free")
    real = shutil.disk_usage
    run_dir = tmp_path / "run"
    monkeypatch.setattr(checkpointing.shutil, "disk_usage",   # full once the run has begun
                        lambda p: usage(100 << 20, 99 << 20, 1 << 20)
                        if str(p).startswith(str(run_dir)) else real(p))
    status = main(["train", "--preset", "debug", "--steps", "2", "--seq-len", "32",
                   "--batch-size", "2", "--vocab-size", "300", "--tokenizer-documents", "5",
                   "--eval-batches", "1", "--no-progress", "--out", str(run_dir)])
    err = capsys.readouterr().err
    assert status == 1
    assert err.startswith("error: not enough space on ") and "need" in err, err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert not list(run_dir.glob(".ckpt-*"))        # nothing half-written left behind
