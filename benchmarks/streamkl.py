"""Streamed attention KL needs a sliver of the materialised form's memory and is no slower.

Causal, B = 1, H = 8, D = 64, per N, dtype and pass (forward; + backward for the student):
seconds and added resident memory of ``chunk_attention_kl`` and ``naive_attention_kl``, each in
a child under a 12 GiB address-space cap (naive fails there instead of taking the machine);
then N = 16384 under a 4 GiB cap. ``--quick``: N = 1024 and 2048.
"""

import itertools
import json
import resource
import statistics
import subprocess
import sys

import torch

from benchmarks.harness import Run
from hyla.ops.streamkl import chunk_attention_kl, naive_attention_kl
from hyla.perf import tune_cpu_allocator

H, D, GIB, CAP_GIB = 8, 64, 2**30, 12
FNS = {"chunk": chunk_attention_kl, "naive": naive_attention_kl}
CHILD = "import sys, benchmarks.streamkl as b; b.child(*sys.argv[1:])"


def step(impl: str, mode: str, dtype: str, N: int):
    gen, grad = torch.Generator().manual_seed(0), mode == "fwd_bwd"
    x = [torch.randn(1, N, H, D, generator=gen).to(getattr(torch, dtype)) for _ in range(4)]
    x[2].requires_grad_(grad), x[3].requires_grad_(grad)    # the student's q and k

    def go() -> None:
        kl = FNS[impl](*x)
        if grad:
            torch.autograd.grad(kl, x[2:])
    return go


def child(cap_gib: str, kind: str, impls: str, mode: str, dtype: str, N: str, repeats="1"):
    """One measurement under an address-space cap, printed as JSON."""
    resource.setrlimit(resource.RLIMIT_AS, (int(float(cap_gib) * GIB),) * 2)
    peak = lambda: 1024 * resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # noqa: E731
    if kind == "memory":
        step(impls, mode, dtype, 64)()      # lazy initialisation off the books
        go, before = step(impls, mode, dtype, int(N)), peak()
        go()
        return print(json.dumps({"extra_bytes": peak() - before}))
    tune_cpu_allocator()
    fns = {impl: step(impl, mode, dtype, int(N)) for impl in impls.split(",")}
    times = Run("streamkl", []).rounds(fns, int(repeats) + 1)   # the first round: warm-up
    print(json.dumps({impl: statistics.median(t[1:]) for impl, t in times.items()}))


def measure(*args, cap_gib: float = CAP_GIB) -> dict:
    out = subprocess.run([sys.executable, "-c", CHILD, str(cap_gib), *map(str, args)],
                         capture_output=True, text=True)
    if out.returncode:
        return {"error": (out.stderr.strip().splitlines() or [f"exit {out.returncode}"])[-1][:160]}
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(run) -> None:
    rows, per_entry = [], {}
    lengths = (1024, 2048) if run.args.quick else (1024, 2048, 4096, 8192, 16384)
    for dtype, mode, N in itertools.product(("float32", "bfloat16"), ("fwd", "fwd_bwd"), lengths):
        run.progress(f"{dtype} {mode} N={N}")
        mem = {impl: measure("memory", impl, mode, dtype, N) for impl in FNS}
        fits = [impl for impl in FNS if "error" not in mem[impl]]
        # apart where one takes over a quarter of the cap (a tuned heap keeps its peak); from
        # N = 8192, one timed run after the warm-up (tens of seconds each)
        apart, sec = any(mem[i]["extra_bytes"] > CAP_GIB * GIB / 4 for i in fits), {}
        for impls in fits if apart else [",".join(fits)]:
            sec |= measure("time", impls, mode, dtype, N, 1 if N >= 8192 else run.args.repeats)
        row = {"dtype": dtype, "mode": mode, "N": N, **{f"{i}_s": sec.get(i) for i in FNS},
               "chunk_speedup": sec["naive"] / sec["chunk"] if "naive" in sec else None,
               **{f"{i}_extra_MiB": mem[i]["extra_bytes"] / 2**20 for i in fits},
               **{f"{k}_error": v["error"] for k, v in {**mem, "time": sec}.items()
                  if "error" in v}}
        if "naive" in fits:
            per_entry[dtype, mode] = row["naive_extra_MiB"] / (H * N * N)
            row["mem_ratio_pct"] = 100 * row.get("chunk_extra_MiB", 0) / row["naive_extra_MiB"]
        elif (dtype, mode) in per_entry:    # memory grows as N^2
            row["naive_needs_GiB_est"] = per_entry[dtype, mode] * H * N * N / 1024
        rows.append(row)
    run.table("StreamKL (causal, B=1, H=8, D=64): chunk vs naive; seconds, extra memory", rows)
    oom = [] if run.args.quick else [{"impl": impl, "N": 16384, "cap_GiB": 4, **measure(
        "memory", impl, "fwd", "float32", 16384, cap_gib=4)} for impl in FNS]
    if oom:
        run.table("N = 16384 under a 4 GiB address-space cap (one fp32 score matrix: 8 GiB)", oom)
    big = [r for r in rows if r["mode"] == "fwd_bwd" and "mem_ratio_pct" in r][-1]
    run.save(rows, oom_rows=oom, cap_GiB=CAP_GIB, summary=f"fwd + bwd at N={big['N']} "
             f"{big['dtype']}: chunk {big['mem_ratio_pct']:.1f}% of naive's memory, "
             f"{big['chunk_speedup'] or float('nan'):.1f}x its speed")
