"""Claim: a GLA-only model decodes at the same tokens/s whatever the prompt length; the
hybrid's and the all-attention model's decode slows as their KV caches grow.

The engine's Runner decodes a batch of B sequences whose state holds L tokens, for L in
1K, 2K, 8K, 32K, for three layer mixes of the ``small`` preset's width and depth:
``GGGGGGGG`` (GLA only), ``GGGAGGGA`` (the preset's hybrid) and ``AAAAAAAA``. Decode cost
does not depend on what the state holds, only on its size, so states and KV blocks are
filled with random values instead of prefilling 32K-token prompts (which would take this
CPU minutes per attention model). Each point: median step time of several steps, all
models measured side by side in one run. Also reports the cost per output token at 8K
relative to 2K (the reference deployment saw +0.5% for its GLA model). Per model, one
runner holds the longest context and the contexts take turns step by step (medians of
``--steps``), so drift on a shared machine does not masquerade as a context effect.

    python benchmarks/serve_decode_flat.py [--quick]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

sys.path.insert(0, str(__import__("pathlib").Path(__file__).parent))
from serve_common import hyla_model  # noqa: E402

from hyla.perf import print_table, tune_cpu_allocator, write_results  # noqa: E402
from hyla.serve.runner import Runner  # noqa: E402

LAYERS = {"GLA only": "GGGGGGGG", "hybrid 3:1": "GGGAGGGA", "all attention": "AAAAAAAA"}


def step_times(model, batch: int, contexts, steps: int, block_size: int = 64) -> dict:
    """Median decode step seconds per context, contexts interleaved step by step on one
    runner (so allocation and drift hit every context alike)."""
    per_seq = -(-(max(contexts) + 2) // block_size)
    attn = any(spec.per_token for spec in model.state_specs)     # a KV cache to page
    r = Runner(model, max_num_seqs=batch, num_kv_blocks=batch * per_seq if attn else 0,
               block_size=block_size)
    for layer in r.buffers:
        for buf in layer.values():
            buf.normal_()
    full = [list(range(b * per_seq, (b + 1) * per_seq)) if attn else [] for b in range(batch)]
    times: dict[int, list[float]] = {c: [] for c in contexts}
    for i in range(steps + 1):
        for ctx in contexts:
            n = -(-(ctx + 1) // block_size) if attn else 0
            t0 = time.perf_counter()
            r.decode(list(range(batch)), [1] * batch, [ctx] * batch,
                     [t[:n] for t in full], batch)
            if i:                                   # the first round warms up
                times[ctx].append(time.perf_counter() - t0)
    return {c: statistics.median(ts) for c, ts in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=1,
                    help="torch CPU threads (1: on this 2-vCPU VM a second intra-op thread "
                         "makes the small ops of a decode step 2-5x slower)")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=15)
    args = ap.parse_args()
    tune_cpu_allocator()
    torch.set_num_threads(args.threads)
    contexts = (1024, 8192) if args.quick else (1024, 2048, 8192, 32768)
    steps = 3 if args.quick else args.steps
    models = {name: hyla_model("small", layers) for name, layers in LAYERS.items()}
    times = {}
    for name, model in models.items():
        for ctx, t in step_times(model, args.batch, contexts, steps).items():
            times[(name, ctx)] = t
        print(f"{name} done", flush=True)
    rows = []
    for ctx in contexts:
        for name in models:
            t = times[(name, ctx)]
            rows.append({"model": name, "context": ctx, "step_ms": t * 1e3,
                         "tok_s": args.batch / t})
    by = {(r["model"], r["context"]): r["tok_s"] for r in rows}
    summary = []
    for name in models:
        first, last = by[(name, contexts[0])], by[(name, contexts[-1])]
        row = {"model": name, f"tok_s_{contexts[0]}": first, f"tok_s_{contexts[-1]}": last,
               "spread_pct": 100 * (max(by[(name, c)] for c in contexts)
                                    / min(by[(name, c)] for c in contexts) - 1)}
        if (name, 2048) in by and (name, 8192) in by:
            row["cost_8k_vs_2k_pct"] = 100 * (by[(name, 2048)] / by[(name, 8192)] - 1)
        summary.append(row)
    print_table(f"decode tokens/s, batch {args.batch}, by context (small-preset width)", rows)
    print_table("flatness: spread across contexts, cost per token 8K vs 2K", summary)
    path = write_results("serve_decode_flat_quick" if args.quick else "serve_decode_flat",
                         rows, summary=summary, batch=args.batch, steps=steps,
                         note="states/KV filled with random values; Runner.decode, eager, fp32")
    print(f"wrote {path}")
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 4))
        for name in models:
            ax.plot(contexts, [by[(name, c)] for c in contexts], marker="o", label=name)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("tokens in the state (prompt length)")
        ax.set_ylabel(f"decode tokens/s (batch {args.batch})")
        ax.set_ylim(bottom=0)
        ax.legend()
        ax.set_title("Decode speed vs context, small-preset width, this CPU")
        fig.tight_layout()
        fig.savefig(path.with_suffix(".png"), dpi=120)
    except ImportError:
        pass


if __name__ == "__main__":
    main()
