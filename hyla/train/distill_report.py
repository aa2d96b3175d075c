"""``report.json`` of a distillation: how much of the teacher the student kept, and at what cost.

Teacher and student side by side on held-out text (``eval_data``; default the stdlib
validation split, which distillation never trains on): perplexity at 512 and 2,048 tokens,
passkey retrieval at 1K and 2K tokens (:func:`hyla.eval.needle.needle_eval`), state bytes a
sequence holds at 8K tokens, parameters; and the run: tokens seen and throughput of each
stage (medians of ``metrics.jsonl``), wall time.
"""

from __future__ import annotations

import json
import statistics

import torch

from hyla.eval.memory import state_bytes
from hyla.eval.needle import needle_eval
from hyla.eval.perplexity import perplexity

PPL_LENGTHS = (512, 2048)
PASSKEY_LENGTHS = (1024, 2048)
PASSKEY_DEPTHS = (0.25, 0.75)
STATE_CONTEXT = 8192


def model_report(model, tokenizer, *, data=None, tokens: int = 16384, trials: int = 8) -> dict:
    """Held-out perplexity (``tokens`` tokens, or fewer where a window needs more), passkey
    accuracy (``trials`` a context length, half at each of two depths), state bytes at 8K
    and parameters of one model.

    Example:
        >>> from hyla.data import ByteTokenizer
        >>> from hyla.model import HylaLM, preset
        >>> r = model_report(HylaLM(preset("debug")), ByteTokenizer(), tokens=4096, trials=2)
        >>> sorted(r["perplexity"]), r["state_bytes_8k_bf16"] < r["state_bytes_8k"]
        (['2048', '512'], True)
    """
    was_training = model.training
    model.eval()
    ppl = {}
    for n in PPL_LENGTHS:
        r = perplexity(model, tokenizer, data, seq_len=n, max_tokens=max(tokens, n), batch_size=1)
        ppl[str(n)] = {"perplexity": r["perplexity"], "tokens": r["tokens"]}
    passkey = {}
    for n in PASSKEY_LENGTHS:
        cells = needle_eval(model, tokenizer, [n], PASSKEY_DEPTHS,
                            trials=max(1, trials // len(PASSKEY_DEPTHS)))
        passkey[str(n)] = {"correct": sum(c["correct"] for c in cells),
                           "trials": sum(c["trials"] for c in cells)}
    dtype = next(model.parameters()).dtype
    model.train(was_training)
    return {"perplexity": ppl, "passkey": passkey,
            "state_bytes_8k": state_bytes(model.cfg, STATE_CONTEXT, dtype)["total"],
            # served in bf16: caches halve, recurrent matrices stay fp32
            "state_bytes_8k_bf16": state_bytes(model.cfg, STATE_CONTEXT, torch.bfloat16)["total"],
            "parameters": model.num_parameters()}


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
    kw = {"data": cfg.eval_data, "tokens": cfg.report_tokens, "trials": cfg.report_trials}
    teacher = model_report(distiller.teacher, distiller.tokenizer, **kw)
    student = model_report(distiller.model, distiller.tokenizer, **kw)
    stages = stage_figures(distiller.out / "metrics.jsonl",
                           {"1": cfg.stage1_tokens_per_step, "2": cfg.tokens_per_step})
    ratio = {n: student["perplexity"][n]["perplexity"] / teacher["perplexity"][n]["perplexity"]
             for n in teacher["perplexity"]}
    report = {
        "teacher": cfg.teacher, "layers": distiller.model.cfg.layers,
        "layers_asked": cfg.layers, "window": cfg.window, "sinks": cfg.sinks,
        "lora_rank": cfg.lora_rank,
        "eval_data": cfg.eval_data or "stdlib validation split",
        "teacher_figures": teacher, "student_figures": student,
        "perplexity_ratio": ratio,
        "state_ratio_8k": student["state_bytes_8k"] / teacher["state_bytes_8k"],
        "state_ratio_8k_bf16": student["state_bytes_8k_bf16"] / teacher["state_bytes_8k_bf16"],
        "parameter_ratio": student["parameters"] / teacher["parameters"],
        "stages": stages, "tokens_seen": sum(s["tokens"] for s in stages.values()),
        "train_seconds": train_seconds,
        "calibration": getattr(distiller, "calibration", None),
    }
    (distiller.out / "report.json").write_text(json.dumps(report, indent=1))
    return report
