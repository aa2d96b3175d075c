"""What the Prefill-as-a-Service benchmarks share: the trace, one streamed request through
the router, a live ``hyla cluster`` replaying requests, forked simulator runs, pyplot."""

from __future__ import annotations

import asyncio
import multiprocessing
import pathlib
import time

import httpx

from hyla.disagg.live.cluster import launch
from hyla.perf import RESULTS_DIR

TRACE = "azure-conv"  # the Azure conversation trace that ships with hyla


def out_dir(run) -> pathlib.Path:
    """Where the results file and its plot go."""
    (path := pathlib.Path(run.args.out or RESULTS_DIR)).mkdir(parents=True, exist_ok=True)
    return path


def pool(jobs: int):
    return multiprocessing.get_context("fork").Pool(jobs)   # simulator runs are CPU-bound


def pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


async def request(client, base, req, t0, out):
    """``req`` (a simulator Request) at its arrival, streamed: TTFT is the first chunk."""
    await asyncio.sleep(max(0.0, t0 + req.arrival - time.perf_counter()))
    start, ttft, ok = time.perf_counter(), None, False
    body = {"prompt": [(i * 7 + req.rid) % 250 + 1 for i in range(req.prompt_len)],
            "max_tokens": req.output_len, "temperature": 0, "ignore_eos": True, "stream": True}
    try:
        async with client.stream("POST", f"{base}/v1/completions", json=body) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: ") and ttft is None:
                    ttft = time.perf_counter() - start
                ok = ok or (line == "data: [DONE]" and r.status_code == 200)
    except httpx.HTTPError:
        pass
    now = time.perf_counter()
    out.append({"rid": req.rid, "ok": ok, "ttft": ttft, "e2e": now - start, "end": now - t0,
                "output": req.output_len, "prompt": req.prompt_len})


def replay(spec, reqs, warm=None) -> dict:
    """Start a cluster, await ``warm(client, cluster)`` if given, replay ``reqs`` at their
    arrivals: the outcomes, the router's ``/cluster`` after, the prefill worker's
    ``/internal/info``, what ``warm`` returned and the replay's seconds."""
    cluster = launch(spec)
    try:
        async def go():
            async with httpx.AsyncClient(timeout=300) as client:
                warmed = await warm(client, cluster) if warm else None
                out, t0 = [], time.perf_counter()
                await asyncio.gather(*(request(client, cluster.url, r, t0, out) for r in reqs))
                return out, warmed, time.perf_counter() - t0
        out, warmed, wall = asyncio.run(go())
        view = httpx.get(f"{cluster.url}/cluster").json()
        pre = next(w for w in view["workers"] if w["role"] == "prefill")
        info = httpx.get(pre["address"] + "/internal/info", auth=cluster.auth).json()
    finally:
        cluster.stop()
    return {"out": out, "view": view, "info": info, "warm": warmed, "wall": wall}
