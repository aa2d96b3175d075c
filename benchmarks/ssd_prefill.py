"""The chunked Mamba-2 SSD form runs 8.7-11x its token loop at 4K tokens, and beats causal SDPA.

Granite-4.0-H-350M's SSM layer shape (48 heads of 32 channels, state 128, one group of B/C)
and a Qwen3.5-0.8B-like one (16 heads of 128, state 128, 16 groups: one a head), one thread,
float32: forward seconds of ``chunk_ssd``, of the token loop ``naive_ssd`` (timed on a prefix
of 512 tokens and scaled, its cost being linear in T) and of causal SDPA with the same heads
and head dims, in alternating rounds. ``--quick``: T = 1024 only.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hyla.ops.ssd import chunk_ssd, naive_ssd

SHAPES = {"granite-4.0-h-350m": (48, 32, 128, 1), "qwen3.5-0.8b-like": (16, 128, 128, 16)}
LOOP_T = 512


def inputs(T, H, P, N, G):
    g = torch.Generator().manual_seed(0)
    return (torch.randn(1, T, H, P, generator=g), F.softplus(torch.randn(1, T, H, generator=g)),
            -torch.rand(H, generator=g), torch.randn(1, T, G, N, generator=g),
            torch.randn(1, T, G, N, generator=g), torch.ones(H))


def main(run) -> None:
    torch.set_num_threads(run.args.threads or 1)
    rows = []
    for name, (H, P, N, G) in SHAPES.items():
        for T in (1024,) if run.args.quick else (1024, 4096, 16384):
            args = inputs(T, H, P, N, G)
            short = [a[:, :LOOP_T] if a.dim() > 1 else a for a in args]
            q = args[4].repeat_interleave(H // G, 2)          # C as queries, B as keys, x values
            k = args[3].repeat_interleave(H // G, 2)
            cases = {   # None: the harness times a case that returns nothing
                "chunk": lambda a=args: chunk_ssd(*a) and None,
                "loop": lambda a=short: naive_ssd(*a) and None,
                "sdpa": lambda q=q, k=k, v=args[0]: F.scaled_dot_product_attention(
                    q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                    is_causal=True).sum() and None}
            if T > 4096:    # value and key head dims differ: SDPA's math path, T^2 memory
                del cases["sdpa"]                                   # (51 GB at 16K)
            with torch.no_grad():
                t = run.side_by_side(cases)
            t.setdefault("sdpa", {"median": float("nan")})
            loop = t["loop"]["median"] * T / LOOP_T
            rows.append({"shape": name, "T": T, "chunk_s": t["chunk"]["median"],
                         "loop_s (scaled)": loop, "sdpa_s": t["sdpa"]["median"],
                         "chunk_vs_loop": loop / t["chunk"]["median"],
                         "chunk_vs_sdpa": t["sdpa"]["median"] / t["chunk"]["median"]})
            run.progress(f"{name} T={T}: {rows[-1]['chunk_vs_loop']:.1f}x the loop")
    run.table("Mamba-2 SSD forward, one thread, float32 (ratios: chunk's speed-up)", rows)
    at = [r for r in rows if r["T"] == (1024 if run.args.quick else 4096)]
    run.save(rows, summary="chunk_ssd at T=" + str(at[0]["T"]) + ": " + ", ".join(
        f"{r['shape']} {r['chunk_vs_loop']:.1f}x the token loop, {r['chunk_vs_sdpa']:.1f}x "
        f"SDPA" for r in at))
