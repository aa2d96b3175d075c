"""Claim: padding decode batches to fixed widths means a compiled decode step never
compiles while serving; without it, staggered arrivals keep triggering compilations.

A GLA-only model of the ``small`` preset's width and depth serves requests arriving as a
Poisson process (seeded), with ``torch.compile`` on the decode step, three ways:

- bucketed + warm-up: widths (1, 2, 4, 8, ...) all compiled before the first request;
- bucketed, on demand: the same widths, compiled when first seen;
- unbucketed, on demand: every batch size is its own width (what the reference did).

It reports compilations during serving and the share of decode time spent in the calls
that compiled (inductor's on-disk cache off, so every case compiles from scratch). Then the
max logit difference between eager and compiled decode with the model in bf16 (and fp32),
from the same states over several steps.

    python benchmarks/serve_bucketing.py [--quick]
"""

from __future__ import annotations

import argparse
import random
import sys
import time

import torch

sys.path.insert(0, str(__import__("pathlib").Path(__file__).parent))
from serve_common import hyla_model, random_prompts  # noqa: E402

from hyla.perf import print_table, tune_cpu_allocator, write_results  # noqa: E402
from hyla.serve.engine import Engine, EngineConfig  # noqa: E402
from hyla.serve.runner import Runner  # noqa: E402
from hyla.serve.sequence import SamplingParams  # noqa: E402


def serve_poisson(model, widths, warm: bool, n: int, rate: float, max_seqs: int) -> dict:
    torch._dynamo.reset()
    # Every case compiles from scratch: inductor's on-disk graph cache would otherwise let
    # a later case reuse the kernels an earlier one built for the same width.
    torch._inductor.config.fx_graph_cache = False
    torch._inductor.config.autotune_local_cache = False
    eng = Engine(model, None, EngineConfig(max_num_seqs=max_seqs, max_model_len=512,
                                           compile=True, decode_widths=widths))
    t0 = time.perf_counter()
    warm_graphs = eng.warmup() if warm else 0
    warm_s = time.perf_counter() - t0
    eng.runner.compile_time_s = 0.0
    compiled_before = eng.runner.num_compilations
    rng = random.Random(0)
    gaps = [rng.expovariate(rate) for _ in range(n)]
    lens = [rng.randint(16, 96) for _ in range(n)]
    outs = [rng.randint(8, 40) for _ in range(n)]
    prompts = random_prompts(lens, model.cfg.vocab_size)
    arrivals, t = [], 0.0
    for g in gaps:
        t += g
        arrivals.append(t)
    start = time.perf_counter()
    i = 0
    while i < n or eng.has_unfinished():
        now = time.perf_counter() - start
        while i < n and arrivals[i] <= now:
            eng.add_request(prompts[i], SamplingParams(max_tokens=outs[i], temperature=0,
                                                       ignore_eos=True))
            i += 1
        if not eng.has_unfinished():
            time.sleep(max(0.0, arrivals[i] - now))
            continue
        eng.step()
    decode_s = eng.stats["decode_time_s"]
    return {"warm_up_graphs": warm_graphs, "warm_up_s": warm_s,
            "compilations_serving": eng.runner.num_compilations - compiled_before,
            "compile_s_serving": eng.runner.compile_time_s, "decode_s": decode_s,
            "compile_share": eng.runner.compile_time_s / decode_s if decode_s else 0.0,
            "decode_steps": eng.stats["decode_steps"], "wall_s": time.perf_counter() - start}


def eager_vs_compiled(model, dtype, steps: int = 6, batch: int = 4) -> float:
    model = model.to(dtype)
    runners = [Runner(model, max_num_seqs=batch, num_kv_blocks=0, compile=c)
               for c in (False, True)]
    prompts = random_prompts([24 + 3 * b for b in range(batch)], model.cfg.vocab_size, seed=1)
    diff = 0.0
    for r in runners:
        r.prefill([(b, p, 0, []) for b, p in enumerate(prompts)])
    for s in range(steps):
        toks = [(7 * s + b) % model.cfg.vocab_size for b in range(batch)]
        pos = [len(p) + s for p in prompts]
        a, b = (r.decode(list(range(batch)), toks, pos, [[]] * batch, batch) for r in runners)
        diff = max(diff, float((a - b).abs().max()))
    model.float()
    return diff


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=1,
                    help="torch CPU threads (1: on this 2-vCPU VM a second intra-op thread "
                         "makes the small ops of a decode step 2-5x slower)")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--requests", type=int, default=40)
    ap.add_argument("--rate", type=float, default=2.0, help="arrivals per second")
    ap.add_argument("--max-num-seqs", type=int, default=8)
    args = ap.parse_args()
    tune_cpu_allocator()
    torch.set_num_threads(args.threads)
    n = 10 if args.quick else args.requests
    model = hyla_model("small", "GGGGGGGG")
    m = args.max_num_seqs
    from hyla.serve.scheduler import decode_widths

    cases = {"bucketed + warm-up": (decode_widths(m), True),
             "bucketed, on demand": (decode_widths(m), False),
             "unbucketed, on demand": (tuple(range(1, m + 1)), False)}
    rows = []
    for name, (widths, warm) in cases.items():
        r = serve_poisson(model, widths, warm, n, args.rate, m)
        rows.append({"case": name, "widths": len(widths), **r})
        print(rows[-1], flush=True)
    print_table(f"{n} Poisson requests at {args.rate}/s, compiled decode, "
                f"max_num_seqs {m}", rows)
    torch._dynamo.reset()
    diffs = {"bf16": eager_vs_compiled(model, torch.bfloat16),
             "fp32": eager_vs_compiled(model, torch.float32)}
    print("max |logit eager - logit compiled|:", diffs)
    path = write_results("serve_bucketing_quick" if args.quick else "serve_bucketing", rows,
                         eager_vs_compiled_max_logit_diff=diffs, requests=n, rate=args.rate,
                         model="small width/depth, GLA only (GGGGGGGG), fp32")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
