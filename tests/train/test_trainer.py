import json
import os
import subprocess
import sys

import pytest
import torch

from hyla.model.formats.checkpoint import load_checkpoint
from hyla.train.batches import stack_blocks
from hyla.train.config import TrainConfig
from hyla.train.trainer import Trainer


def tiny(out, **kw) -> TrainConfig:
    base = dict(preset="debug", steps=6, seq_len=32, batch_size=2, vocab_size=300,
                tokenizer_documents=5, save_every=3, eval_batches=1, warmup_steps=2,
                out=str(out))
    return TrainConfig(**(base | kw))


def losses(run) -> dict:
    lines = (run / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r["loss"] for r in map(json.loads, lines)}


@pytest.mark.parametrize("optimizer", ["muon", "adamw"])
def test_resume_reproduces_the_uninterrupted_losses_bit_for_bit(tmp_path, optimizer):
    torch.set_num_threads(1)  # same reduction order in both runs
    whole = Trainer(tiny(tmp_path / "whole", optimizer=optimizer))
    whole.fit(progress=False)
    part = Trainer(tiny(tmp_path / "part", optimizer=optimizer))
    for _ in range(3):
        part.train_step()
    part.save()  # the run is interrupted here
    resumed = Trainer(tiny(tmp_path / "part", optimizer=optimizer), resume=tmp_path / "part")
    assert resumed.step == 3
    resumed.fit(progress=False)
    a, b = losses(tmp_path / "whole"), losses(tmp_path / "part")
    assert [a[s] for s in range(4, 7)] == [b[s] for s in range(4, 7)]
    assert sorted(b) == [4, 5, 6]  # steps 1-3 were never logged by the interrupted run


def test_sigkill_mid_checkpoint_leaves_the_previous_one_loadable(tmp_path):
    out = tmp_path / "run"
    code = ("from hyla.train.config import TrainConfig; from hyla.train.trainer import Trainer;"
            f"Trainer(TrainConfig(preset='debug', steps=4, seq_len=32, batch_size=2,"
            f" vocab_size=300, tokenizer_documents=5, save_every=2, eval_batches=1,"
            f" out={str(out)!r})).fit(progress=False)")
    env = os.environ | {"HYLA_TEST_CRASH_IN_SAVE": "4"}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True)
    assert proc.returncode == -9, proc.stderr.decode()[-2000:]
    assert [p.name for p in sorted(out.glob("ckpt-*"))] == ["ckpt-000002"]
    assert len(list(out.glob(".ckpt-000004.tmp*"))) == 1     # the killed save's own
    model, tok = load_checkpoint(out)  # the run directory resolves to its newest checkpoint
    assert model.cfg.vocab_size == tok.vocab_size
    resumed = Trainer(TrainConfig(out=str(out)), resume=out)
    assert resumed.step == 2
    assert not list(out.glob(".ckpt-*.tmp*"))      # removed at the next start (issue 32)
    assert resumed.fit(progress=False)["step"] == 4


def test_resume_rejects_other_settings_and_empty_dirs(tmp_path):
    Trainer(tiny(tmp_path / "run", steps=2)).fit(progress=False)
    with pytest.raises(ValueError, match="seq_len"):
        Trainer(tiny(tmp_path / "run", seq_len=64), resume=tmp_path / "run")
    with pytest.raises(ValueError, match="no complete ckpt"):
        Trainer(tiny(tmp_path / "empty"), resume=tmp_path / "empty")


def test_stack_blocks_offsets_document_boundaries():
    blocks = [{"input_ids": torch.arange(4), "labels": torch.arange(4),
               "cu_seqlens": torch.tensor([0, 3, 4], dtype=torch.int32)},
              {"input_ids": torch.arange(4), "labels": torch.arange(4),
               "cu_seqlens": torch.tensor([0, 4], dtype=torch.int32)}]
    ids, labels, cu = stack_blocks(blocks)
    assert ids.shape == (1, 8) and cu.tolist() == [0, 3, 4, 8]


def test_bad_train_config():
    with pytest.raises(ValueError, match="optimizer"):
        TrainConfig(optimizer="sgd")
    with pytest.raises(ValueError, match="steps"):
        TrainConfig(steps=0)


def test_layers_override_trains_an_all_attention_model(tmp_path):
    trainer = Trainer(tiny(tmp_path, layers="AAAA", steps=1))
    assert trainer.model.cfg.layers == "AAAA"
    trainer.fit(progress=False)
    with pytest.raises(ValueError, match="layers"):
        Trainer(tiny(tmp_path / "bad", layers="GXA"))


def test_an_overflowed_weight_is_never_saved(tmp_path, monkeypatch):
    """A step whose update overflowed a weight while its loss (taken before the update)
    was finite: the run stops before saving it, and the last good checkpoint stays."""
    from hyla.train.loop import Loop

    real = Loop.train_step

    def overflowing(self):
        record = real(self)
        if self.step == 4:
            with torch.no_grad():
                next(self.model.parameters()).view(-1)[0] = float("inf")
        return record
    monkeypatch.setattr(Loop, "train_step", overflowing)
    trainer = Trainer(tiny(tmp_path / "run", save_every=2))
    with pytest.raises(ValueError, match="step 4: a weight is NaN or infinite"):
        trainer.fit(progress=False)
    assert sorted(p.name for p in (tmp_path / "run").glob("ckpt-*")) == ["ckpt-000002"]
