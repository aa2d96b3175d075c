"""GLA-only decode keeps its tokens/s at any prompt length; with attention it slows as KV grows.

The Runner (eager, fp32) decodes 4 sequences holding 1K, 2K, 8K, 32K tokens of random state and
KV, ``small``-width GGGGGGGG, GGGAGGGA, AAAAAAAA, the contexts taking turns step by step
(medians of ``--steps``); a plot beside the results. ``--quick``: 1K and 8K, 3 steps.
"""

import statistics
import time

import matplotlib
import torch

from benchmarks.serve_common import hyla_model
from hyla.serve.runner import Runner

LAYERS = {"GLA only": "GGGGGGGG", "hybrid 3:1": "GGGAGGGA", "all attention": "AAAAAAAA"}
BATCH, BLOCK = 4, 64


def add_args(parser) -> None:
    parser.add_argument("--steps", type=int, default=15, help="timed steps a context (median)")


def step_times(model, contexts, steps: int) -> dict:
    # decode cost depends on the state's size, not what it holds: random values stand in for
    # 32K-token prefills; one runner, contexts interleaved, so drift hits every context alike
    per_seq = -(-(max(contexts) + 2) // BLOCK)
    attn = any(spec.per_token for spec in model.state_specs)     # a KV cache to page
    r = Runner(model, max_num_seqs=BATCH, num_kv_blocks=BATCH * per_seq if attn else 0,
               block_size=BLOCK)
    for buf in (b for layer in r.buffers for b in layer.values()):
        buf.normal_()
    full = [list(range(b * per_seq, (b + 1) * per_seq)) if attn else [] for b in range(BATCH)]
    times: dict[int, list[float]] = {c: [] for c in contexts}
    for i in range(steps + 1):
        for ctx in contexts:
            n, t0 = -(-(ctx + 1) // BLOCK) if attn else 0, time.perf_counter()
            r.decode(list(range(BATCH)), [1] * BATCH, [ctx] * BATCH, [t[:n] for t in full], BATCH)
            if i:                                   # the first round warms up
                times[ctx].append(time.perf_counter() - t0)
    return {c: statistics.median(ts) for c, ts in times.items()}


def main(run) -> None:
    torch.set_num_threads(run.args.threads or 1)
    contexts = (1024, 8192) if run.args.quick else (1024, 2048, 8192, 32768)
    tok_s = {}
    for name, layers in LAYERS.items():
        run.progress(name)
        for ctx, t in step_times(hyla_model("small", layers), contexts,
                                 3 if run.args.quick else run.args.steps).items():
            tok_s[name, ctx] = BATCH / t
    rows = [{"model": m, "context": c, "step_ms": 1e3 * BATCH / tok_s[m, c], "tok_s": tok_s[m, c]}
            for c in contexts for m in LAYERS]
    flat = [{"model": m, **{f"tok_s_{c}": v for c, v in zip(contexts, got, strict=True)},
             "spread_pct": 100 * (max(got) / min(got) - 1)} | (
                {"cost_8k_vs_2k_pct": 100 * (tok_s[m, 2048] / tok_s[m, 8192] - 1)}
                if 2048 in contexts else {}) for m in LAYERS
            for got in [[tok_s[m, c] for c in contexts]]]
    run.table(f"decode tokens/s, batch {BATCH}, by context (small-preset width)", rows)
    run.table("flatness: spread across contexts, cost per token 8K vs 2K", flat)
    path = run.save(rows, flatness=flat, batch=BATCH, note="random states/KV, eager, fp32",
                    summary=f"tok/s from {contexts[0]} to {contexts[-1]} tokens: " + "; ".join(
                        f"{m} " + ", ".join(f"{tok_s[m, c]:.3g}" for c in contexts)
                        for m in LAYERS) + f" (GLA only within {flat[0]['spread_pct']:.1f}%)")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for m in LAYERS:
        ax.plot(contexts, [tok_s[m, c] for c in contexts], marker="o", label=m)
    ax.set_xscale("log", base=2)
    ax.set(xlabel="tokens in the state (prompt length)", ylim=(0, None), ylabel=f"decode "
           f"tokens/s (batch {BATCH})", title="Decode speed vs context, small width, this CPU")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path.with_suffix(".png"), dpi=120)
