"""Distillation: student initialisation, the two stage losses, a full run, exact resume, CLI."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from hyla.cli import main
from hyla.model import HylaLM, preset
from hyla.model.formats.checkpoint import load_checkpoint, save_checkpoint
from hyla.model.generate import generate
from hyla.model.mixers.base import merge_kv_heads
from hyla.train.distill import Distiller, load_teacher
from hyla.train.distill.config import DistillConfig
from hyla.train.distill.losses import (
    chunked_vocab_kl,
    direct_vocab_kl,
    final_hidden,
    layer_transfer_loss,
)
from hyla.train.distill.student import build_student, student_config


def _teacher(seed=0, kv=2):
    torch.manual_seed(seed)
    cfg = dataclasses.replace(preset("debug"), layers="AAAA", n_kv_heads=kv)
    return HylaLM(cfg).eval().requires_grad_(False)


def test_all_attention_student_reproduces_teacher_logits():
    teacher = _teacher()
    student = build_student(teacher, "AAAA").eval()
    ids = torch.randint(0, 256, (2, 33))
    with torch.no_grad():
        assert torch.equal(student(ids), teacher(ids))


def test_copied_attention_layer_has_zero_transfer_loss():
    teacher = _teacher()
    student = build_student(teacher, "GGGA")
    h = torch.randn(1, 40, 64)
    cu = torch.tensor([0, 17, 40], dtype=torch.int32)
    pos = torch.cat([torch.arange(17), torch.arange(23)])
    loss, parts = layer_transfer_loss(teacher.blocks[3].mixer, student.blocks[3].mixer, h, pos, cu)
    assert loss.item() == 0.0 and parts == {"mse": 0.0, "kl": 0.0}
    g_loss, g_parts = layer_transfer_loss(teacher.blocks[0].mixer, student.blocks[0].mixer, h, pos)
    assert g_loss.item() > 0 and "kl" not in g_parts


def test_kv_head_merge_keeps_each_query_on_its_group():
    teacher = _teacher(kv=4)
    with torch.no_grad():  # make the two teacher heads of each pair equal: merging is exact
        for block in teacher.blocks:
            for proj in (block.mixer.k_proj, block.mixer.v_proj):
                w = proj.weight.view(2, 2, 16, 64)
                w[:, 1] = w[:, 0]
    student = build_student(teacher, "AAAA", kv_heads=2).eval()
    assert student.cfg.n_kv_heads == 2
    ids = torch.randint(0, 256, (1, 21))
    with torch.no_grad():
        torch.testing.assert_close(student(ids), teacher(ids), atol=1e-5, rtol=1e-5)
    w = torch.randn(4 * 16, 64)
    torch.testing.assert_close(merge_kv_heads(w, 4, 2)[:16], (w[:16] + w[16:32]) / 2)


def test_compressed_attention_layer_kl_positive_then_transfer_drops():
    teacher = _teacher(kv=2)
    student = build_student(teacher, "AAAA", kv_heads=1)
    h = torch.randn(1, 48, 64)
    loss, parts = layer_transfer_loss(teacher.blocks[1].mixer, student.blocks[1].mixer, h,
                                      torch.arange(48))
    assert parts["kl"] > 0 and parts["mse"] > 0


def test_gla_layer_initialisation():
    teacher = _teacher(kv=2)
    student = build_student(teacher, "GAAA")
    t, s = teacher.blocks[0].mixer, student.blocks[0].mixer
    assert student.cfg.head_k_dim == teacher.cfg.head_dim
    assert torch.equal(s.q_proj.weight, t.q_proj.weight)
    assert torch.equal(s.o_proj.weight, t.o_proj.weight)
    # KV heads expanded: query heads 0 and 1 read teacher KV head 0, heads 2 and 3 head 1
    k = s.k_proj.weight.view(4, 16, 64)
    tk = t.k_proj.weight.view(2, 16, 64)
    assert torch.equal(k[1], tk[0]) and torch.equal(k[2], tk[1])
    gk = s.log_forget_gate(torch.randn(1, 3, 64))
    decay = -1 / gk  # tokens over which a channel forgets by a factor e
    assert 15 < decay.min() and decay.max() < 4200
    for name in ("embed.weight", "lm_head.weight", "blocks.0.mlp.up_proj.weight",
                 "blocks.2.mixer_norm.weight"):
        assert torch.equal(student.get_parameter(name), teacher.get_parameter(name))


@pytest.mark.parametrize("temperature", [1.0, 2.0])
def test_chunked_vocab_kl_matches_direct(temperature):
    torch.manual_seed(0)
    N, d, V = 37, 16, 101
    h_s = torch.randn(N, d, dtype=torch.float64, requires_grad=True)
    w_s = torch.randn(V, d, dtype=torch.float64, requires_grad=True)
    h_t, w_t = torch.randn(N, d, dtype=torch.float64), torch.randn(V, d, dtype=torch.float64)
    labels = torch.randint(0, V, (N,))
    labels[[0, 5, 36]] = -100
    kw = {"kl_weight": 0.7, "ce_weight": 0.4, "temperature": temperature}
    loss, kl, ce = chunked_vocab_kl(h_s, w_s, h_t, w_t, labels, chunk=8, **kw)
    grads = torch.autograd.grad(loss * 3.0, (h_s, w_s))
    ref = direct_vocab_kl(h_s @ w_s.T, h_t @ w_t.T, labels, **kw)
    ref_grads = torch.autograd.grad(ref * 3.0, (h_s, w_s))
    torch.testing.assert_close(loss.double(), ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(0.7 * kl.double() + 0.4 * ce.double(), ref, rtol=1e-6, atol=1e-6)
    for g, r in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(g, r, rtol=1e-6, atol=1e-8)


def test_stage2_zero_kl_when_student_is_the_teacher():
    teacher = _teacher()
    student = build_student(teacher, "AAAA")
    ids = torch.randint(0, 256, (1, 30))
    labels = torch.roll(ids, -1, 1).flatten()
    h_s = final_hidden(student, ids).flatten(0, 1)
    h_t = final_hidden(teacher, ids).flatten(0, 1)
    _, kl, _ = chunked_vocab_kl(h_s, student.lm_head.weight, h_t, teacher.lm_head.weight, labels,
                                chunk=7)
    assert abs(kl.item()) < 1e-6


@pytest.fixture
def teacher_dir(tmp_path):
    save_checkpoint(_teacher(), tmp_path / "teacher")
    return tmp_path / "teacher"


def _cfg(teacher_dir, out, **kw):
    base = dict(teacher=str(teacher_dir), recipe="plain-gla", layers="GGGA", student_kv_heads=1,
                stage1_steps=4,
                stage2_steps=3, seq_len=48, batch_size=2, warmup_steps=1, eval_batches=1,
                save_every=2, out=str(out), vocab_chunk=40, report_tokens=0)
    return DistillConfig(**(base | kw))


def test_stage1_loss_decreases(teacher_dir, tmp_path):
    cfg = _cfg(teacher_dir, tmp_path / "s1", stage1_steps=12, stage2_steps=0, save_every=100,
               optimizer="adamw", stage1_lr=1e-3, warmup_steps=0, decay_fraction=0.0)
    Distiller(cfg).fit(progress=False)
    records = [json.loads(line) for line in (tmp_path / "s1/metrics.jsonl").open()]
    losses = [r["loss"] for r in records]
    assert all(r["stage"] == 1 for r in records) and len(losses) == 12
    assert sum(losses[-3:]) / 3 < 0.7 * sum(losses[:3]) / 3
    assert set(records[0]["layers"]) == {"0", "1", "2", "3"} and "kl" in records[0]["layers"]["3"]


def test_distill_resumes_exactly(teacher_dir, tmp_path):
    # AdamW: Muon's resume is the trainer's (tested there); the CLI test below runs Muon
    full = Distiller(_cfg(teacher_dir, tmp_path / "full", optimizer="adamw"))
    full.fit(progress=False)
    part = Distiller(_cfg(teacher_dir, tmp_path / "part", optimizer="adamw"))
    part.fit(progress=False, until=5)  # stops one step into stage 2 (checkpoint at step 5)
    Distiller(resume=str(tmp_path / "part")).fit(progress=False)
    a = [json.loads(x) for x in (tmp_path / "full/metrics.jsonl").open()]
    b = [json.loads(x) for x in (tmp_path / "part/metrics.jsonl").open()]
    assert [(r["stage"], r["step"]) for r in a] == [(1, 1), (1, 2), (1, 3), (1, 4), (2, 5),
                                                     (2, 6), (2, 7)]
    assert [r["loss"] for r in a] == [r["loss"] for r in b]
    assert {"kl", "ce", "loss"} <= set(a[-1]) and "val_loss" in a[-1] and "val_loss" in a[3]
    assert (tmp_path / "full/stage1/config.json").is_file()


def test_cli_distills_a_transformers_directory(teacher_dir, tmp_path, capsys):
    hf = tmp_path / "hf"
    assert main(["export", "--format", "llama", str(teacher_dir), str(hf)]) == 0
    out = tmp_path / "student"
    assert main(["distill", "--teacher", str(hf), "--layers", "GGAA", "--stage1-steps", "2",
                 "--stage2-steps", "2", "--seq-len", "32", "--batch-size", "1",
                 "--eval-batches", "1", "--out", str(out), "--no-progress"]) == 0
    model, tok = load_checkpoint(out)
    assert model.cfg.layers == "GGAA"
    assert len(generate(model, tok.encode("def "), 4, temperature=0.0)) == 4
    assert main(["generate", "--checkpoint", str(out), "--prompt", "x", "--max-tokens", "2"]) == 0


def test_bad_input(teacher_dir, tmp_path):
    t = _teacher().cfg
    with pytest.raises(ValueError, match="--layers must be a string of 4"):
        student_config(t, "GGA")
    with pytest.raises(ValueError, match="--student-kv-heads must divide the teacher's 2"):
        student_config(t, "GGGA", kv_heads=3)
    (tmp_path / "gpt2").mkdir()
    (tmp_path / "gpt2/config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(ValueError, match=r"config\.json: model_type 'gpt2' is not supported"):
        load_teacher(str(tmp_path / "gpt2"))
    with pytest.raises(ValueError, match="has no config.json"):
        load_teacher(str(tmp_path))
    assert main(["distill", "--teacher", str(teacher_dir), "--layers", "GG",
                 "--out", str(tmp_path / "x")]) == 2
