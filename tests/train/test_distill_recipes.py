"""Distillation recipes: defaults that are the measured recipe, flags overriding one part, the
plan and time printed, phases in report.json, and bad input named."""

from __future__ import annotations

import dataclasses
import json
import re

import pytest
import torch

from hyla.cli import main
from hyla.model import HylaLM, preset
from hyla.model.formats.checkpoint import save_checkpoint
from hyla.train.checkpointing import load_train_state
from hyla.train.distill import Distiller
from hyla.train.distill import pipeline as distill_module
from hyla.train.distill.config import DistillConfig
from hyla.train.distill.recipes import RECIPES, Recipe, resolve_layers, windowed_form


@pytest.fixture
def teacher_dir(tmp_path):
    torch.manual_seed(0)
    cfg = dataclasses.replace(preset("debug"), layers="AAAA", n_kv_heads=2)
    save_checkpoint(HylaLM(cfg), tmp_path / "teacher")
    return tmp_path / "teacher"


TINY = dict(stage1_steps=1, stage2_steps=1, seq_len=48, window=8, sinks=2, eval_batches=1,
            vocab_chunk=40, report_tokens=0)


def test_default_recipe_is_the_measured_one():
    r = DistillConfig(teacher="t").resolve(30)
    assert (r.recipe, r.layers, r.window, r.sinks, r.lora_rank, r.lr) == (
        "window-gla", "auto:7", 64, 4, 8, 1e-3)
    assert (r.stage1_steps, r.stage2_steps, r.seq_len, r.batch_size, r.warmup_steps) == (
        80, 90, 1024, 1, 5)
    assert (r.report_tokens, r.report_trials) == (4096, 2)
    assert r.resolve(30) == r                            # idempotent: resume resolves the same
    full = DistillConfig(teacher="t", full_report=True).resolve(30)
    assert (full.report_tokens, full.report_trials) == (16384, 8)


def test_a_flag_overrides_one_part_of_the_recipe():
    r = DistillConfig(teacher="t", window=0, seq_len=256).resolve(8)
    assert (r.window, r.seq_len, r.lora_rank, r.lr, r.layers) == (0, 256, 8, 1e-3, "auto:2")
    p = DistillConfig(teacher="t", recipe="plain-gla").resolve(8)
    assert (p.window, p.lora_rank, p.lr, p.optimizer) == (0, 0, 3e-3, "muon")
    assert DistillConfig(teacher="t", recipe="plain-gla", lora_rank=4).resolve(8).lora_rank == 4
    assert set(RECIPES) >= {"window-gla", "plain-gla", "window-delta", "window-kda"}
    assert RECIPES["window-delta"].linear == "D" and RECIPES["window-kda"].linear == "K"


def test_layer_specs():
    r = RECIPES["window-gla"]
    assert resolve_layers("auto", r, 4) == "auto:1"
    assert resolve_layers("linear", RECIPES["window-delta"], 3) == "DDD"
    assert resolve_layers("auto:4", r, 4) == "auto:4" and resolve_layers("GAGA", r, 4) == "GAGA"
    assert [r.attention_layers(n) for n in (1, 2, 4, 7, 30, 32)] == [0, 1, 1, 1, 7, 8]


@pytest.mark.parametrize("spec", ["auto:5", "auto:-1", "auto:x", "auto:"])
def test_auto_count_out_of_range_is_named(spec):
    with pytest.raises(ValueError, match=r"--layers 'auto.*auto:N needs N in 0\.\.4"):
        DistillConfig(teacher="t", layers=spec).resolve(4)


def test_unknown_recipe_is_named(teacher_dir, tmp_path, capsys):
    with pytest.raises(ValueError, match="unknown --recipe 'nope': choose one of window-gla"):
        DistillConfig(teacher="t", recipe="nope")
    assert main(["distill", "--teacher", str(teacher_dir), "--recipe", "nope",
                 "--out", str(tmp_path / "x")]) == 2
    assert "--recipe" in capsys.readouterr().err


def test_a_recipe_whose_letter_has_no_window_is_named(monkeypatch):
    monkeypatch.setitem(RECIPES, "window-mla", Recipe(name="window-mla", summary="", linear="M"))
    with pytest.raises(ValueError, match="'window-mla': the M mixer .* no windowed form"):
        DistillConfig(teacher="t", recipe="window-mla").resolve(4)
    # without a window the letter is fine, and a pattern given in full is not the recipe's
    assert DistillConfig(teacher="t", recipe="window-mla", window=0).resolve(4).window == 0
    assert DistillConfig(teacher="t", recipe="window-mla", layers="GGGA").resolve(4).window
    for letter in ("D", "K"):    # the windowed delta forms: resolved where they exist
        cfg = DistillConfig(teacher="t", recipe=f"window-{'delta' if letter == 'D' else 'kda'}")
        if windowed_form(letter) is None:
            with pytest.raises(ValueError, match=f"the {letter} mixer"):
                cfg.resolve(4)
        else:
            assert cfg.resolve(4).window == 64


def test_a_teacher_without_attention_is_named(tmp_path):
    save_checkpoint(HylaLM(dataclasses.replace(preset("debug"), layers="GG")), tmp_path / "t")
    with pytest.raises(ValueError, match="has no attention layers"):
        Distiller(DistillConfig(teacher=str(tmp_path / "t"), out=str(tmp_path / "s"), **TINY))


