"""What the training, distillation and recall benchmarks share: ``hyla train`` runs on one
tokenizer, training curves and figures, SmolLM2 as a teacher and held-out scores."""

import json
import os
import pathlib
import shutil
import subprocess
import sys
import time

from hyla.perf import RESULTS_DIR

LICENSES = pathlib.Path("/usr/share/common-licenses")
PROSE = ("GPL-3", "Apache-2.0", "MPL-2.0", "LGPL-2.1", "GFDL-1.3", "Artistic", "CC0-1.0", "BSD")


def out_dir(run, sub: str = "") -> pathlib.Path:
    path = pathlib.Path(run.args.out or RESULTS_DIR) / sub
    path.mkdir(parents=True, exist_ok=True)
    return path


def stem(run, name: str | None = None) -> str:   # the results name, as run.save's
    return (name or run.name) + ("_quick" if run.args.quick else "")


def jsonl(path) -> list[dict]:
    return [json.loads(line) for line in open(path, encoding="utf-8")]


def curve(run_dir, tokens_per_step: int) -> list[dict]:
    """``metrics.jsonl`` with ``train_seconds`` so far (from the tokens/s a step logged)."""
    records, total, seen = jsonl(pathlib.Path(run_dir) / "metrics.jsonl"), 0.0, 0
    for r in records:
        if "tokens_per_s" in r:
            tokens = r.get("tokens", seen + tokens_per_step)
            total, seen = total + (tokens - seen) / r["tokens_per_s"], tokens
        r["train_seconds"] = total
    return records


def tokenizer(folder: pathlib.Path) -> None:   # one for every hyla_train run: the same tokens
    subprocess.run([sys.executable, "-m", "hyla", "tokenizer", "train", "--documents", "400",
                    "--out", str(folder)], check=True, capture_output=True)


def hyla_train(world: int, out: pathlib.Path, *, preset: str, steps: int, seq_len: int,
               batch_size: int, optimizer: str, eval_batches: int = 1, flags=(),
               threads: int | None = None, timeout: float = 900) -> dict:
    """``hyla train`` into ``out`` (torchrun at ``world`` > 1) on ``out``'s parent's tokenizer:
    wall seconds, records, step records and ``run.json``'s ``parallel``, or ``error``."""
    out.mkdir(parents=True)
    shutil.copy(out.parent / "tokenizer.json", out / "tokenizer.json")
    torchrun = shutil.which("torchrun") or str(pathlib.Path(sys.executable).parent / "torchrun")
    cmd = ([torchrun, "--standalone", "--nproc-per-node", str(world)] if world > 1
           else [sys.executable]) + [
        "-m", "hyla", "train", "--preset", preset, "--steps", str(steps), "--seq-len",
        str(seq_len), "--batch-size", str(batch_size), "--optimizer", optimizer, "--save-every",
        str(steps), "--eval-batches", str(eval_batches), "--out", str(out), "--no-progress", *flags]
    env = {**os.environ, **({"OMP_NUM_THREADS": str(threads)} if threads else {})}
    start = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"not finished in {timeout:.0f} s"}
    if proc.returncode:
        return {"error": (proc.stderr or proc.stdout)[-3000:]}
    wall, records = time.perf_counter() - start, jsonl(out / "metrics.jsonl")
    return {"wall_s": wall, "records": records,
            "steps": [r for r in records if "tokens_per_s" in r],
            "parallel": json.loads((out / "run.json").read_text()).get("parallel", {})}


def figure(cols: int, size: tuple[float, float]):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.subplots(1, cols, figsize=size)


def save_figure(fig, path: pathlib.Path, dpi: int = 100) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    fig.clf()


def plot_curves(curves: dict, path: pathlib.Path, title: str, batches: bool = False) -> None:
    """Validation (and ``batches``: training) loss by step and by training seconds."""
    fig, axes = figure(2, (12, 4.2))
    for name, records in curves.items():
        val, color = [r for r in records if "val_loss" in r], None
        if batches:
            color = axes[0].plot([r["step"] for r in records], [r["loss"] for r in records], lw=0.9,
                                 alpha=0.8, label=f"{name}: training batches")[0].get_color()
        axes[0].plot([r["step"] for r in val], [r["val_loss"] for r in val], "o--" if batches
                     else "o-", color=color, label=f"{name}: validation" if batches else name)
        axes[1].plot([r["train_seconds"] for r in val], [r["val_loss"] for r in val], "o-",
                     color=color, label=name)
    axes[0].set_xlabel("step")
    axes[1].set_xlabel("training seconds (this machine)")
    for ax in axes:
        ax.set(ylabel="loss (nats/token)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title)
    save_figure(fig, path)


def smollm2(work: pathlib.Path) -> pathlib.Path:
    """SmolLM2-135M-Instruct's GGUF (~40 s to load) once as a hyla checkpoint (a second)."""
    if not (work / "teacher" / "model.safetensors").exists():
        from hyla.model.formats.checkpoint import save_checkpoint
        from hyla.model.load import load_model

        model, tok = load_model("smollm2")
        save_checkpoint(model, work / "teacher", tok)
    return work / "teacher"


def prose_files() -> list[pathlib.Path]:    # held-out English prose
    return [LICENSES / n for n in PROSE if (LICENSES / n).is_file()]


def heldout(work: pathlib.Path, chars: int | None = None) -> dict:
    """Held-out sets for :func:`scores`: ``code`` (stdlib validation split), ``prose``."""
    if not prose_files():
        return {"code": None}
    (work / "prose").mkdir(parents=True, exist_ok=True)
    for f in prose_files():
        text = f.read_text(encoding="utf-8", errors="replace")[:chars]
        (work / "prose" / f"{f.name}.txt").write_text(text)
    return {"code": None, "prose": str(work / "prose")}


def scores(model, tok, sets: dict, *, tokens: int, seq_len: int = 1024,
           passkey: int | None = None, trials: int = 2) -> dict:
    """Perplexity of each set; hits of passkey retrieval at ``passkey`` tokens, two depths."""
    import torch

    from hyla.eval.needle import needle_eval
    from hyla.eval.perplexity import perplexity

    model.eval()
    with torch.no_grad():
        out = {f"ppl_{name}": perplexity(model, tok, data, seq_len=seq_len, max_tokens=tokens,
                                         batch_size=1)["perplexity"]
               for name, data in sets.items()}
    if passkey:
        cells = needle_eval(model, tok, [passkey], (0.25, 0.75), trials=trials)
        out["passkey"] = f"{sum(c['correct'] for c in cells)}/{sum(c['trials'] for c in cells)}"
    return out


def report_row(run_dir: pathlib.Path) -> dict:
    """A distillation's ``report.json`` as a row: student / teacher figures at each length."""
    if not (run_dir / "report.json").is_file():
        return {}
    r = json.loads((run_dir / "report.json").read_text())
    t, s, out = r["teacher_figures"], r["student_figures"], {}
    for n in t["perplexity"]:
        out[f"ppl {n} s/t"] = "/".join(f"{x['perplexity'][n]['perplexity']:.2f}" for x in (s, t))
        out[f"ratio {n}"] = r["perplexity_ratio"][n]
    for n in t["passkey"]:
        out[f"passkey {n} s/t"] = " vs ".join(f"{x['passkey'][n]['correct']}/"
                                              f"{x['passkey'][n]['trials']}" for x in (s, t))
    return out
