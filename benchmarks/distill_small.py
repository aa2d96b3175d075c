"""Distilled hybrids beat the same hybrids trained from scratch; stage 1 runs where a KL cannot.

A miniature (fp32, AdamW, 4 x 256 tokens a step, finished runs in ``--work`` reused): an 8 x A
``small`` teacher (120 steps), exported to a transformers directory, distilled (``plain-gla``,
30 + 60 steps) into ``GGGAGGGA`` (2 KV heads: StreamKL) and ``GGGGGGGG``, and each student
trained from scratch as long: perplexity, passkey at 256 tokens, state at 8K
(``distill_small.png``); then one stage-1 step and one materialised KL at 16,384 tokens under
an 8 GiB cap. ``--quick``: a ``debug``-sized teacher, 6 + 3 + 3 steps, 2,048 tokens.
"""

import dataclasses
import json
import pathlib
import resource
import shutil
import subprocess
import sys
import tempfile
import time

import torch

from benchmarks.train_common import curve, figure, jsonl, out_dir, save_figure, scores, stem

STUDENTS = {"GGGA": ("GGGA" * 2, 2), "GGGG": ("G" * 8, None)}
SEQ, BATCH, CAP_GIB = 256, 4, 8.0
FULL = {"preset": "small", "kv": 6, "teacher": 120, "stage1": 30, "stage2": 60,
        "eval_tokens": 16384, "trials": 2, "long": 16384}
QUICK = FULL | {"preset": "debug", "kv": 4, "teacher": 6, "stage1": 3, "stage2": 3,
                "eval_tokens": 2048, "trials": 1, "long": 2048}


def add_args(parser) -> None:
    parser.add_argument("--work", default=None, help="folder of the runs (default: a temporary)")


def long_child(hf_dir: str, length: str, mode: str) -> None:
    """A child process under the cap: one stage-1 step (``stream``) or one materialised KL."""
    resource.setrlimit(resource.RLIMIT_AS, (int(CAP_GIB * 2**30),) * 2)
    torch.set_num_threads(2)
    length, extra, start = int(length), {}, time.perf_counter()
    try:
        if mode == "stream":
            from hyla.train.distill import Distiller
            from hyla.train.distill.config import DistillConfig

            d = Distiller(DistillConfig(
                teacher=hf_dir, recipe="plain-gla", layers="GGGA" * 2, student_kv_heads=2,
                stage1_steps=1, stage2_steps=0, seq_len=SEQ, stage1_seq_len=length,
                batch_size=1, optimizer="adamw", out=tempfile.mkdtemp()))
            start = time.perf_counter()
            extra = {"loss": d.train_step()["loss"]}
        else:
            from hyla.ops.streamkl import attention_kl

            q, k = torch.randn(1, length, 6, 64, requires_grad=True), torch.randn(
                1, length, 2, 64, requires_grad=True)
            attention_kl(q.detach(), k.detach(), q, k, backend="naive").backward()
        ok, error = True, None
    except (MemoryError, RuntimeError) as e:
        ok, error = False, str(e).splitlines()[0][:200]
    # VmHWM: the peak resident set since exec (ru_maxrss would include the parent's)
    rss = next(int(ln.split()[1]) * 1024 for ln in open("/proc/self/status")
               if ln.startswith("VmHWM:"))
    print(json.dumps({"mode": mode, "ok": ok, "error": error, "peak_rss_bytes": rss,
                      "seconds": time.perf_counter() - start, **extra}))


def long_run(hf_dir, length: int, mode: str) -> dict:
    child = "import sys, benchmarks.distill_small as b; b.long_child(*sys.argv[1:])"
    try:
        out = subprocess.run([sys.executable, "-c", child, str(hf_dir), str(length), mode],
                             capture_output=True, text=True, timeout=600,
                             cwd=pathlib.Path(__file__).resolve().parent.parent)
    except subprocess.TimeoutExpired:
        return {"mode": mode, "ok": False, "error": "not finished in 600 s"}
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
    return json.loads(lines[-1]) if lines else {
        "mode": mode, "ok": False, "error": (out.stderr.strip() or "no output")[-200:]}


def plot(rows, curves, path: pathlib.Path) -> None:
    fig, (a, b) = figure(2, (12, 4.5))
    a.barh([r["model"] for r in rows], [r["ppl_val"] for r in rows], color="tab:blue")
    a.invert_yaxis()
    a.set_xlabel("validation perplexity (lower is better)")
    for i, r in enumerate(rows):
        a.text(r["ppl_val"], i, f" {r['ppl_val']:.1f}", va="center", fontsize=8)
    for label, (x, y) in curves.items():
        b.plot(x, y, label=label)
    b.set(xlabel="training tokens", ylabel="next-token cross-entropy (train batches)",
          title="stage 2 (after stage 1) vs from scratch")
    b.legend(fontsize=8)
    save_figure(fig, path, dpi=110)


