"""Measure distributed Muon's traffic: W local gloo processes, both strategies, one preset.

Each rank builds the preset's Muon matrices (widths divided by ``width_divisor``: the run
scale), runs :class:`~hyla.train.optim.dist_muon.DistMuon` with random gradient slices, and reports
the bytes its collectives moved and the Newton-Schulz FLOPs it did, per step. The same counts
for the unscaled preset come from :func:`hyla.train.optim.comm.planned_traffic`, which the run
checks against its own measurement (``matches_plan``).
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import sys
import tempfile

import torch

from hyla.train.optim.comm import STRATEGIES, planned_traffic

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# Newton-Schulz FLOPs at full laplace-3b width are ~6.4 TFLOP per step for all_gather on every
# rank: far beyond a CPU. Width / 16 keeps every shape ratio (gate rank 16 -> 1 included).
DEFAULT_DIVISOR = {"laplace-3b": 16}


def muon_shapes(preset_name: str, width_divisor: int = 1) -> list[tuple[int, int]]:
    """Shapes of the matrices Muon updates in a preset, widths divided by ``width_divisor``.

    ``d_model``, ``ffn_dim`` and the gate's low rank are divided (so every shape's aspect ratio
    is kept); the model is built on the meta device, so no memory is touched.

    Example:
        >>> len(muon_shapes("laplace-3b")), muon_shapes("laplace-3b", 16)[0]
        (240, (96, 192))
    """
    from hyla.model import HylaLM, preset
    from hyla.train.optim.param_groups import split_params

    cfg = preset(preset_name)
    if not isinstance(width_divisor, int) or width_divisor < 1:
        raise ValueError(f"width_divisor must be a positive int, got {width_divisor!r}")
    for name in ("d_model", "ffn_dim", "gate_low_rank_dim"):
        if getattr(cfg, name) % width_divisor:
            raise ValueError(f"width_divisor={width_divisor} must divide {name}="
                             f"{getattr(cfg, name)} of preset {preset_name!r}")
    d = width_divisor
    cfg = dataclasses.replace(cfg, d_model=cfg.d_model // d, ffn_dim=cfg.ffn_dim // d,
                              gate_low_rank_dim=cfg.gate_low_rank_dim // d)
    with torch.device("meta"):
        model = HylaLM(cfg)
    return [tuple(p.shape) for _, p in split_params(model)[0]]


def _worker(rank: int, world: int, init_file: str, out_dir: str, shapes: list, steps: int,
            ns_dtype: str, comm_dtype: str) -> None:
    import torch.distributed as dist

    from hyla.train.optim.comm import rows_per_rank
    from hyla.train.optim.dist_muon import DistMuon

    torch.set_num_threads(1)  # W processes share the machine's cores
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world)
    try:
        g = torch.Generator().manual_seed(rank)
        result = {}
        for strategy in STRATEGIES:
            params = [torch.nn.Parameter(torch.randn(*s, generator=g) * 0.02) for s in shapes]
            opt = DistMuon(params, strategy=strategy, ns_dtype=DTYPES[ns_dtype],
                           comm_dtype=DTYPES[comm_dtype], sync_params=False)
            for _ in range(steps):
                opt.step([torch.randn(rows_per_rank(a, world), b, generator=g)
                          for a, b in shapes])
            tot = opt.counter.totals()["optimizer"]
            result[strategy] = {"sent": tot["sent"] // steps, "received": tot["received"] // steps,
                                "ns_flops": opt.ns_flops_total // steps}
        pathlib.Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


def _summary(rows: list[dict]) -> dict:
    n = len(rows)
    return {"bytes_per_rank": sum(r["sent"] for r in rows) / n,
            "bytes_received_per_rank": sum(r["received"] for r in rows) / n,
            "bytes_per_rank_max": max(max(r["sent"], r["received"]) for r in rows),
            "ns_flops_per_rank": max(r["ns_flops"] for r in rows),
            "ns_flops_per_rank_mean": sum(r["ns_flops"] for r in rows) / n}


def run_muon_comm(world: int, preset_name: str = "laplace-3b", *, width_divisor: int | None = None,
                  steps: int = 1, ns_dtype: str = "fp32", comm_dtype: str = "fp32") -> dict:
    """Launch ``world`` gloo processes, run both strategies, return the per-rank figures.

    ``bytes_per_rank`` is the mean over ranks of the bytes a rank sends per step (the mean
    received is the same); ``ns_flops_per_rank`` is the busiest rank's NS FLOPs per step.
    ``full_scale`` holds the same figures planned for the unscaled preset.

    Example:
        >>> r = run_muon_comm(2, "debug")
        >>> r["strategies"]["all_gather"]["bytes_per_rank"] > 0
        True
    """
    import torch.multiprocessing as mp

    if not isinstance(world, int) or world < 2:
        raise ValueError(f"world must be an int >= 2, got {world!r}")
    if not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be a positive int, got {steps!r}")
    for name, value in (("ns_dtype", ns_dtype), ("comm_dtype", comm_dtype)):
        if value not in DTYPES:
            raise ValueError(f"{name} must be one of {sorted(DTYPES)}, got {value!r}")
    div = DEFAULT_DIVISOR.get(preset_name, 1) if width_divisor is None else width_divisor
    shapes = muon_shapes(preset_name, div)
    full = muon_shapes(preset_name) if div != 1 else shapes
    size = DTYPES[comm_dtype].itemsize
    # Fork where we can: the children inherit torch instead of importing it W times over.
    method = "fork" if sys.platform.startswith("linux") else "spawn"
    torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))])  # imports torch._dynamo once, here
    with tempfile.TemporaryDirectory() as d:
        mp.start_processes(_worker, args=(world, os.path.join(d, "init"), d, shapes, steps,
                                          ns_dtype, comm_dtype),
                           nprocs=world, join=True, start_method=method)
        ranks = [json.loads(pathlib.Path(d, f"rank{r}.json").read_text()) for r in range(world)]
    strategies, full_scale, matches = {}, {}, True
    for s in STRATEGIES:
        rows = [r[s] for r in ranks]
        matches &= rows == planned_traffic(shapes, world, s, size)
        strategies[s] = _summary(rows)
        full_scale[s] = _summary(planned_traffic(full, world, s, size))
    ratio = (strategies["all_gather"]["bytes_per_rank"]
             / strategies["all_to_all"]["bytes_per_rank"])
    full_ratio = (full_scale["all_gather"]["bytes_per_rank"]
                  / full_scale["all_to_all"]["bytes_per_rank"])
    return {"world": world, "preset": preset_name, "width_divisor": div,
            "matrices": len(shapes), "muon_params": sum(a * b for a, b in shapes),
            "comm_dtype": comm_dtype, "ns_dtype": ns_dtype,
            "strategies": strategies, "measured_ratio": ratio, "analytic_ratio": world / 2,
            "matches_plan": matches,
            "full_scale": {"muon_params": sum(a * b for a, b in full), "strategies": full_scale,
                           "ratio": full_ratio}}
