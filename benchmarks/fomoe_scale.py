"""System model (issue 28, FoMoE): communication time and step time of ``fsdp``, ``diloco``
and ``fomoe`` for 1B to 100B-parameter MoE models over inter-site links of 1 to 100 Gbps.

No training runs: arithmetic on stated assumptions, so the figures are projections.

Model shape (``--shape``, both by default). A model of ``N`` parameters has a shared part
``N_s = f_s N`` (embeddings, mixers/attention, routers, shared experts: on every worker) and
``N_e = (1 - f_s) N`` in ``E`` routed experts a layer, ``k`` active a token, so
``N_active = N_s + N_e k / E``:

- ``hyla``: hyla's ``small-moe`` proportions (``f_s`` = 0.364, measured: 14.2 M of 39.0 M
  parameters; E = 8, top-2);
- ``fine``: a fine-grained MoE (``f_s`` = 0.15, E = 64, top-4), DeepSeek/Qwen-like.

Workers (sites): ``W`` (default 8), each computing ``--tokens`` (default 2^20) tokens a step at
``--flops`` effective FLOP/s (default 8 x 989 TFLOP/s dense bf16 H100 x 40% MFU = 3.16e15),
compute ``6 N_active tokens / flops``. Bytes on the wire are ``--bytes-per-param`` (2: bf16)
a value, ring collectives (a rank sends ``2 (n - 1)/n`` of the tensor in an all-reduce over
``n`` ranks, ``(n - 1)/n`` in a reduce-scatter or an all-gather), each collective costing
``2 (n - 1) alpha`` latency on top (``--latency``, default 10 ms a hop between sites).
Strategies, bytes a worker sends a step:

- ``fsdp`` (DDP has the same bytes): a reduce-scatter of gradients + an all-gather of
  parameters of all ``N`` every step: ``2 (W-1)/W N b``;
- ``diloco``: an all-reduce of all ``N`` every ``H`` steps: ``2 (W-1)/W N b / H``;
- ``fomoe``: every ``H`` steps, the shared ``N_s`` all-reduced over ``W``, and each of the
  worker's ``E R / W`` experts over its ``R`` holders: ``[2 (W-1)/W N_s + 2 (R-1)/R N_e R/W] b
  / H``. With token skipping a worker computes a token's routed experts only where it holds
  them: compute ``6 tokens (N_s + (N_active - N_s) R / W) / flops`` (``R`` = ``W`` is DiLoCo).

Step time: compute + communication, serial (no overlap; DiLoCo/FoMoE's sync amortised over
``H`` steps) and overlapped (``max``). Held bytes a worker: 16 B a parameter held (bf16
weights and gradients, fp32 master and two AdamW moments), ``N / W`` for fsdp, ``N`` for
diloco, ``N_s + N_e R / W`` for fomoe.

Beside the modelled ratios, the FoMoE paper's own figures ("Breaking the Full-Replica Barrier
with a Federation of MoEs", arXiv 2606.19025, abstract as found by search): communication
"up to 1.42x" lower than efficient baselines (DiLoCo, Photon) and "up to 45.44x" lower than
DDP; throughput "up to 1.4x" from token skipping; 100B benefits projected by system modelling.
Its shapes, W, H and R behind those figures were not found, so no figure here is fitted to
them.

    python benchmarks/fomoe_scale.py
    python benchmarks/fomoe_scale.py --workers 4 --sync-every 16 --replicas 1 2

Writes ``benchmarks/results/fomoe_scale.json``.
"""

from __future__ import annotations

import argparse
import math

from hyla.perf import print_table, write_results

SHAPES = {"hyla": {"shared_fraction": 14_245_248 / 38_967_168, "experts": 8, "top_k": 2},
          "fine": {"shared_fraction": 0.15, "experts": 64, "top_k": 4}}
PAPER = {"comm_vs_efficient_baselines": 1.42, "comm_vs_ddp": 45.44,
         "throughput_token_skipping": 1.4,
         "source": "FoMoE abstract (arXiv 2606.19025), 'up to' figures"}


def allreduce_bytes(n_values: float, ranks: int, b: float) -> float:
    """Bytes one rank sends in a ring all-reduce of ``n_values`` over ``ranks``.

    Example:
        >>> allreduce_bytes(100, 4, 2)
        300.0
    """
    return 2 * (ranks - 1) / ranks * n_values * b


