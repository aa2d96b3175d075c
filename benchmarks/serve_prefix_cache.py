"""A repeated 4K-token prefix is served from the prefix cache: warm TTFT is a fraction of cold.

Two requests share a 4,096-token prefix, then 32 tokens of their own; the warm one restores the
GLA snapshots and reuses the KV blocks. ``small`` hybrid and GLA-only, medians of ``--repeats``
(fresh engine and prompts each). ``--quick``: a 1,024-token prefix, one repeat.
"""

import statistics
import time

import torch

from benchmarks.serve_common import engine, greedy, hyla_model, random_prompts


def ttft(eng, prompt: list[int]) -> tuple[float, int]:
    t0, seq = time.perf_counter(), eng.add_request(prompt, greedy(1))
    while not seq.output_ids:
        eng.step()
    return time.perf_counter() - t0, seq.num_cached_tokens


def main(run) -> None:
    torch.set_num_threads(run.args.threads or 1)
    n, rows = 1024 if run.args.quick else 4096, []
    for name, layers in (("hybrid GGGA x2", None), ("GLA only", "GGGGGGGG")):
        model, cold, warm = hyla_model("small", layers), [], []
        for rep in range(1 if run.args.quick else run.args.repeats):
            run.progress(f"{name}, repeat {rep + 1}")
            prefix, a, b = random_prompts([n, 32, 32], model.cfg.vocab_size, seed=rep)
            eng = engine(model, max_num_seqs=4, max_model_len=n + 64,
                         max_num_batched_tokens=8192, snapshot_interval=1024)
            cold.append(ttft(eng, prefix + a)[0])
            w, cached = ttft(eng, prefix + b)
            warm.append(w)
        c, w = statistics.median(cold), statistics.median(warm)
        rows.append({"model": name, "prefix": n, "ttft_cold_ms": 1e3 * c,
                     "ttft_warm_ms": 1e3 * w, "speedup": c / w, "cached_tokens": cached})
    run.table(f"TTFT of a repeated {n}-token prefix (+32-token suffix), cold vs warm", rows)
    run.save(rows, repeats=len(cold), summary="; ".join(
        f"{r['model']}: {r['ttft_cold_ms']:,.0f} ms cold -> {r['ttft_warm_ms']:,.0f} ms warm "
        f"({r['speedup']:.0f}x)" for r in rows))
