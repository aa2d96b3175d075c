"""Claim: streamed attention KL (``chunk``) needs a sliver of the materialised form's memory
and is no slower, so long-context attention distillation fits where ``naive`` cannot.

Side by side in one run, causal, B = 1, H = 8, D = 64 on both sides, per length N and dtype:
- forward time and forward + backward time (student gradients, frozen teacher) of
  ``chunk_attention_kl`` and ``naive_attention_kl``, and the speedup of chunk;
- peak extra memory of each (resident memory above the inputs, default glibc allocator);
- at N = 16384, naive and chunk under the same address-space cap (``RLIMIT_AS``): naive's
  score matrices alone exceed it (and this machine's 24 GB), chunk runs.

Every measurement runs in a fresh child process under an address-space cap, so a naive run
that would exhaust the machine fails with an out-of-memory error instead: memory in one child
per implementation (glibc's default allocator, so the high-water mark is the live peak), time
in one child per row with both implementations interleaved (``tune_cpu_allocator()``), so
that load from other processes on a shared machine hits both alike (in separate children
where naive needs over a quarter of the cap: a tuned heap keeps its peak). Naive runs that do not
fit the cap are reported as such, with the bytes they would need extrapolated from the
largest run that fit.

    python benchmarks/streamkl.py            # N = 1024 .. 16384, about 15 minutes
    python benchmarks/streamkl.py --quick    # N = 1024, 2048, under a minute

Writes ``benchmarks/results/streamkl.json`` (``streamkl_quick.json`` with --quick).
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
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


def _inputs(mode: str, dtype: str, N: int):
    gen = torch.Generator().manual_seed(0)
    q_t, k_t, q_s, k_s = (torch.randn(1, N, H, D, generator=gen).to(DTYPES[dtype])
                          for _ in range(4))
    return q_t, k_t, q_s.requires_grad_(mode == "fwd_bwd"), k_s.requires_grad_(mode == "fwd_bwd")


def _step(impl: str, mode: str, inputs):
    fn = FNS[impl]

    def step():
        if mode == "fwd":
            with torch.no_grad():
                return fn(*inputs)
        fn(*inputs).backward()
        inputs[2].grad = inputs[3].grad = None
    return step


def child_memory(impl: str, mode: str, dtype: str, N: int) -> dict:
    """Peak resident memory of one call above the inputs, glibc's default allocator (which
    returns big blocks to the OS at once, so the high-water mark is the live peak)."""
    _step(impl, mode, _inputs(mode, dtype, 64))()   # lazy initialisation off the books
    step = _step(impl, mode, _inputs(mode, dtype, N))
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    step()
    return {"extra_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before}


def child_time(impls: list[str], mode: str, dtype: str, N: int, repeats: int) -> dict:
    """Median seconds of each implementation, runs interleaved so that load from other
    processes on this shared machine hits both alike."""
    tune_cpu_allocator()
    inputs = _inputs(mode, dtype, N)
    times: dict[str, list[float]] = {impl: [] for impl in impls}
    for _ in range(repeats + 1):   # the first round is the warm-up
        for impl in impls:
            times[impl].append(time_fn(_step(impl, mode, inputs), repeats=1, warmup=0))
    return {impl: statistics.median(t[1:]) for impl, t in times.items()}


def measure(*args, cap_gib: float) -> dict:
    """Run a child measurement in a subprocess under an address-space cap."""
    cmd = [sys.executable, __file__, "--cap", str(cap_gib), "--child", *map(str, args)]
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        last = (out.stderr.strip().splitlines() or [f"exit code {out.returncode}"])[-1]
        return {"error": last[:160]}
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="two short lengths only")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    parser.add_argument("--cap", type=float, default=CAP_GIB, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        cap_bytes = int(args.cap * GIB)
        resource.setrlimit(resource.RLIMIT_AS, (cap_bytes, cap_bytes))
        kind, impls, mode, dtype, N, *rest = args.child
        if kind == "memory":
            print(json.dumps(child_memory(impls, mode, dtype, int(N))))
        else:
            print(json.dumps(child_time(impls.split(","), mode, dtype, int(N), int(rest[0]))))
        return

    lengths = QUICK_LENGTHS if args.quick else LENGTHS
    rows, bytes_per_entry = [], {}
    for dtype in DTYPES:
        for mode in ("fwd", "fwd_bwd"):
            for N in lengths:
                mem = {impl: measure("memory", impl, mode, dtype, N, cap_gib=CAP_GIB)
                       for impl in FNS}
                fits = [impl for impl in FNS if "error" not in mem[impl]]
                # Long runs take tens of seconds each: one timed round after the warm-up.
                repeats = 1 if N >= 8192 else args.repeats
                big = any(mem[i].get("extra_bytes", 0) > CAP_GIB * GIB / 4 for i in fits)
                if big:
                    # Two implementations sharing one tuned heap would not fit the cap.
                    sec = {}
                    for impl in fits:
                        sec |= measure("time", impl, mode, dtype, N, repeats, cap_gib=CAP_GIB)
                else:
                    sec = measure("time", ",".join(fits), mode, dtype, N, repeats,
                                  cap_gib=CAP_GIB)
                c, n = mem["chunk"], mem["naive"]
                row = {"dtype": dtype, "mode": mode, "N": N,
                       "chunk_s": sec.get("chunk"), "naive_s": sec.get("naive"),
                       "chunk_speedup": None, "chunk_extra_MiB": c.get("extra_bytes", 0) / 2**20,
                       "naive_extra_MiB": None, "mem_ratio_pct": None,
                       "timed": "apart" if big else "interleaved"}
                for impl, res in [*mem.items(), ("time", sec)]:
                    if "error" in res:
                        row[f"{impl}_error"] = f"over the {CAP_GIB} GiB cap: {res['error']}"
                if "error" in n:
                    # Extrapolate from the largest run that fit: memory grows as N^2.
                    per = bytes_per_entry.get((dtype, mode))
                    if per is not None:
                        row["naive_needs_GiB_est"] = per * H * N * N / GIB
                else:
                    bytes_per_entry[(dtype, mode)] = n["extra_bytes"] / (H * N * N)
                    row["naive_extra_MiB"] = n["extra_bytes"] / 2**20
                    row["mem_ratio_pct"] = 100 * c.get("extra_bytes", 0) / n["extra_bytes"]
                if "chunk" in sec and "naive" in sec:
                    row["chunk_speedup"] = sec["naive"] / sec["chunk"]
                rows.append(row)
                print(json.dumps(row), flush=True)

    oom_rows = []
    if not args.quick:
        N = 16384
        for impl in FNS:
            res = measure("memory", impl, "fwd", "float32", N, cap_gib=OOM_CAP_GIB)
            oom_rows.append({"impl": impl, "N": N, "cap_GiB": OOM_CAP_GIB,
                             "one_score_matrix_GiB": H * N * N * 4 / GIB,
                             "ok": "error" not in res,
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
