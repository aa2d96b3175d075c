"""Fixed decode widths mean a compiled decode step never compiles while serving.

A GLA-only ``small``-width model (fp32) serves 40 Poisson arrivals at 2/s, ``max_num_seqs`` 8,
decode compiled (no disk cache): widths 1-8 compiled first, the same on demand, one width per
batch size; then eager vs compiled logits (bf16, fp32). ``--quick``: 10 requests.
"""

import itertools
import random
import time

import torch

from benchmarks.serve_common import engine, greedy, hyla_model, random_prompts
from hyla.serve.runner import Runner
from hyla.serve.scheduler import decode_widths

REQUESTS, RATE, MAX_SEQS = 40, 2.0, 8


def serve_poisson(model, widths, warm: bool, n: int) -> dict:
    torch._dynamo.reset()
    # every case compiles from scratch: inductor's on-disk graph cache would otherwise let a
    # later case reuse the kernels an earlier one built for the same width
    torch._inductor.config.fx_graph_cache = torch._inductor.config.autotune_local_cache = False
    eng = engine(model, max_num_seqs=MAX_SEQS, max_model_len=512, compile=True,
                 decode_widths=widths)
    t0 = time.perf_counter()
    warm_graphs, warm_s = eng.warmup() if warm else 0, time.perf_counter() - t0
    eng.runner.compile_time_s, compiled_before = 0.0, eng.runner.num_compilations
    rng = random.Random(0)
    arrivals = list(itertools.accumulate(rng.expovariate(RATE) for _ in range(n)))
    lens, outs = [rng.randint(16, 96) for _ in range(n)], [rng.randint(8, 40) for _ in range(n)]
    prompts, start, i = random_prompts(lens, model.cfg.vocab_size), time.perf_counter(), 0
    while i < n or eng.has_unfinished():
        now = time.perf_counter() - start
        while i < n and arrivals[i] <= now:
            eng.add_request(prompts[i], greedy(outs[i]))
            i += 1
        if eng.has_unfinished():
            eng.step()
        else:
            time.sleep(max(0.0, arrivals[i] - now))
    decode_s, compile_s = eng.stats["decode_time_s"], eng.runner.compile_time_s
    return {"warm_up_graphs": warm_graphs, "warm_up_s": warm_s,
            "compilations_serving": eng.runner.num_compilations - compiled_before,
            "compile_s_serving": compile_s, "decode_s": decode_s,
            "compile_share": compile_s / decode_s if decode_s else 0.0,
            "decode_steps": eng.stats["decode_steps"], "wall_s": time.perf_counter() - start}


def eager_vs_compiled(model, dtype, steps: int = 6, batch: int = 4) -> float:
    model, diff = model.to(dtype), 0.0
    runners = [Runner(model, max_num_seqs=batch, num_kv_blocks=0, compile=c) for c in (0, 1)]
    prompts = random_prompts([24 + 3 * b for b in range(batch)], model.cfg.vocab_size, seed=1)
    for r in runners:
        r.prefill([(b, p, 0, []) for b, p in enumerate(prompts)])
    for s in range(steps):
        toks = [(7 * s + b) % model.cfg.vocab_size for b in range(batch)]
        pos = [len(p) + s for p in prompts]
        a, b = (r.decode(list(range(batch)), toks, pos, [[]] * batch, batch) for r in runners)
        diff = max(diff, float((a - b).abs().max()))
    model.float()
    return diff


def main(run) -> None:
    torch.set_num_threads(run.args.threads or 1)
    n = 10 if run.args.quick else REQUESTS
    model, widths, rows = hyla_model("small", "GGGGGGGG"), decode_widths(MAX_SEQS), []
    for name, w, warm in (("bucketed + warm-up", widths, True),
                          ("bucketed, on demand", widths, False),
                          ("unbucketed, on demand", tuple(range(1, MAX_SEQS + 1)), False)):
        run.progress(name)
        rows.append({"case": name, "widths": len(w), **serve_poisson(model, w, warm, n)})
    run.table(f"{n} Poisson requests at {RATE}/s, compiled decode, max_num_seqs {MAX_SEQS}",
              rows)
    torch._dynamo.reset()
    diffs = {"bf16": eager_vs_compiled(model, torch.bfloat16),
             "fp32": eager_vs_compiled(model, torch.float32)}
    print("max |logit eager - logit compiled|:", diffs)
    run.save(rows, eager_vs_compiled_max_logit_diff=diffs, requests=n, rate=RATE,
             model="small width/depth, GLA only (GGGGGGGG), fp32", summary=", ".join(
                 f"{r['case']}: {r['compilations_serving']} compilations serving "
                 f"({r['compile_share']:.0%} of decode)" for r in rows))