def test_default_run_prints_its_plan_and_times_its_phases(teacher_dir, tmp_path, capsys):
    out = tmp_path / "s"
    assert main(["distill", "--teacher", str(teacher_dir), "--out", str(out), "--seq-len",
                 "48", "--window", "8", "--stage1-steps", "1", "--stage2-steps", "1",
                 "--eval-batches", "1", "--report-tokens", "512", "--no-progress"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    first = text.index("recipe window-gla")
    assert first < text.index("teacher load:") < text.index("layer ranking:")
    assert "stay attention" in text and "stage 1: 1 steps x 1 x 48 tokens = 48 tokens" in text
    stage1 = re.search(r"stage 1: \d+\.\d s\b", text).start()
    assert text.index("estimated time: about") < stage1 < text.index("report:")
    r = json.loads((out / "report.json").read_text())
    assert r["recipe"] == "window-gla" and r["layers"].count("A") == 1     # auto: 4 // 4
    assert r["config"]["layers"] == "auto:1" and r["config"]["lora_rank"] == 8
    assert set(r["teacher_figures"]["perplexity"]) == {"512"}               # the cheap report
    assert set(r["student_figures"]["passkey"]) == {"1024"}
    assert {"teacher_load", "layer_ranking", "calibration", "estimate", "stage1", "stage2",
            "validation", "report"} <= set(r["phases"])
    assert r["estimate"]["total_seconds"] > 0
    saved = load_train_state(out, config_type=DistillConfig)["cfg"]
    assert saved.to_dict() == r["config"]                  # the resolved config is what is saved
    old = {k: v for k, v in saved.to_dict().items()         # a config from before recipes
           if k not in ("recipe", "layer_ranking", "full_report", "report_tasks",
                        "include_path")}
    assert DistillConfig(**old).resolve(4).to_dict() == saved.to_dict()


def test_estimate_leaves_no_gradient_and_the_rng_as_it_was(teacher_dir, tmp_path):
    torch.manual_seed(0)
    d = Distiller(DistillConfig(teacher=str(teacher_dir), out=str(tmp_path / "s"), **TINY))
    assert d.estimate["stage_step_seconds"].keys() == {"1", "2"}
    assert all(p.grad is None for p in d.model.parameters())
    after = torch.get_rng_state()
    calls = []
    monkey = distill_module.Distiller._estimate
    distill_module.Distiller._estimate = lambda self: calls.append(1) or {"line": ""}
    try:
        Distiller(DistillConfig(teacher=str(teacher_dir), out=str(tmp_path / "t"), **TINY))
    finally:
        distill_module.Distiller._estimate = monkey
    assert calls and torch.equal(torch.get_rng_state(), after)


def test_layer_ranking_and_linear_letter_reach_choose_layers(teacher_dir, tmp_path, monkeypatch):
    seen = {}

    def fake(teacher, spec, probe=None, *, window=64, sinks=4, ranking="probes", linear="G"):
        seen.update(spec=spec, ranking=ranking, linear=linear)
        return linear * 3 + "A"

    monkeypatch.setattr(distill_module, "choose_layers", fake)
    d = Distiller(DistillConfig(teacher=str(teacher_dir), out=str(tmp_path / "s"),
                                layer_ranking="kl", **TINY))
    assert seen == {"spec": "auto:1", "ranking": "kl", "linear": "G"}
    assert d.model.cfg.layers == "GGGA"
    with pytest.raises(ValueError, match="layer-ranking must be one of"):
        DistillConfig(teacher="t", layer_ranking="random")


def test_report_tasks_score_teacher_and_student(teacher_dir, tmp_path, monkeypatch):
    compare = pytest.importorskip("hyla.eval.compare")
    harness = pytest.importorskip("hyla.eval.harness")
    kw = {**TINY, "report_tokens": 512}
    with pytest.raises(ValueError, match="--include-path"):   # named before any training
        Distiller(DistillConfig(teacher=str(teacher_dir), out=str(tmp_path / "x"),
                                report_tasks="t", include_path=str(tmp_path / "none"), **kw))
    assert not (tmp_path / "x" / "metrics.jsonl").exists()
    # lm-eval itself is the harness's to test: here, what the report does with its scores
    monkeypatch.setattr(harness, "task_manager", lambda tasks, include_path=None: None)
    calls = []

    def fake(model, tokenizer, tasks, *, include_path=None, limit=None):
        calls.append((model.cfg.layers, tuple(tasks), include_path))
        return {t: {"metric": "acc", "score": 0.5 if "G" in model.cfg.layers else 0.8}
                for t in tasks}

    monkeypatch.setattr(compare, "skill_scores", fake)
    d = Distiller(DistillConfig(teacher=str(teacher_dir), out=str(tmp_path / "s"),
                                report_tasks="t1, t2", include_path=str(tmp_path), **kw))
    d.fit(progress=False)
    skills = json.loads((tmp_path / "s/report.json").read_text())["skills"]
    assert [c[1:] for c in calls] == [(("t1", "t2"), str(tmp_path))] * 2
    assert skills["t1"]["teacher"] == 0.8 and skills["t2"]["student"] == 0.5
    assert skills["t1"]["ratio"] == pytest.approx(0.625)