def model_point(n_params: float, shape: dict, *, workers: int, replicas: int, sync_every: int,
                link_gbps: float, tokens: float, flops: float, bytes_per_param: float = 2,
                latency_s: float = 0.01, token_skipping: bool = True) -> dict:
    """Per-step figures of fsdp, diloco and fomoe at one model size and link speed.

    Example:
        >>> p = model_point(1e9, SHAPES["fine"], workers=2, replicas=1, sync_every=1,
        ...                 link_gbps=8e-9, tokens=1, flops=1e30, latency_s=0)
        >>> round(p["fsdp"]["comm_bytes"] / 1e9, 3), round(p["fomoe"]["comm_bytes"] / 1e9, 3)
        (2.0, 0.3)
    """
    w, r, h, b = workers, replicas, sync_every, bytes_per_param
    if not 1 <= r <= w:
        raise ValueError(f"replicas must be in 1..{w}, got {r}")
    f_s, e, k = shape["shared_fraction"], shape["experts"], shape["top_k"]
    n_s, n_e = f_s * n_params, (1 - f_s) * n_params
    active = n_s + n_e * k / e
    link = link_gbps * 1e9 / 8  # bytes/s

    def coll(ranks: int) -> float:
        return 2 * (ranks - 1) * latency_s

    compute = 6 * active * tokens / flops
    routed_frac = r / w if token_skipping else 1.0
    compute_fomoe = 6 * tokens * (n_s + (active - n_s) * routed_frac) / flops
    out = {}
    specs = {
        "fsdp": (allreduce_bytes(n_params, w, b), coll(w), compute, n_params / w),
        "diloco": (allreduce_bytes(n_params, w, b) / h, coll(w) / h, compute, n_params),
        "fomoe": ((allreduce_bytes(n_s, w, b) + allreduce_bytes(n_e * r / w, r, b)) / h,
                  (coll(w) + (coll(r) if r > 1 else 0)) / h, compute_fomoe,
                  n_s + n_e * r / w),
    }
    for name, (nbytes, lat, comp, held) in specs.items():
        comm = nbytes / link + lat
        out[name] = {"comm_bytes": nbytes, "comm_s": comm, "compute_s": comp,
                     "step_s": comp + comm, "step_s_overlap": max(comp, comm),
                     "tokens_per_s": w * tokens / (comp + comm),
                     "held_gb": 16 * held / 1e9}
    out["active_params"] = active
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=float, nargs="+", default=[1e9, 3e9, 10e9, 30e9, 100e9])
    ap.add_argument("--links-gbps", type=float, nargs="+", default=[1, 10, 100])
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--replicas", type=int, nargs="+", default=[1, 4],
                    help="R values for fomoe (default 1 and W/2)")
    ap.add_argument("--sync-every", type=int, default=16)
    ap.add_argument("--tokens", type=float, default=2**20, help="tokens a worker a step")
    ap.add_argument("--flops", type=float, default=8 * 989e12 * 0.4,
                    help="effective FLOP/s a worker (site)")
    ap.add_argument("--bytes-per-param", type=float, default=2)
    ap.add_argument("--latency", type=float, default=0.01, help="seconds a ring hop")
    args = ap.parse_args()
    rows, points = [], []
    for shape_name in args.shapes:
        shape = SHAPES[shape_name]
        for r in args.replicas:
            for n in args.sizes:
                for gbps in args.links_gbps:
                    p = model_point(n, shape, workers=args.workers, replicas=r,
                                    sync_every=args.sync_every, link_gbps=gbps,
                                    tokens=args.tokens, flops=args.flops,
                                    bytes_per_param=args.bytes_per_param,
                                    latency_s=args.latency)
                    noskip = model_point(n, shape, workers=args.workers, replicas=r,
                                      sync_every=args.sync_every, link_gbps=gbps,
                                      tokens=args.tokens, flops=args.flops,
                                      bytes_per_param=args.bytes_per_param,
                                      latency_s=args.latency, token_skipping=False)
                    f, d, m = p["fsdp"], p["diloco"], p["fomoe"]
                    row = {"shape": shape_name, "R": r, "params B": n / 1e9,
                           "Gbps": gbps, "compute s": f["compute_s"],
                           "fsdp comm s": f["comm_s"], "diloco comm s": d["comm_s"],
                           "fomoe comm s": m["comm_s"],
                           "fsdp step s": f["step_s"], "diloco step s": d["step_s"],
                           "fomoe step s": m["step_s"],
                           "comm x vs diloco": d["comm_bytes"] / m["comm_bytes"]
                           if m["comm_bytes"] else math.inf,
                           "comm x vs fsdp": f["comm_bytes"] / m["comm_bytes"]
                           if m["comm_bytes"] else math.inf,
                           "tok/s x vs diloco": m["tokens_per_s"] / d["tokens_per_s"],
                           "skip tok/s x": m["tokens_per_s"] / noskip["fomoe"]["tokens_per_s"],
                           "fomoe GB/worker": m["held_gb"], "diloco GB/worker": d["held_gb"]}
                    rows.append(row)
                    points.append({"shape": shape_name, "replicas": r, "params": n,
                                   "link_gbps": gbps, **p,
                                   "fomoe_no_skip": noskip["fomoe"]})
    for shape_name in args.shapes:
        for r in args.replicas:
            print_table(f"shape {shape_name}, W = {args.workers}, R = {r}, "
                        f"H = {args.sync_every}: seconds a step",
                        [x for x in rows if x["shape"] == shape_name and x["R"] == r])
    print("paper (FoMoE abstract):", PAPER)
    path = write_results("fomoe_scale", rows, settings=vars(args), shapes=SHAPES,
                         paper=PAPER, points=points)
    print("wrote", path)


if __name__ == "__main__":
    main()
