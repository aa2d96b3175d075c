"""Distillation into linearised-attention students: what each stage trains, LoRA, exact
resume, the report, the flags."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from hyla.cli import main
from hyla.model import HylaLM, load_model, preset
from hyla.model.formats.checkpoint import save_checkpoint
from hyla.train.distill import Distiller
from hyla.train.distill.config import DistillConfig
from hyla.train.lora import add_lora, has_lora, merge_lora


@pytest.fixture
def teacher_dir(tmp_path):
    torch.manual_seed(0)
    cfg = dataclasses.replace(preset("debug"), layers="AAAA", n_kv_heads=2)
    save_checkpoint(HylaLM(cfg), tmp_path / "teacher")
    return tmp_path / "teacher"


def _cfg(teacher_dir, out, **kw):
    base = dict(teacher=str(teacher_dir), layers="GGAG", window=8, sinks=2, stage1_steps=3,
                stage2_steps=3, seq_len=48, batch_size=1, warmup_steps=1, eval_batches=1,
                save_every=2, out=str(out), vocab_chunk=40, report_tokens=0,
                optimizer="adamw", lora_rank=0, lr=3e-3)
    return DistillConfig(**(base | kw))


def _weights(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_stage1_trains_only_what_the_teacher_did_not_give(teacher_dir, tmp_path):
    d = Distiller(_cfg(teacher_dir, tmp_path / "s", stage2_steps=0))
    assert d.calibration.keys() == {"0", "1", "3"}
    before = _weights(d.model)
    d.fit(progress=False)
    after = d.model.state_dict()
    new = ("q_map", "k_map", "gk_proj", "mix_proj")
    moved = {k for k in before if not torch.equal(before[k], after[k])}
    assert moved and all(any(n in k for n in new) for k in moved), moved
    assert any("q_map" in k for k in moved) and any("mix_proj" in k for k in moved)


def test_lora_stage2_trains_adapters_and_merges_them(teacher_dir, tmp_path):
    d = Distiller(_cfg(teacher_dir, tmp_path / "l", lora_rank=4))
    d.fit(until=3, progress=False)
    before = _weights(d.model)
    d.fit(progress=False)
    assert not has_lora(d.model)
    after = d.model.state_dict()
    assert not torch.equal(before["blocks.0.mixer.q_proj.weight"],
                           after["blocks.0.mixer.q_proj.weight"])        # merged update
    for frozen in ("blocks.0.mlp.w1.weight", "embed.weight", "blocks.2.mixer_norm.weight"):
        if frozen in before:
            assert torch.equal(before[frozen], after[frozen]), frozen
    model, _ = load_model(str(tmp_path / "l"))                 # an ordinary checkpoint
    ids = torch.randint(0, 256, (1, 20))
    with torch.no_grad():
        torch.testing.assert_close(model(ids), d.model.eval()(ids))


def test_lora_run_resumes_exactly_inside_stage2(teacher_dir, tmp_path):
    full = Distiller(_cfg(teacher_dir, tmp_path / "full", lora_rank=4, stage2_steps=4))
    full.fit(progress=False)
    part = Distiller(_cfg(teacher_dir, tmp_path / "part", lora_rank=4, stage2_steps=4))
    part.fit(progress=False, until=4)         # checkpoint at step 4: one step into stage 2
    rest = Distiller(resume=str(tmp_path / "part"))
    assert has_lora(rest.model)
    rest.fit(progress=False)
    a = [json.loads(x)["loss"] for x in (tmp_path / "full/metrics.jsonl").open()]
    b = [json.loads(x)["loss"] for x in (tmp_path / "part/metrics.jsonl").open()]
    assert a == b and len(a) == 7
    for k, v in full.model.state_dict().items():
        assert torch.equal(v, rest.model.state_dict()[k]), k


def test_report_compares_student_and_teacher(teacher_dir, tmp_path):
    d = Distiller(_cfg(teacher_dir, tmp_path / "r", report_tokens=2048, report_trials=2,
                       eval_every=2, full_report=True))
    d.fit(progress=False)
    r = json.loads((tmp_path / "r/report.json").read_text())
    for side in ("teacher_figures", "student_figures"):
        assert set(r[side]["perplexity"]) == {"512", "2048"}
        assert r[side]["passkey"]["2048"]["trials"] == 2
    assert r["state_ratio_8k"] < 1 and 1 < r["parameter_ratio"] < 1.2
    assert r["stages"]["1"]["steps"] == 3 and r["stages"]["2"]["steps"] == 3
    assert r["tokens_seen"] == 6 * 48
    assert {"teacher_load", "calibration", "stage1", "stage2", "validation",
            "report"} <= set(r["phases"])
    assert all(v >= 0 for v in r["phases"].values())
    records = [json.loads(x) for x in (tmp_path / "r/metrics.jsonl").open()]
    evals = [x for x in records if "val_ppl" in x]
    assert [x["step"] for x in evals] == [2, 3, 4, 6]      # every 2 and at each stage's end
    assert all(x["teacher_val_ppl"] == evals[0]["teacher_val_ppl"] for x in evals)


def test_bf16_autocast_runs_and_keeps_fp32_weights(teacher_dir, tmp_path):
    d = Distiller(_cfg(teacher_dir, tmp_path / "b", autocast="bf16"))
    record = d.fit(progress=False)
    assert all(p.dtype == torch.float32 for p in d.model.parameters())
    assert torch.isfinite(torch.tensor(record["loss"]))


def test_lora_helpers_refuse_and_round_trip():
    model = HylaLM(preset("debug"))
    with pytest.raises(ValueError, match="lora rank"):
        add_lora(model, 0)
    add_lora(model, 2)
    assert has_lora(model)
    merge_lora(model)
    assert not has_lora(model) and not any("lora" in k for k in model.state_dict())


@pytest.mark.parametrize("flag,value,match", [
    ("--window", "-1", "window"), ("--sinks", "-3", "sinks"), ("--lora-rank", "-2", "lora"),
    ("--autocast", "fp8", "autocast"), ("--lora-alpha", "0", "lora-alpha"),
    ("--report-tokens", "-5", "report"), ("--eval-every", "-1", "eval")])
def test_cli_names_the_bad_flag(teacher_dir, tmp_path, capsys, flag, value, match):
    code = main(["distill", "--teacher", str(teacher_dir), "--layers", "GGAG", flag, value,
                 "--out", str(tmp_path / "x")])
    assert code == 2
    assert match in capsys.readouterr().err


def test_missing_eval_data_is_refused_before_training(teacher_dir, tmp_path):
    with pytest.raises(ValueError, match="--eval-data"):
        Distiller(_cfg(teacher_dir, tmp_path / "e", report_tokens=512,
                       eval_data=str(tmp_path / "nowhere")))


def test_resume_keeps_the_calibration_and_the_chosen_layers(teacher_dir, tmp_path):
    d = Distiller(_cfg(teacher_dir, tmp_path / "c", layers="auto:1"))
    d.fit(progress=False, until=2)
    again = Distiller(resume=str(tmp_path / "c"))
    assert again.calibration == json.loads(json.dumps(d.calibration))
    assert again.model.cfg.layers == d.model.cfg.layers
