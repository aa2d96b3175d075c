"""Chunked GLA prefill beats the token loop and causal softmax attention, more so with T.

Per sequence length T and dtype (B = 1, H = 8, K = V = 128): forward tokens/s of
``chunk_gla``, ``naive_recurrent_gla`` and causal SDPA with the same heads, their ratios, and
the FLOP/s ``chunk_gla`` reaches against the measured matmul peak in the dtype its matmuls ran
in; forward + backward against the loop and SDPA; what harsh gates (down to -20 a step: the
hierarchical scores) and glibc's default allocator (timed in a child process, which cannot be
un-tuned) cost at T = 4096. ``--quick``: T = 512 and 2048.
"""

from __future__ import annotations

import subprocess
import sys

import torch
import torch.nn.functional as F

from hyla.ops.gla import chunk_gla, naive_recurrent_gla
from hyla.ops.gla.chunk import matmul_dtype
from hyla.perf import matmul_peak_flops, time_fn

H, K, V, CHUNK = 8, 128, 128, 64
NAIVE_BACKWARD_MAX_T = 2048     # the loop's backward takes ~10 s at 2048: enough to show it
SDPA_BF16_BACKWARD_MAX_T = 4096  # quadratic and emulated in bf16 here: hours beyond
CHILD = "import benchmarks.gla_prefill as b, hyla.ops.gla as g; print(b.forward(g.chunk_gla, 4096))"


def inputs(T, dtype, harsh=False, grad=False):
    q, k, v, x = torch.randn(4, 1, T, H, K)
    g = F.logsigmoid(5 * x) if harsh else F.logsigmoid(x) / 16
    return [t.to(dtype).requires_grad_(grad) for t in (q, k, v, g)]


def sdpa(q, k, v, g):
    return F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)),
                                          is_causal=True)


def forward(fn, T, dtype=torch.float32, repeats=3, harsh=False):
    args = inputs(T, dtype, harsh)
    with torch.no_grad():
        return time_fn(lambda: fn(*args), repeats=repeats)


def forward_backward(fn, T, dtype, repeats):
    args = inputs(T, dtype, grad=True)

    def step():
        out = fn(*args)
        (out[0] if isinstance(out, tuple) else out).float().sum().backward()
    return time_fn(step, repeats=repeats)


def main(run) -> None:
    default_alloc = float(subprocess.run([sys.executable, "-c", CHILD], check=True, text=True,
                                         capture_output=True).stdout.split()[-1])
    lengths = (512, 2048) if run.args.quick else (512, 1024, 2048, 4096, 8192, 16384)
    reps = run.args.repeats
    peaks = {dt: matmul_peak_flops(dt, size=1024) for dt in (torch.float32, torch.bfloat16)}
    fwd, train, costs = [], [], []
    for dtype in peaks:
        name, mm = str(dtype).removeprefix("torch."), matmul_dtype(torch.empty(0, dtype=dtype))
        for T in lengths:
            run.progress(f"{name} forward T={T}")
            t = {"chunk": forward(chunk_gla, T, dtype, reps),
                 "naive": forward(naive_recurrent_gla, T, dtype, 1),
                 "sdpa": forward(sdpa, T, dtype, 1 if T >= 8192 else reps)}
            flops = 2.0 * T * H * (CHUNK * K + CHUNK * V + 2 * K * V) / t["chunk"]
            fwd.append({"dtype": name, "T": T, **{f"{k}_tok_s": T / v for k, v in t.items()},
                        "chunk_vs_naive": t["naive"] / t["chunk"],
                        "chunk_vs_sdpa": t["sdpa"] / t["chunk"], "matmul_dtype": str(mm)[6:],
                        "chunk_gflop_s": flops / 1e9, "frac_of_peak": flops / peaks[mm]})
        mild = forward(chunk_gla, 4096, dtype, reps)
        costs.append({"dtype": name, "T": 4096, "what": "harsh gates (hierarchical scores)",
                      "slowdown": forward(chunk_gla, 4096, dtype, reps, harsh=True) / mild})
        if dtype == torch.float32:
            costs.append({"dtype": name, "T": 4096, "what": "default glibc allocator",
                          "slowdown": default_alloc / mild})
        for T in lengths:
            run.progress(f"{name} forward + backward T={T}")
            chunk = forward_backward(chunk_gla, T, dtype, reps)
            row = {"dtype": name, "T": T, "chunk_fwd_bwd_tok_s": T / chunk}
            if dtype == torch.float32 or T <= SDPA_BF16_BACKWARD_MAX_T:
                s = forward_backward(sdpa, T, dtype, 1 if T >= 8192 else reps)
                row |= {"sdpa_fwd_bwd_tok_s": T / s, "chunk_vs_sdpa": s / chunk}
            if T <= NAIVE_BACKWARD_MAX_T:
                n = forward_backward(naive_recurrent_gla, T, dtype, 1)
                row |= {"naive_fwd_bwd_tok_s": T / n, "chunk_vs_naive": n / chunk}
            train.append(row)
    run.table("chunk_gla forward (tokens/s; ratios are speedups of chunk_gla)", fwd)
    run.table("forward + backward (tokens/s)", train)
    run.table("chunk_gla forward: what costs extra", costs)
    at = next((r for r in fwd if r["T"] == 4096 and r["dtype"] == "float32"), fwd[-1])
    run.save(fwd, train_rows=train, cost_rows=costs, chunk_size=CHUNK,
             shape={"B": 1, "H": H, "K": K, "V": V},
             matmul_peak_gflop_s={str(k): v / 1e9 for k, v in peaks.items()},
             summary=f"chunk_gla fp32 at T={at['T']}: {at['chunk_vs_naive']:.1f}x the token "
                     f"loop, {at['chunk_vs_sdpa']:.1f}x causal SDPA")
