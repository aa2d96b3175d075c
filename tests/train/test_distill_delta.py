"""Distillation into windowed gated-delta students (D and K with a window): the student's
layers, calibration, what stage 1 trains, and a checkpoint that loads as the same layers."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from hyla.model import HylaLM, load_model, preset
from hyla.model.formats.checkpoint import save_checkpoint
from hyla.model.mixers import WindowedDeltaMixer, WindowedKDAMixer
from hyla.train.distill import Distiller
from hyla.train.distill.config import DistillConfig
from hyla.train.distill.student import build_student, transfer_layers


@pytest.fixture
def teacher_dir(tmp_path):
    torch.manual_seed(0)
    cfg = dataclasses.replace(preset("debug"), layers="AA", n_kv_heads=2)
    save_checkpoint(HylaLM(cfg), tmp_path / "teacher")
    return tmp_path / "teacher"


def test_transfer_layers_are_the_windowed_delta_ones():
    teacher = HylaLM(dataclasses.replace(preset("debug"), layers="AAAA")).eval()
    student = build_student(teacher, "DAKG", window=8, sinks=2)
    assert transfer_layers(teacher.cfg, student.cfg) == [0, 2, 3]
    assert type(student.blocks[0].mixer) is WindowedDeltaMixer
    assert type(student.blocks[2].mixer) is WindowedKDAMixer


@pytest.mark.parametrize("letter,cls", [("D", WindowedDeltaMixer), ("K", WindowedKDAMixer)])
def test_one_step_each_stage(teacher_dir, tmp_path, letter, cls):
    out = tmp_path / letter
    d = Distiller(DistillConfig(
        teacher=str(teacher_dir), layers=letter + "A", window=8, sinks=2, stage1_steps=1,
        stage2_steps=1, seq_len=48, batch_size=1, warmup_steps=1, eval_batches=1,
        save_every=2, out=str(out), vocab_chunk=40, report_tokens=0, optimizer="adamw",
        lora_rank=4, lr=1e-3))
    assert type(d.model.blocks[0].mixer) is cls
    assert set(d.calibration) == {"0"} and set(d.calibration["0"]) == {
        "window_share", "far_distance", "beta"}
    before = {k: v.clone() for k, v in d.model.state_dict().items()}
    d.fit(progress=False, until=1)                              # stage 1: new parameters only
    after = d.model.state_dict()
    moved = {k for k in before if not torch.equal(before[k], after[k])}
    new = ("q_map", "k_map", "gk_proj", "b_proj", "mix_proj")
    assert moved and all(any(n in k for n in new) for k in moved), moved
    assert any("b_proj" in k for k in moved)
    record = d.fit(progress=False)                              # stage 2: LoRA, merged
    assert torch.isfinite(torch.tensor(record["loss"]))
    model, _ = load_model(str(out))
    assert type(model.blocks[0].mixer) is cls
    ids = torch.randint(0, 256, (1, 20))
    with torch.no_grad():
        torch.testing.assert_close(model(ids), d.model.eval()(ids))
