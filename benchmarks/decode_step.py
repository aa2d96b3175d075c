"""Claim: a GLA layer's per-token decode cost is flat in context; attention's grows with it.

One GLA layer (``hyla.ops.gla.recurrent_gla``, in place on an fp32 ``[B, H, K, V]`` state)
against one softmax-attention layer decoding against a KV cache of N tokens (the new key and
value are written at position N, then the query attends to all N + 1), side by side in one
run, per context length and dtype. Attention is timed twice: plain SDPA on a ``[B, H, T, D]``
cache (the best case) and hyla's ``attention_with_cache``. Only the token-mixing op is timed
(no projections, no MLP): those cost the same in both layer kinds.

    python benchmarks/decode_step.py            # 1K .. 32K tokens
    python benchmarks/decode_step.py --quick    # a few seconds

Writes ``benchmarks/results/decode_step.json`` (``decode_step_quick.json`` with --quick).
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.nn.functional as F

from hyla.ops.gla import recurrent_gla
from hyla.perf import print_table, time_fn, tune_cpu_allocator, write_results

CONTEXTS = (1024, 2048, 4096, 8192, 16384, 32768)
QUICK_CONTEXTS = (1024, 4096)


def gla_step(B: int, H: int, K: int, V: int, dtype: torch.dtype):
    """A closure doing one GLA decode step on a persistent state."""
    state = torch.zeros(B, H, K, V)  # fp32 whatever the input dtype, as the model keeps it
    q, k = torch.randn(2, B, 1, H, K).to(dtype)
    v = torch.randn(B, 1, H, V).to(dtype)
    g = F.logsigmoid(torch.randn(B, 1, H, K)).div(16).to(dtype)

    def step():
        recurrent_gla(q, k, v, g, initial_state=state, output_final_state=True)
    return step, state.nbytes


def attention_step(B: int, H: int, D: int, n: int, dtype: torch.dtype):
    """A closure appending one token to a KV cache of ``n`` tokens and attending over it.

    The cache is ``[B, H, capacity, D]``, the layout SDPA reads without a copy, so the
    baseline is as fast as plain PyTorch allows.
    """
    k_cache = torch.randn(B, H, n + 1, D).to(dtype)
    v_cache = torch.randn(B, H, n + 1, D).to(dtype)
    q, k, v = torch.randn(3, B, H, 1, D).to(dtype)

    def step():
        k_cache[:, :, n:n + 1] = k
        v_cache[:, :, n:n + 1] = v
        F.scaled_dot_product_attention(q, k_cache, v_cache)
    return step, 2 * B * H * n * D * k_cache.element_size()


def hyla_attention_step(B: int, H: int, D: int, n: int, dtype: torch.dtype):
    """As :func:`attention_step`, through ``hyla.ops.attention.attention_with_cache``.

    That op takes a right-padded ``[B, S, H, D]`` cache and per-sequence lengths (a batch of
    sequences of different lengths), so it pays for a mask the single-sequence SDPA call avoids.
    """
    from hyla.ops.attention import attention_with_cache

    k_cache = torch.randn(B, n + 1, H, D).to(dtype)
    v_cache = torch.randn(B, n + 1, H, D).to(dtype)
    q, k, v = torch.randn(3, B, 1, H, D).to(dtype)
    lens = torch.full((B,), n + 1)

    def step():
        k_cache[:, n:n + 1] = k
        v_cache[:, n:n + 1] = v
        attention_with_cache(q, k_cache, v_cache, lens)
    return step


def _interleaved(fns: dict, *, repeats: int, inner: int) -> dict:
    """Median seconds per call of each fn, samples interleaved so that load from other
    processes hits all of them alike (the figures that matter are ratios)."""
    samples: dict = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            # One decode step is microseconds: time `inner` of them per sample.
            samples[name].append(time_fn(lambda fn=fn: [fn() for _ in range(inner)],
                                         repeats=1, warmup=0) / inner)
    return {name: statistics.median(ts) for name, ts in samples.items()}


def run(contexts, dtypes, *, B: int, H: int, D: int, repeats: int, inner: int) -> list[dict]:
    rows = []
    for dtype in dtypes:
        name = str(dtype).removeprefix("torch.")
        for n in contexts:
            gla, gla_bytes = gla_step(B, H, D, D, dtype)
            sdpa, kv_bytes = attention_step(B, H, D, n, dtype)
            fns = {"gla": gla, "sdpa": sdpa, "hyla": hyla_attention_step(B, H, D, n, dtype)}
            for fn in fns.values():  # warm-up
                fn()
            t = _interleaved(fns, repeats=repeats, inner=inner)
            rows.append({"dtype": name, "context": n, "gla_us": t["gla"] * 1e6,
                         "attn_sdpa_us": t["sdpa"] * 1e6,
                         "attn_hyla_us": t["hyla"] * 1e6,
                         "ratio_sdpa_over_gla": t["sdpa"] / t["gla"],
                         "ratio_hyla_over_gla": t["hyla"] / t["gla"],
                         "gla_state_MB": gla_bytes / 1e6, "kv_cache_MB": kv_bytes / 1e6})
            del fns, sdpa
    return rows


def main(argv=None) -> None:
    tune_cpu_allocator()
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="two contexts, fewer repeats")
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--batch", type=int, default=1)
    # B=1 decode is latency bound; one thread keeps timings stable on a shared machine, where
    # spinning OpenMP workers competing with other processes cost milliseconds per step.
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    contexts = QUICK_CONTEXTS if args.quick else CONTEXTS
    repeats, inner = (3, 10) if args.quick else (7, 20)
    dtypes = (torch.float32, torch.bfloat16)
    with torch.inference_mode():
        rows = run(contexts, dtypes, B=args.batch, H=args.heads, D=args.head_dim,
                   repeats=repeats, inner=inner)
    print_table(f"Decode step, one layer, B={args.batch} H={args.heads} K=V={args.head_dim} "
                f"(microseconds per token)", rows)
    path = write_results("decode_step_quick" if args.quick else "decode_step", rows,
                         params={"B": args.batch, "H": args.heads, "K": args.head_dim,
                                 "V": args.head_dim, "repeats": repeats, "inner": inner,
                                 "attn_sdpa": "F.scaled_dot_product_attention, cache "
                                              "[B, H, T, D], no mask",
                                 "attn_hyla": "hyla.ops.attention.attention_with_cache, "
                                              "cache [B, T, H, D] + kv_lens",
                                 "gla": "hyla.ops.gla.recurrent_gla, in place"})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
