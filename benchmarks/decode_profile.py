"""Where a serving decode step's time goes: scheduler, model (by op kind), sampling, the rest.

SmolLM2-135M Q4_1 as ``hyla serve`` runs it (``--quantize`` scheme, default ``auto``), one
thread, in the engine: one request, then 16 at once, decoding ``--tokens`` tokens each. Each
step's wall time is split into the scheduler (``schedule`` + ``update``), the model call
(``Runner.decode``), sampling, and the engine's own bookkeeping; one profiled step more splits
the model call by op kind (int4 / int8 matmuls, attention, norms, element-wise, copies) and
what no op accounts for (Python between ops). ``--compile``: the same with the compiled decode
graphs, built first (minutes). Medians over steps. ``--quick``: 24 tokens.
"""

from __future__ import annotations

import statistics
import time
from collections import defaultdict

import torch

from benchmarks.serve_common import engine, greedy, served_smollm2

# op name fragments -> kind, first match wins
KINDS = (("int4pack", "int4 matmul"), ("int8pack", "int8 matmul"), ("quantized::", "int8 matmul"),
         ("fbgemm", "int8 matmul"), ("attention", "attention"), ("sdpa", "attention"),
         ("bmm", "attention"), ("softmax", "attention"), ("mm", "float matmul"),
         ("linear", "float matmul"), ("addmm", "float matmul"), ("norm", "norm"),
         ("rsqrt", "norm"), ("copy", "copies"), ("index", "copies"), ("cat", "copies"),
         ("embedding", "copies"), ("to", "copies"), ("clone", "copies"))


def add_args(p) -> None:
    p.add_argument("--quantize", default="auto", help="the serving scheme (%(default)s)")
    p.add_argument("--tokens", type=int, default=96, help="tokens a request (%(default)s)")
    p.add_argument("--compile", action="store_true", help="also with compiled decode graphs")


def kind_of(op: str) -> str:
    name = op.lower()
    return next((kind for frag, kind in KINDS if frag in name), "element-wise / other")


class StepTimer:
    """Wraps the engine's scheduler, runner and sampler calls (on the instances: a benchmark
    only) to add up each one's wall time a step."""

    def __init__(self, eng):
        self.parts: dict[str, float] = defaultdict(float)
        sched, runner = eng.scheduler, eng.runner
        self._wrap(sched, "schedule", "scheduler")
        self._wrap(sched, "update", "scheduler")
        self._wrap(runner, "decode", "model")
        self._wrap(runner, "prefill", "prefill")
        sampler = eng.config.sampler
        eng.config.sampler = self._timed(sampler, "sampling")

    def _timed(self, fn, part):
        def timed(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                self.parts[part] += time.perf_counter() - t0
        return timed

    def _wrap(self, obj, name, part):
        setattr(obj, name, self._timed(getattr(obj, name), part))


def run_steps(eng, timer: StepTimer, prompts: list[list[int]], tokens: int) -> list[dict]:
    """Per-step parts (ms) of the decode-only steps of ``prompts`` run together."""
    for p in prompts:
        eng.add_request(p, greedy(tokens))
    steps = []
    while eng.has_unfinished():
        timer.parts.clear()
        t0 = time.perf_counter()
        eng.step()
        wall = time.perf_counter() - t0
        if "prefill" not in timer.parts and "model" in timer.parts:
            parts = {k: v * 1e3 for k, v in timer.parts.items()}
            parts["engine (the rest)"] = wall * 1e3 - sum(parts.values())
            parts["step"] = wall * 1e3
            steps.append(parts)
    return steps


def op_profile(eng, prompts: list[list[int]]) -> tuple[dict[str, float], list[dict]]:
    """ms a decode step by op kind (self CPU time), and what no op accounts for; the
    ops that took longest, with their calls a step."""
    for p in prompts:
        eng.add_request(p, greedy(8))
    while eng.has_unfinished():     # to the first decode-only step
        out = eng.scheduler.waiting or any(s.num_computed_tokens < len(s.prompt_ids)
                                           for s in eng.scheduler.running)
        if not out:
            break
        eng.step()
    steps = 3
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            eng.step()
        wall = (time.perf_counter() - t0) / steps * 1e3
    while eng.has_unfinished():
        eng.step()
    kinds: dict[str, float] = defaultdict(float)
    for e in prof.key_averages():
        if e.key.startswith(("aten::", "quantized::", "fbgemm", "hyla::")) or "::" in e.key:
            kinds[kind_of(e.key)] += e.self_cpu_time_total / 1e3 / steps
    kinds = dict(sorted(kinds.items(), key=lambda kv: -kv[1]))
    kinds["not in any op (Python, profiler)"] = wall - sum(kinds.values())
    kinds["step (profiled)"] = wall
    top = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:15]
    return kinds, [{"op": e.key[:60], "calls": e.count // steps,
                    "self_ms": e.self_cpu_time_total / 1e3 / steps} for e in top]


def summarize(steps: list[dict]) -> dict[str, float]:
    keys = sorted({k for s in steps for k in s}, key=lambda k: k == "step")
    return {k: statistics.median(s.get(k, 0.0) for s in steps) for k in keys}


def main(run) -> None:
    a = run.args
    torch.set_num_threads(a.threads or 1)
    tokens = 24 if a.quick else a.tokens
    model, _, scheme, why = served_smollm2(a.quantize)
    run.progress(f"scheme {scheme} {why}")
    rows, profiles = [], {}
    for compiled in (False, True) if a.compile else (False,):
        eng = engine(model, max_num_seqs=16, max_model_len=1024, compile=compiled)
        if compiled:
            run.progress("compiling widths 1 and 16")
            eng.runner.warmup((1, 16), 1024 // eng.runner.block_size)
        timer = StepTimer(eng)
        mode = "compiled" if compiled else "eager"
        for n in (1, 16):
            prompts = [[(17 + 31 * i + 7 * j) % model.cfg.vocab_size for i in range(64)]
                       for j in range(n)]
            run_steps(eng, timer, prompts[:1], 4)           # warm-up
            parts = summarize(run_steps(eng, timer, prompts, tokens))
            rows.append({"mode": mode, "requests": n, **parts,
                         "tok_s": n * 1e3 / parts["step"]})
            if not compiled:
                kinds, top = op_profile(eng, prompts)
                profiles[f"{n} request(s)"] = {"kinds": kinds, "top_ops": top}
                run.table(f"{mode}, {n} request(s): a step by op kind (ms)",
                          [{"kind": k, "ms": v} for k, v in kinds.items()])
                run.table(f"{mode}, {n} request(s): the longest ops", top)
    run.table("a decode step (ms, medians)", rows)
    one = next(r for r in rows if r["requests"] == 1 and r["mode"] == "eager")
    run.save(rows, scheme=scheme, tokens=tokens, op_kinds=profiles, summary=(
        f"one request, eager: step {one['step']:.2f} ms = model {one['model']:.2f} + "
        f"scheduler {one.get('scheduler', 0):.2f} + sampling {one.get('sampling', 0):.2f} + "
        f"engine {one['engine (the rest)']:.2f}"))
