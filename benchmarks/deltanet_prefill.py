"""Claim: the chunked gated delta rule (WY form, native PyTorch) beats its token loop and causal
softmax attention, at no more than twice the cost of chunked GLA.

Side by side in one run, per sequence length T (B = 1, H = 8, K = V = 128, fp32, chunks of
64): ``chunk_gated_delta`` with one decay a head (Gated DeltaNet) and with one a key channel
(KDA), ``chunk_gla``, causal SDPA with the same heads and head dims, and the token loop
``naive_recurrent_gated_delta``. Each round times every contender once, in turn; figures are
medians over rounds, and each ratio is the median of the per-round ratios. Forward (prefill)
and forward + backward (training; the per-channel variant forward only). Also the cost of
harsh decays (down to about -20 a step) at T = 4096.

The clock is the process's CPU time with one torch thread (``--clock wall`` for wall time):
the development VM is shared, and at a load average of 10 on its 2 cores wall-clock ratios
moved by 5x between rounds, while CPU time counts only this process's own work.

    python benchmarks/deltanet_prefill.py            # T = 512 .. 16384, ~7 CPU-minutes
    python benchmarks/deltanet_prefill.py --quick    # T = 512, 2048, one round

Writes ``benchmarks/results/deltanet_prefill.json`` (``deltanet_prefill_quick.json``).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from hyla.ops.deltanet import chunk_gated_delta, naive_recurrent_gated_delta
from hyla.ops.gla import chunk_gla
from hyla.perf import print_table, tune_cpu_allocator, write_results

H, K, V, CHUNK = 8, 128, 128, 64
LENGTHS = (512, 1024, 2048, 4096, 8192, 16384)
QUICK_LENGTHS = (512, 2048)
NAIVE_BACKWARD_MAX_T = 2048     # the loop's backward: ~10 s at 2048, enough to show the gap
NAIVE_ROUNDS_MAX_T = 4096       # beyond this the loop (tens of seconds) runs one round only
TRAIN_ROUNDS_MAX_T = 8192       # forward + backward beyond this: one round
CLOCK = {"cpu": time.process_time, "wall": time.perf_counter}
clock = time.process_time


def inputs(T: int, *, per_channel: bool = False, harsh: bool = False, grad: bool = False):
    gen = torch.Generator().manual_seed(T)
    q, k, v = torch.randn(3, 1, T, H, K, generator=gen)
    k = F.normalize(k, dim=-1)          # the layer feeds L2-normalised keys
    x = torch.randn(1, T, H, *((K,) if per_channel else ()), generator=gen)
    g = F.logsigmoid(5 * x) if harsh else F.logsigmoid(x) / 16
    beta = torch.rand(1, T, H, generator=gen)
    return [t.requires_grad_(grad) for t in (q, k, v, g, beta)]


def delta(q, k, v, g, beta):
    return chunk_gated_delta(q, k, v, g, beta, chunk_size=CHUNK)[0]


def naive(q, k, v, g, beta):
    return naive_recurrent_gated_delta(q, k, v, g, beta)[0]


def gla(q, k, v, g, beta):
    # GLA's gate is per key channel: give it the KDA-shaped one (same shape of work)
    return chunk_gla(q, k, v, g if g.dim() == 4 else g[..., None].expand_as(k),
                     chunk_size=CHUNK)[0]


def sdpa(q, k, v, g, beta):
    return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                          v.transpose(1, 2), is_causal=True)


def once(fn, args, train: bool) -> float:
    start = clock()
    if train:
        fn(*args).sum().backward()
        for a in args:
            a.grad = None
    else:
        with torch.no_grad():
            fn(*args)
    return clock() - start


def side_by_side(contenders: dict, rounds: int, train: bool, only_first: set[str] = frozenset()
                 ) -> dict[str, list[float]]:
    """{name: (fn, args)} -> {name: [seconds per round]}; a warm-up run each first (unless a
    single round). Names in ``only_first`` run in the first round only (too slow to repeat)."""
    for fn, args in contenders.values():
        if fn is not naive and rounds > 1:
            once(fn, args, train)
    times: dict[str, list[float]] = {name: [] for name in contenders}
    for r in range(rounds):
        names = list(contenders)
        names = names[r % len(names):] + names[:r % len(names)]  # rotate the order
        for name in names:
            if r and name in only_first:
                continue
            fn, args = contenders[name]
            times[name].append(once(fn, args, train))
    return times


def ratio(times: dict, slow: str, fast: str) -> float:
    """Median over rounds of slow / fast (rounds where both ran)."""
    pairs = list(zip(times[slow], times[fast], strict=False))
    return statistics.median(a / b for a, b in pairs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="two short lengths, one round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument("--clock", choices=sorted(CLOCK), default="cpu")
    args = parser.parse_args()
    global clock
    clock = CLOCK[args.clock]
    torch.set_num_threads(args.threads)
    tune_cpu_allocator()
    lengths = QUICK_LENGTHS if args.quick else LENGTHS
    rounds = 1 if args.quick else args.rounds

    forward_rows, train_rows, cost_rows = [], [], []
    for T in lengths:
        head, chan = inputs(T), inputs(T, per_channel=True)
        contenders = {"delta": (delta, head), "kda": (delta, chan), "gla": (gla, chan),
                      "sdpa": (sdpa, head), "naive": (naive, head)}
        slow = {"naive"} if T > NAIVE_ROUNDS_MAX_T else set()
        t = side_by_side(contenders, rounds, train=False, only_first=slow)
        med = {n: statistics.median(x) for n, x in t.items()}
        forward_rows.append({
            "T": T, "delta_tok_s": T / med["delta"], "kda_tok_s": T / med["kda"],
            "gla_tok_s": T / med["gla"], "sdpa_tok_s": T / med["sdpa"],
            "naive_tok_s": T / med["naive"],
            "delta_vs_naive": ratio(t, "naive", "delta"),
            "delta_vs_sdpa": ratio(t, "sdpa", "delta"),
            "delta_time_over_gla": ratio(t, "delta", "gla"),
            "kda_time_over_gla": ratio(t, "kda", "gla"), "rounds": rounds,
        })
        print(forward_rows[-1], flush=True)

    for T in lengths:
        head, chan = inputs(T, grad=True), inputs(T, per_channel=True, grad=True)
        contenders = {"delta": (delta, head), "gla": (gla, chan), "sdpa": (sdpa, head)}
        if T <= NAIVE_BACKWARD_MAX_T:
            contenders["naive"] = (naive, head)
        t = side_by_side(contenders, rounds if T <= TRAIN_ROUNDS_MAX_T else 1, train=True,
                         only_first={"naive"})
        med = {n: statistics.median(x) for n, x in t.items()}
        row = {"T": T, "delta_fwd_bwd_tok_s": T / med["delta"],
               "gla_fwd_bwd_tok_s": T / med["gla"], "sdpa_fwd_bwd_tok_s": T / med["sdpa"],
               "delta_vs_sdpa": ratio(t, "sdpa", "delta"),
               "delta_time_over_gla": ratio(t, "delta", "gla")}
        if "naive" in t:
            row |= {"naive_fwd_bwd_tok_s": T / med["naive"],
                    "delta_vs_naive": ratio(t, "naive", "delta")}
        train_rows.append(row)
        print(row, flush=True)

    T = 4096 if not args.quick else 2048
    for per_channel, label in ((False, "delta (per head)"), (True, "kda (per channel)")):
        contenders = {"mild": (delta, inputs(T, per_channel=per_channel)),
                      "harsh": (delta, inputs(T, per_channel=per_channel, harsh=True))}
        t = side_by_side(contenders, rounds, train=False)
        cost_rows.append({"T": T, "what": f"harsh decays, {label}",
                          "slowdown": ratio(t, "harsh", "mild")})

    print_table("chunk_gated_delta forward (tokens/s; ratios: speedups of delta, or time "
                "over chunk_gla's)", forward_rows)
    print_table("forward + backward (tokens/s)", train_rows)
    print_table("chunk_gated_delta forward: what costs extra", cost_rows)
    path = write_results("deltanet_prefill_quick" if args.quick else "deltanet_prefill",
                         forward_rows, train_rows=train_rows, cost_rows=cost_rows,
                         chunk_size=CHUNK, dtype="float32", clock=args.clock,
                         threads=args.threads,
                         shape={"B": 1, "H": H, "K": K, "V": V},
                         targets={"delta_vs_naive at 4096": ">= 10",
                                  "delta_vs_sdpa at 8192": ">= 1.5",
                                  "delta_time_over_gla": "<= 2"})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
