"""The chunked gated delta rule beats its token loop and SDPA, within twice chunked GLA's cost.

B = 1, H = 8, K = V = 128, fp32, chunks of 64, per T: forward and forward + backward tokens/s of
``chunk_gated_delta`` (a decay a head; kda: a key channel), ``chunk_gla``, causal SDPA and the
token loop, harsh decays (to -20 a step) at T = 4096; alternating rounds in this process's CPU
time, one thread (wall-clock ratios moved 5x between rounds on the loaded 2-core VM), medians.
``--quick``: T = 512 and 2048, one round.
"""

import statistics
import time
from operator import truediv

import torch
import torch.nn.functional as F

from hyla.ops.deltanet import chunk_gated_delta, naive_recurrent_gated_delta
from hyla.ops.gla import chunk_gla

H, K, CHUNK = 8, 128, 64
FNS = {"delta": lambda q, k, v, g, b: chunk_gated_delta(q, k, v, g, b, chunk_size=CHUNK)[0],
       "gla": lambda q, k, v, g, b: chunk_gla(q, k, v, g, chunk_size=CHUNK)[0],
       "sdpa": lambda q, k, v, g, b: F.scaled_dot_product_attention(
           *(t.transpose(1, 2) for t in (q, k, v)), is_causal=True),
       "naive": lambda q, k, v, g, b: naive_recurrent_gated_delta(q, k, v, g, b)[0]}
FNS["kda"] = FNS["delta"]       # the same op, with a decay a key channel
RATIOS = {"delta_vs_naive": ("naive", "delta"), "delta_vs_sdpa": ("sdpa", "delta"),
          "delta_time_over_gla": ("delta", "gla"), "kda_time_over_gla": ("kda", "gla"),
          "delta_harsh_cost": ("delta_harsh", "delta"), "kda_harsh_cost": ("kda_harsh", "kda")}


def inputs(T: int, per_channel: bool, harsh: bool = False, grad: bool = False):
    gen = torch.Generator().manual_seed(T)
    q, k, v = torch.randn(3, 1, T, H, K, generator=gen)
    k = F.normalize(k, dim=-1)          # the layer feeds L2-normalised keys
    x = torch.randn(1, T, H, *((K,) if per_channel else ()), generator=gen)
    g = F.logsigmoid(5 * x) if harsh else F.logsigmoid(x) / 16
    return [t.requires_grad_(grad) for t in (q, k, v, g, torch.rand(1, T, H, generator=gen))]


def compare(run, T: int, names, train: bool, rounds: int, once_only=()) -> dict:
    """Tokens/s by name and RATIOS: a warm-up (not the loop), alternating rounds, ``once_only``
    once (the slow loop; its backward stops at 2048: 10 s). GLA's gate is per channel: kda's."""
    head, chan = inputs(T, False, grad=train), inputs(T, True, grad=train)
    args = {n: chan if n in ("kda", "gla") else head for n in names} | {
        n: inputs(T, n == "kda_harsh", True) for n in names if "harsh" in n}

    def once(n: str) -> float:
        start = time.process_time()
        out = FNS[n.removesuffix("_harsh")](*args[n])
        if train:   # sdpa has no g or beta
            torch.autograd.grad(out.sum(), args[n], allow_unused=True)
        return time.process_time() - start

    for n in (n for n in names if n != "naive" and rounds > 1):    # warm-up
        once(n)
    t = run.rounds({n: lambda n=n: once(n) for n in names if n not in once_only}, rounds)
    t |= {n: [once(n)] for n in once_only if n in names}
    return {f"{n}_{'fwd_bwd_' * train}tok_s": T / statistics.median(s) for n, s in t.items()} | {
        k: statistics.median(map(truediv, t[a], t[b])) for k, (a, b) in RATIOS.items()
        if a in t and b in t}


def main(run) -> None:
    torch.set_num_threads(run.args.threads or 1)
    rounds, fwd, train = 1 if run.args.quick else run.args.rounds, [], []
    for T in (512, 2048) if run.args.quick else (512, 1024, 2048, 4096, 8192, 16384):
        harsh = ("delta_harsh", "kda_harsh") if T == (2048 if run.args.quick else 4096) else ()
        fwd.append({"T": T, **compare(run, T, ("delta", "kda", "gla", "sdpa", "naive", *harsh),
                                      False, rounds, ("naive",) if T > 4096 else ())})
        train.append({"T": T, **compare(run, T, ("delta", "gla", "sdpa", "naive")[:3 + (T <= 2048)],
                                        True, rounds if T <= 8192 else 1, ("naive",))})
    run.table("chunk_gated_delta forward (tokens/s; speedups of delta; times over GLA's)", fwd)
    run.table("forward + backward (tokens/s)", train)
    at = next((r for r in fwd if r["T"] == 4096), fwd[-1])
    run.save(fwd, train_rows=train, chunk_size=CHUNK, clock="process CPU time",
             summary=f"forward at T={at['T']}: {at['delta_vs_naive']:.1f}x the loop, "
                     f"{at['delta_vs_sdpa']:.1f}x SDPA, {at['delta_time_over_gla']:.2f}x GLA's")