def main(run) -> None:
    from hyla.cli import main as hyla
    from hyla.eval.memory import kv_cache_bytes, state_bytes
    from hyla.model import preset
    from hyla.model.config import PRESETS
    from hyla.model.formats.checkpoint import load_checkpoint as load
    from hyla.train.config import TrainConfig
    from hyla.train.distill import Distiller
    from hyla.train.distill.config import DistillConfig
    from hyla.train.distill.student import student_config
    from hyla.train.trainer import Trainer

    s = QUICK if run.args.quick else FULL
    work = pathlib.Path(run.args.work or tempfile.mkdtemp(prefix="distill_small_"))
    teacher_cfg = dataclasses.replace(preset(s["preset"]), layers="A" * 8, n_kv_heads=s["kv"])
    PRESETS["small-attention"] = lambda: teacher_cfg    # TrainConfig takes a preset's name
    common = dict(seq_len=SEQ, batch_size=BATCH, optimizer="adamw", lr=3e-3, warmup_steps=5,
                  eval_batches=4, seed=0)
    tps, total, timings, curves, headline = SEQ * BATCH, s["stage1"] + s["stage2"], {}, {}, []

    def fit(cls, cfg, steps):    # a finished run in the work folder is reused
        if not (pathlib.Path(cfg.out) / f"ckpt-{steps:06d}" / "model.safetensors").is_file():
            run.progress(f"training {cfg.out}")
            cls(cfg).fit()
        timings[pathlib.Path(cfg.out).name] = round(curve(cfg.out, tps)[-1]["train_seconds"], 1)

    def row(model, label, steps, state):
        run.progress(f"scoring {label}")
        return {"model": label, "tokens": steps * tps, "state_8k_bytes": state,
                "vs_teacher_kv": f"{kv_bytes / state:.1f}x less",
                **scores(model, tok, {"val": None}, tokens=s["eval_tokens"], seq_len=SEQ,
                         passkey=256, trials=s["trials"])}

    fit(Trainer, TrainConfig(preset="small-attention", steps=s["teacher"], out=str(
        work / "teacher"), save_every=s["teacher"], **common), s["teacher"])
    if not (work / "hf" / "config.json").is_file():
        assert hyla(["export", "--format", "llama", str(work / "teacher"), str(work / "hf")]) == 0
    teacher, tok = load(work / "teacher")
    kv_bytes = kv_cache_bytes(teacher_cfg, 8192)
    rows = [row(teacher, "teacher (8 x A)", s["teacher"], kv_bytes)]
    for name, (layers, kv) in STUDENTS.items():
        out, scratch, label = work / f"student-{name}", work / f"scratch-{name}", \
            f"{layers} kv={kv or s['kv']}"
        cfg = student_config(teacher_cfg, layers, kv)
        PRESETS[f"scratch-{name}"], state = (lambda c=cfg: c), state_bytes(cfg, 8192)["total"]
        fit(Distiller, DistillConfig(
            teacher=str(work / "hf"), recipe="plain-gla", layers=layers, student_kv_heads=kv,
            stage1_steps=s["stage1"], stage2_steps=s["stage2"], save_every=total, out=str(out),
            stage1_lr=1e-3, report_tokens=0, **common), total)
        rows += [row(load(out / "stage1")[0], f"{label} after stage 1", s["stage1"], state),
                 row(load(out)[0], f"{label} after stage 2", total, state)]
        recs = [r for r in jsonl(out / "metrics.jsonl") if r["stage"] == 2]
        curves[f"{name} distilled (stage 2 CE)"] = (
            [(s["stage1"] + i + 1) * tps for i in range(len(recs))], [r["ce"] for r in recs])
        scratch.mkdir(parents=True, exist_ok=True)
        shutil.copy(work / "teacher" / "tokenizer.json", scratch / "tokenizer.json")
        fit(Trainer, TrainConfig(preset=f"scratch-{name}", steps=total, save_every=total,
                                 out=str(scratch), **common), total)
        rows.append(row(load(scratch)[0], f"{label} from scratch", total, state))
        recs = jsonl(scratch / "metrics.jsonl")
        curves[f"{name} from scratch"] = ([r["tokens"] for r in recs], [r["loss"] for r in recs])
        headline.append(f"{layers} {rows[-2]['ppl_val']:.0f} vs {rows[-1]['ppl_val']:.0f}")
    run.progress(f"one stage-1 step and one materialised KL at {s['long']:,} tokens")
    stream, naive = long = [long_run(work / "hf", s["long"], m) for m in ("stream", "naive")]
    matrix = 6 * s["long"] ** 2 * 4  # one [B, H, T, T] fp32 score matrix
    run.table("distillation of an all-attention teacher (validation perplexity, passkey hits, "
              "state a sequence at 8K, bf16 KV)", rows)
    run.table(f"one stage-1 step at {s['long']:,} tokens under a {CAP_GIB:g} GiB address-space "
              f"cap (one fp32 T x T score matrix: {matrix / 2**30:.1f} GiB)", long)
    plot(rows, curves, out_dir(run) / f"{stem(run)}.png")
    run.save(rows, long_context=long, timings_s=timings, settings=s, teacher_kv_8k=kv_bytes,
             materialised_score_matrix_bytes=matrix,
             curves={k: {"tokens": x, "loss": y} for k, (x, y) in curves.items()},
             summary=f"perplexity teacher {rows[0]['ppl_val']:.0f}; distilled vs from scratch "
             + ", ".join(headline) + f"; stage 1 at {s['long']:,} tokens " + (
                 f"in {stream['peak_rss_bytes'] / 1e9:.2f} GB peak RSS" if stream["ok"] else
                 "failed") + f", materialised KL {'ran' if naive['ok'] else 'failed'}")
