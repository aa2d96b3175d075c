"""Claim: streamed attention KL (``chunk``) needs a sliver of the materialised form's memory
and is no slower, so long-context attention distillation fits where ``naive`` cannot.

Side by side in one run, causal, B = 1, H = 8, D = 64 on both sides, per length N and dtype:
- forward time and forward + backward time (student gradients, frozen teacher) of
  ``chunk_attention_kl`` and ``naive_attention_kl``, and the speedup of chunk;
- peak extra memory of each (resident memory above the inputs, default glibc allocator);
- at N = 16384, naive and chunk under the same address-space cap (``RLIMIT_AS``): naive's
  score matrices alone exceed it (and this machine's 24 GB), chunk runs.

Every measurement runs in a fresh child process with an address-space cap (so a naive run
that would exhaust the machine fails with an out-of-memory error instead), first once for
memory, then timed with ``tune_cpu_allocator()``. Naive runs that cannot fit the cap are
reported as such, with the bytes they would need extrapolated from the largest run that fit.

    python benchmarks/streamkl.py            # N = 1024 .. 16384, about 15 minutes
    python benchmarks/streamkl.py --quick    # N = 1024, 2048, under a minute

Writes ``benchmarks/results/streamkl.json`` (``streamkl_quick.json`` with --quick).
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys

import torch

from hyla.ops.streamkl import chunk_attention_kl, naive_attention_kl
from hyla.perf import print_table, time_fn, tune_cpu_allocator, write_results

H, D = 8, 64
LENGTHS = (1024, 2048, 4096, 8192, 16384)
QUICK_LENGTHS = (1024, 2048)
CAP_GIB = 12             # address-space cap of every child: well inside this 24 GB machine
OOM_CAP_GIB = 4          # the cap of the out-of-memory demonstration at N = 16384
FNS = {"chunk": chunk_attention_kl, "naive": naive_attention_kl}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
GIB = 2**30


def child(impl: str, mode: str, dtype: str, N: int, repeats: int) -> dict:
    """One measurement, in this (fresh) process: peak extra memory, then median seconds."""
    fn = FNS[impl]
    gen = torch.Generator().manual_seed(0)
    q_t, k_t, q_s, k_s = (torch.randn(1, N, H, D, generator=gen).to(DTYPES[dtype])
                          for _ in range(4))
    q_s.requires_grad_(mode == "fwd_bwd")
    k_s.requires_grad_(mode == "fwd_bwd")

    def step():
        if mode == "fwd":
            with torch.no_grad():
                return fn(q_t, k_t, q_s, k_s)
        fn(q_t, k_t, q_s, k_s).backward()
        q_s.grad = k_s.grad = None

    small = [x[:, :64].detach().requires_grad_(x.requires_grad) for x in (q_t, k_t, q_s, k_s)]
    fn(*small).sum().backward() if mode == "fwd_bwd" else fn(*small)   # lazy init off the books
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    step()
    extra = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
    tune_cpu_allocator()
    # The memory run was the warm-up; long runs are timed once (they take tens of seconds).
    seconds = time_fn(step, repeats=1 if N >= 8192 else repeats, warmup=0)
    return {"extra_bytes": extra, "seconds": seconds}


def measure(impl: str, mode: str, dtype: str, N: int, repeats: int, cap_gib: float) -> dict:
    """Run :func:`child` in a subprocess under an address-space cap; {"error": ...} on OOM."""
    cmd = [sys.executable, __file__, "--child", impl, mode, dtype, str(N), str(repeats),
           str(cap_gib)]
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        last = (out.stderr.strip().splitlines() or [f"exit code {out.returncode}"])[-1]
        return {"error": last[:160]}
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="two short lengths only")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--child", nargs=6, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        impl, mode, dtype, N, repeats, cap = args.child
        cap_bytes = int(float(cap) * GIB)
        resource.setrlimit(resource.RLIMIT_AS, (cap_bytes, cap_bytes))
        print(json.dumps(child(impl, mode, dtype, int(N), int(repeats))))
        return

    lengths = QUICK_LENGTHS if args.quick else LENGTHS
    rows, bytes_per_entry = [], {}
    for dtype in DTYPES:
        for mode in ("fwd", "fwd_bwd"):
            for N in lengths:
                res = {impl: measure(impl, mode, dtype, N, args.repeats, CAP_GIB)
                       for impl in FNS}
                c, n = res["chunk"], res["naive"]
                row = {"dtype": dtype, "mode": mode, "N": N,
                       "chunk_s": c.get("seconds"), "naive_s": n.get("seconds"),
                       "chunk_speedup": None, "chunk_extra_MiB": c.get("extra_bytes", 0) / 2**20,
                       "naive_extra_MiB": None, "mem_ratio_pct": None}
                if "error" in c:
                    row["chunk_error"] = c["error"]
                if "error" in n:
                    # Extrapolate from the largest run that fit: memory grows as N^2.
                    per = bytes_per_entry.get((dtype, mode))
                    row["naive_error"] = f"over {CAP_GIB} GiB cap: {n['error']}"
                    if per is not None:
                        row["naive_needs_GiB_est"] = per * H * N * N / GIB
                else:
                    bytes_per_entry[(dtype, mode)] = n["extra_bytes"] / (H * N * N)
                    row["naive_extra_MiB"] = n["extra_bytes"] / 2**20
                    row["mem_ratio_pct"] = 100 * c.get("extra_bytes", 0) / n["extra_bytes"]
                    if "seconds" in c:
                        row["chunk_speedup"] = n["seconds"] / c["seconds"]
                rows.append(row)
                print(json.dumps(row), flush=True)

    oom_rows = []
    if not args.quick:
        N = 16384
        for impl in FNS:
            res = measure(impl, "fwd", "float32", N, 1, OOM_CAP_GIB)
            oom_rows.append({"impl": impl, "N": N, "cap_GiB": OOM_CAP_GIB,
                             "score_matrix_GiB": H * N * N * 4 / GIB,
                             "ok": "error" not in res, "seconds": res.get("seconds"),
                             "extra_MiB": res["extra_bytes"] / 2**20 if "error" not in res
                             else None, "error": res.get("error", "")})

    table = [{k: v for k, v in r.items() if v is not None} for r in rows]
    print_table("StreamKL (causal, B=1, H=8, D=64): chunk vs naive; seconds, extra memory",
                table)
    if oom_rows:
        print_table(f"N = 16384 under a {OOM_CAP_GIB} GiB address-space cap", oom_rows)
    path = write_results("streamkl_quick" if args.quick else "streamkl", rows,
                         oom_rows=oom_rows, shape={"B": 1, "H": H, "D": D, "causal": True},
                         cap_GiB=CAP_GIB,
                         tiles={"block_q": 256, "block_k": 512})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
