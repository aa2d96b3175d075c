"""``report.json`` of a distillation: how much of the teacher the student kept, and at what cost.

Teacher and student side by side on held-out text (``eval_data``; default the stdlib
validation split, which distillation never trains on): perplexity at 512 tokens on 4,096
tokens and passkey retrieval at 1K tokens, 2 trials (:func:`hyla.eval.needle.needle_eval`) by
default; with ``full_report``, perplexity at 512 and 2,048 on 16K tokens and passkey at 1K and
2K, 8 trials. Then state bytes a sequence holds at 8K tokens, parameters, lm-eval task scores
when ``report_tasks`` names some (``skills``, :func:`hyla.eval.compare.skill_scores`); and the
run: tokens seen and throughput of each stage (medians of ``metrics.jsonl``), wall time and
the seconds of each phase (``phases``).
"""

from __future__ import annotations

import json
import statistics

import torch

from hyla.eval.model_report import (  # noqa: F401  (model_report: re-exported)
    PASSKEY_DEPTHS,
    PASSKEY_LENGTHS,
    PPL_LENGTHS,
    STATE_CONTEXT,
    model_report,
)

CHEAP_PPL_LENGTHS = (512,)
CHEAP_PASSKEY_LENGTHS = (1024,)


def report_lengths(cfg) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(perplexity lengths, passkey lengths) of a run's report: 512 and 1K by default; 512 +
    2,048 and 1K + 2K with ``cfg.full_report``."""
    if cfg.full_report:
        return PPL_LENGTHS, PASSKEY_LENGTHS
    return CHEAP_PPL_LENGTHS, CHEAP_PASSKEY_LENGTHS


def stage_figures(metrics_path, tokens_per_step: dict[str, int]) -> dict:
    """Per stage (``tokens_per_step`` by stage name): steps, tokens, median tokens/s and
    summed step seconds, from the run's ``metrics.jsonl``."""
    stages: dict[str, list[dict]] = {}
    for line in open(metrics_path, encoding="utf-8"):
        record = json.loads(line)
        if "stage" in record and "tokens_per_s" in record:
            stages.setdefault(str(record["stage"]), []).append(record)
    out = {}
    for stage, records in stages.items():
        rates = [r["tokens_per_s"] for r in records]
        per_step = tokens_per_step[stage]
        out[stage] = {"steps": len(records), "tokens": per_step * len(records),
                      "tokens_per_s_median": statistics.median(rates),
                      "seconds": sum(per_step / r for r in rates)}
    return out


@torch.no_grad()
def write_report(distiller, *, train_seconds: float) -> dict:
    """Write ``report.json`` in the run directory of ``distiller`` (a finished
    :class:`~hyla.train.distill.Distiller`) and return it."""
    cfg = distiller.cfg
    lengths, passkey_lengths = report_lengths(cfg)
    kw = {"data": cfg.eval_data, "tokens": cfg.report_tokens, "trials": cfg.report_trials,
          "lengths": lengths, "passkey_lengths": passkey_lengths}
    teacher = model_report(distiller.teacher, distiller.tokenizer, **kw)
    student = model_report(distiller.model, distiller.tokenizer, **kw)
    skills = None
    if cfg.tasks:
        skills = task_scores(distiller.teacher, distiller.model, distiller.tokenizer, cfg.tasks,
                             include_path=cfg.include_path)
    stages = stage_figures(distiller.out / "metrics.jsonl",
                           {"1": cfg.stage1_tokens_per_step, "2": cfg.tokens_per_step})
    ratio = {n: student["perplexity"][n]["perplexity"] / teacher["perplexity"][n]["perplexity"]
             for n in teacher["perplexity"]}
    report = {
        "teacher": cfg.teacher, "recipe": cfg.recipe, "layers": distiller.model.cfg.layers,
        "layers_asked": cfg.layers, "window": cfg.window, "sinks": cfg.sinks,
        "lora_rank": cfg.lora_rank, "config": cfg.to_dict(),
        "eval_data": cfg.eval_data or "stdlib validation split",
        "full_report": cfg.full_report,
        "teacher_figures": teacher, "student_figures": student,
        "perplexity_ratio": ratio,
        "state_ratio_8k": student["state_bytes_8k"] / teacher["state_bytes_8k"],
        "state_ratio_8k_bf16": student["state_bytes_8k_bf16"] / teacher["state_bytes_8k_bf16"],
        "parameter_ratio": student["parameters"] / teacher["parameters"],
        "stages": stages, "tokens_seen": sum(s["tokens"] for s in stages.values()),
        "train_seconds": train_seconds,
        "calibration": getattr(distiller, "calibration", None),
        "phases": dict(getattr(distiller, "phases", {})),
        "estimate": {k: v for k, v in (getattr(distiller, "estimate", None) or {}).items()
                     if k != "line"} or None,
    }
    if skills is not None:
        report["skills"] = skills
    (distiller.out / "report.json").write_text(json.dumps(report, indent=1))
    return report


def task_scores(teacher, student, tokenizer, tasks: list[str], *,
                include_path: str | None = None) -> dict:
    """lm-eval scores of teacher and student on ``tasks``
    (:func:`hyla.eval.compare.skill_scores`): ``{task: {"metric", "teacher", "student",
    "ratio"}}``."""
    from hyla.eval.compare import skill_scores

    t = skill_scores(teacher, tokenizer, tasks, include_path=include_path)
    s = skill_scores(student, tokenizer, tasks, include_path=include_path)
    out = {}
    for task in tasks:
        a, b = t[task].get("score"), s[task].get("score")
        out[task] = {"metric": t[task].get("metric"), "teacher": a, "student": b,
                     "ratio": b / a if a and b is not None else None,
                     "samples": s[task].get("samples"), "teacher_scores": t[task],
                     "student_scores": s[task]}
    return out
