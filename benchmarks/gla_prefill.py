"""Claim: chunked GLA prefill beats the token loop and causal softmax attention, more so with T.

Side by side in one run, per sequence length T and dtype (B = 1, H = 8, K = V = 128):
- forward tokens/s of ``chunk_gla``, ``naive_recurrent_gla`` and causal SDPA with the same
  heads and head dims, and the ratios chunk/naive and chunk/SDPA;
- the FLOP/s ``chunk_gla`` achieves, as a fraction of this machine's measured dense matmul
  peak in the dtype its matmuls actually ran in (see ``hyla.ops.gla.chunk.matmul_dtype``);
- forward + backward of ``chunk_gla`` against the naive loop and SDPA;
- the cost of harsh gates (log-gates down to about -20 a step), which take the hierarchical
  path of ``intra_scores`` instead of the one-matmul path, at T = 4096;
- the cost of glibc's default allocator (measured first, in a child process, since the
  allocator cannot be un-tuned): every other figure runs with ``tune_cpu_allocator()``.

    python benchmarks/gla_prefill.py            # T = 512 .. 16384, several minutes
    python benchmarks/gla_prefill.py --quick    # T = 512, 2048, under a minute

Writes ``benchmarks/results/gla_prefill.json`` (``gla_prefill_quick.json`` with --quick).
"""

from __future__ import annotations

import argparse
import subprocess
import sys

import torch
import torch.nn.functional as F

from hyla.ops.gla import chunk_gla, naive_recurrent_gla
from hyla.ops.gla.chunk import matmul_dtype
from hyla.perf import matmul_peak_flops, print_table, time_fn, tune_cpu_allocator, write_results

H, K, V, CHUNK = 8, 128, 128, 64
LENGTHS = (512, 1024, 2048, 4096, 8192, 16384)
QUICK_LENGTHS = (512, 2048)
NAIVE_BACKWARD_MAX_T = 2048  # the loop's backward takes ~10 s at 2048: enough to show the gap
# SDPA's bf16 backward runs at ~700 tokens/s at T = 2048 on a CPU without bf16 units and is
# quadratic: beyond this it would take the benchmark hours.
SDPA_BF16_BACKWARD_MAX_T = 4096


def inputs(T: int, dtype: torch.dtype, harsh: bool = False, grad: bool = False):
    q, k, v, x = torch.randn(4, 1, T, H, K)
    g = F.logsigmoid(5 * x) if harsh else F.logsigmoid(x) / 16
    return [t.to(dtype).requires_grad_(grad) for t in (q, k, v, g)]


def sdpa(q, k, v, g):
    return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                          v.transpose(1, 2), is_causal=True)


def chunk_flops(T: int) -> float:
    """Matmul FLOPs of the chunked form: scores, scores @ v, q @ state, state update."""
    return 2.0 * T * H * (CHUNK * K + CHUNK * V + 2 * K * V)


def forward_time(fn, T, dtype, repeats, harsh=False):
    args = inputs(T, dtype, harsh)
    with torch.no_grad():
        return time_fn(lambda: fn(*args), repeats=repeats, warmup=1)


def train_time(fn, T, dtype, repeats):
    args = inputs(T, dtype, grad=True)

    def step():
        out = fn(*args)
        out = out[0] if isinstance(out, tuple) else out
        out.float().sum().backward()
    return time_fn(step, repeats=repeats, warmup=1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="two short lengths only")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--child-default-allocator", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child_default_allocator:
        print(forward_time(chunk_gla, 4096, torch.float32, args.repeats))
        return
    default_alloc = float(subprocess.run(
        [sys.executable, __file__, "--child-default-allocator", "--repeats", str(args.repeats)],
        check=True, capture_output=True, text=True).stdout.split()[-1])
    tune_cpu_allocator()
    lengths = QUICK_LENGTHS if args.quick else LENGTHS
    dtypes = (torch.float32, torch.bfloat16)
    peaks = {dt: matmul_peak_flops(dt, size=1024) for dt in dtypes}

    forward_rows, train_rows, cost_rows = [], [], []
    for dtype in dtypes:
        mm_dtype = matmul_dtype(torch.empty(0, dtype=dtype))
        for T in lengths:
            t_chunk = forward_time(chunk_gla, T, dtype, args.repeats)
            t_naive = forward_time(naive_recurrent_gla, T, dtype, 1)
            t_sdpa = forward_time(sdpa, T, dtype, 1 if T >= 8192 else args.repeats)
            flops = chunk_flops(T) / t_chunk
            forward_rows.append({
                "dtype": str(dtype).removeprefix("torch."), "T": T,
                "chunk_tok_s": T / t_chunk, "naive_tok_s": T / t_naive, "sdpa_tok_s": T / t_sdpa,
                "chunk_vs_naive": t_naive / t_chunk, "chunk_vs_sdpa": t_sdpa / t_chunk,
                "matmul_dtype": str(mm_dtype).removeprefix("torch."),
                "chunk_gflop_s": flops / 1e9, "frac_of_peak": flops / peaks[mm_dtype],
            })
        harsh = forward_time(chunk_gla, 4096, dtype, args.repeats, harsh=True)
        mild = forward_time(chunk_gla, 4096, dtype, args.repeats)
        cost_rows.append({"dtype": str(dtype).removeprefix("torch."), "T": 4096,
                          "what": "harsh gates (hierarchical scores)", "slowdown": harsh / mild})
        if dtype == torch.float32:
            cost_rows.append({"dtype": "float32", "T": 4096, "what": "default glibc allocator",
                              "slowdown": default_alloc / mild})
        for T in lengths:
            t_chunk = train_time(chunk_gla, T, dtype, args.repeats)
            row = {"dtype": str(dtype).removeprefix("torch."), "T": T,
                   "chunk_fwd_bwd_tok_s": T / t_chunk}
            if dtype == torch.float32 or T <= SDPA_BF16_BACKWARD_MAX_T:
                t_sdpa = train_time(sdpa, T, dtype, 1 if T >= 8192 else args.repeats)
                row |= {"sdpa_fwd_bwd_tok_s": T / t_sdpa, "chunk_vs_sdpa": t_sdpa / t_chunk}
            if T <= NAIVE_BACKWARD_MAX_T:
                t_naive = train_time(naive_recurrent_gla, T, dtype, 1)
                row |= {"naive_fwd_bwd_tok_s": T / t_naive, "chunk_vs_naive": t_naive / t_chunk}
            train_rows.append(row)

    print_table("chunk_gla forward (tokens/s; ratios are speedups of chunk_gla)", forward_rows)
    print_table("forward + backward (tokens/s)", train_rows)
    print_table("chunk_gla forward: what costs extra", cost_rows)
    path = write_results("gla_prefill_quick" if args.quick else "gla_prefill", forward_rows,
                         train_rows=train_rows, cost_rows=cost_rows, chunk_size=CHUNK,
                         shape={"B": 1, "H": H, "K": K, "V": V},
                         matmul_peak_gflop_s={str(k): v / 1e9 for k, v in peaks.items()})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
