"""FoMoE's communication and step time against FSDP and DiLoCo, modelled for 1B-100B MoEs.

Arithmetic on stated assumptions, not training: shapes ``hyla`` (``small-moe``'s shared
fraction, E = 8, top-2) and ``fine`` (15% shared, E = 64, top-4); ``W`` sites (default 8) of 8
H100 at 40% MFU, 2^20 tokens each a step; bf16 ring collectives, 10 ms a hop; a worker sends
fsdp ``2 (W-1)/W N`` values a step, diloco that every ``H`` steps, fomoe every ``H`` steps the
shared part and its experts among their ``R`` holders; token skipping computes routed experts
only where held; 16 bytes a parameter held. Beside the FoMoE paper's "up to" figures (arXiv
2606.19025). ``--quick``: 1B and 100B at 10 Gbps.
"""

import itertools
import math

SHAPES = {"hyla": {"shared_fraction": 14_245_248 / 38_967_168, "experts": 8, "top_k": 2},
          "fine": {"shared_fraction": 0.15, "experts": 64, "top_k": 4}}
PAPER = {"comm_vs_efficient_baselines": 1.42, "comm_vs_ddp": 45.44,
         "throughput_token_skipping": 1.4, "source": "FoMoE abstract (arXiv 2606.19025), 'up to'"}
SIZES, LINKS_GBPS = (1e9, 3e9, 10e9, 30e9, 100e9), (1, 10, 100)
STRATEGIES = ("fsdp", "diloco", "fomoe")
TOKENS, FLOPS = 2**20, 8 * 989e12 * 0.4  # a worker a step; effective FLOP/s of a site


def allreduce_bytes(n_values: float, ranks: int, b: float) -> float:
    """Bytes one rank sends in a ring all-reduce of ``n_values`` over ``ranks``."""
    return 2 * (ranks - 1) / ranks * n_values * b


def model_point(n_params: float, shape: dict, *, workers: int, replicas: int, sync_every: int,
                link_gbps: float, tokens: float, flops: float, bytes_per_param: float = 2,
                latency_s: float = 0.01, token_skipping: bool = True) -> dict:
    """Per-step figures of fsdp, diloco and fomoe at one model size and link speed."""
    w, r, h, b = workers, replicas, sync_every, bytes_per_param
    if not 1 <= r <= w:
        raise ValueError(f"replicas must be in 1..{w}, got {r}")
    n_s = shape["shared_fraction"] * n_params
    n_e = n_params - n_s
    active = n_s + n_e * shape["top_k"] / shape["experts"]
    lat_w, lat_r = 2 * (w - 1) * latency_s, 2 * (r - 1) * latency_s   # a collective's hops
    compute = 6 * active * tokens / flops
    routed = r / w if token_skipping else 1.0
    specs = {  # bytes sent, latency, compute seconds, parameters held
        "fsdp": (allreduce_bytes(n_params, w, b), lat_w, compute, n_params / w),
        "diloco": (allreduce_bytes(n_params, w, b) / h, lat_w / h, compute, n_params),
        "fomoe": ((allreduce_bytes(n_s, w, b) + allreduce_bytes(n_e * r / w, r, b)) / h,
                  (lat_w + lat_r) / h, 6 * tokens * (n_s + (active - n_s) * routed) / flops,
                  n_s + n_e * r / w)}
    out = {"active_params": active}
    for name, (nbytes, lat, comp, held) in specs.items():
        comm = nbytes / (link_gbps * 1e9 / 8) + lat
        out[name] = {"comm_bytes": nbytes, "comm_s": comm, "compute_s": comp,
                     "step_s": comp + comm, "step_s_overlap": max(comp, comm),
                     "tokens_per_s": w * tokens / (comp + comm), "held_gb": 16 * held / 1e9}
    return out


def add_args(parser) -> None:
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--replicas", type=int, nargs="+", default=[1, 4], help="R of fomoe")
    parser.add_argument("--sync-every", type=int, default=16)


def row(shape: str, r: int, n: float, gbps: float, p: dict, noskip: dict) -> dict:
    f, d, m = p["fsdp"], p["diloco"], p["fomoe"]
    less = {k: x["comm_bytes"] / m["comm_bytes"] if m["comm_bytes"] else math.inf
            for k, x in (("comm x vs diloco", d), ("comm x vs fsdp", f))}
    return {"shape": shape, "R": r, "params B": n / 1e9, "Gbps": gbps,
            "compute s": f["compute_s"], **{f"{s} comm s": p[s]["comm_s"] for s in STRATEGIES},
            **{f"{s} step s": p[s]["step_s"] for s in STRATEGIES}, **less,
            "tok/s x vs diloco": m["tokens_per_s"] / d["tokens_per_s"],
            "skip tok/s x": m["tokens_per_s"] / noskip["tokens_per_s"],
            "fomoe GB/worker": m["held_gb"], "diloco GB/worker": d["held_gb"]}


def main(run) -> None:
    a = run.args
    sizes, links = ((1e9, 100e9), (10,)) if a.quick else (SIZES, LINKS_GBPS)
    rows, points = [], []
    for (shape_name, shape), r in itertools.product(SHAPES.items(), a.replicas):
        for n, gbps in itertools.product(sizes, links):
            kw = dict(workers=a.workers, replicas=r, sync_every=a.sync_every, link_gbps=gbps,
                      tokens=TOKENS, flops=FLOPS)
            p = model_point(n, shape, **kw)
            noskip = model_point(n, shape, token_skipping=False, **kw)["fomoe"]
            rows.append(row(shape_name, r, n, gbps, p, noskip))
            points.append({"shape": shape_name, "replicas": r, "params": n, "link_gbps": gbps,
                           **p, "fomoe_no_skip": noskip})
        run.table(f"shape {shape_name}, W = {a.workers}, R = {r}, H = {a.sync_every}: seconds "
                  "a step", rows[-len(sizes) * len(links):])
    r1 = [x for x in rows if x["R"] == min(a.replicas)]

    def span(key, fmt):
        return f"{min(x[key] for x in r1):{fmt}}-{max(x[key] for x in r1):{fmt}}x"

    run.save(rows, settings={"sizes": sizes, "links_gbps": links, "workers": a.workers,
                             "replicas": a.replicas, "sync_every": a.sync_every, "tokens": TOKENS,
                             "flops": FLOPS, "bytes_per_param": 2, "latency": 0.01},
             shapes=SHAPES, paper=PAPER, points=points,
             summary=f"modelled at {a.workers} sites, H = {a.sync_every}, R = {min(a.replicas)}: "
                     f"FoMoE sends {span('comm x vs diloco', '.1f')} less than DiLoCo, "
                     f"{span('comm x vs fsdp', '.0f')} less than FSDP; token skipping alone "
                     f"{span('skip tok/s x', '.2f')} tokens/s")
