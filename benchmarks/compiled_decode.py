"""Compiling the decode step (``hyla serve --compile``) makes it faster, logits as eager's.

The runner on SmolLM2-135M int4 (and ``--student``, a run directory), eager against compiled
in alternating ``--rounds``: median ms of 24 teacher-forced steps after held-out text, 1
sequence after 256 tokens and 16 after 64 (the student: 1 after 1,024); logit distance; graph
build seconds. ``--quick``: 1 sequence only.
"""

import pathlib
import statistics
import time

import torch

from hyla.data.corpus import iter_documents
from hyla.model.load import load_model
from hyla.model.quantize import prepare_copies, quantize_model
from hyla.serve.runner import Runner

STEPS = 24


def add_args(parser) -> None:
    parser.add_argument("--student", help="a distilled student's run directory")


def decode_run(runner: Runner, ids: list[int], prompt: int, width: int, blocks: int):
    """Prefill ``width`` copies of ``ids[:prompt]``, teacher-force STEPS tokens: median ms a
    step (the first two left out) and the first sequence's logits."""
    tables = [list(range(j * blocks, (j + 1) * blocks)) for j in range(width)]
    for j in range(width):
        runner.reset_slot(j)
        runner.prefill([(j, ids[:prompt], 0, tables[j])])
    times, logits = [], []
    for i in range(STEPS):
        start = time.perf_counter()
        logits.append(runner.decode(list(range(width)), [ids[prompt + i]] * width,
                                    [prompt + i] * width, tables, width=width)[0])
        times.append(1e3 * (time.perf_counter() - start))
    return statistics.median(times[2:]), torch.stack(logits)


def compare(run, model, ids: list[int], prompt: int, width: int) -> dict:
    blocks = (prompt + STEPS) // 16 + 2
    runners = {mode: Runner(model, max_num_seqs=width, num_kv_blocks=width * blocks + 1,
                            kv_dtype=torch.bfloat16, compile=mode == "compiled")
               for mode in ("eager", "compiled")}
    began = time.perf_counter()
    runners["compiled"].warmup((width,), blocks)
    build_s = time.perf_counter() - began
    got = run.rounds({m: lambda r=r: decode_run(r, ids, prompt, width, blocks)
                      for m, r in runners.items()})
    ms = {m: [t for t, _ in rs] for m, rs in got.items()}
    (e, a), (c, b) = ((statistics.median(ms[m]), got[m][-1][1]) for m in ("eager", "compiled"))
    return {"width": width, "prompt_tokens": prompt, "graph_build_s": build_s, "eager_ms": e,
            "compiled_ms": c, "speedup": e / c, "rounds_ms": ms,
            "max_abs_logit_diff": (a - b).abs().max().item(),
            "argmax_agreement": (a.argmax(-1) == b.argmax(-1)).float().mean().item()}


def main(run) -> None:
    torch.set_num_threads(run.args.threads or 1)
    rows, student = [], run.args.student
    for name, source in [("SmolLM2-135M int4", "smollm2")] + (
            [(f"student {pathlib.Path(student).name} int4", student)] if student else []):
        model, tokenizer = load_model(source)
        quantize_model(model, "int4")
        prepare_copies(model)
        text = ""
        for doc in iter_documents(None, "validation"):          # held-out text
            if len(ids := tokenizer.encode(text := text + doc)) >= 1024 + STEPS:
                break
        shapes = ((1, 256), (16, 64)) if source == "smollm2" else ((1, 1024),)
        for width, prompt in shapes[:1] if run.args.quick else shapes:
            run.progress(f"{name}, {width} wide after {prompt} tokens")
            rows.append({"model": name, **compare(run, model, ids, prompt, width)})
    run.table("decode step, eager against compiled (ms, medians)",
              [{k: v for k, v in r.items() if k != "rounds_ms"} for r in rows])
    run.save(rows, summary="; ".join(
        f"{r['model']}, {r['width']} wide after {r['prompt_tokens']} tokens: "
        f"{r['eager_ms']:.1f} -> {r['compiled_ms']:.1f} ms a step ({r['speedup']:.2f}x)"
        for r in rows))
