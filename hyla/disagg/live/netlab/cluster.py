"""A PrfaaS cluster across a :class:`~hyla.disagg.live.netlab.NetLab`: a prefill worker on
the prefill side, a decode worker and the router on the decode side (where a router sits
in practice: with the local PD cluster), every process ``hyla serve --role ...`` with the
debug preset; and a load driver that measures each request's time to first token and end
to end. Used by ``tests/disagg/test_cluster_netns.py`` and ``benchmarks/disagg_link.py``.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import sys
import time

import httpx

PREFILL_PORT, DECODE_PORT, ROUTER_PORT = 8101, 8201, 8000


class LabCluster:
    """The roles' processes on ``lab`` (see the module docstring); ``secret`` is the
    cluster secret every role gets through its environment."""

    def __init__(self, lab, log_path, secret: str = "netlab-cluster-secret",
                 max_model_len: int = 1024):
        self.lab, self.secret, self.max_model_len = lab, secret, max_model_len
        self.log = open(log_path, "w+b")  # noqa: SIM115 - closed in stop()
        self.procs: dict[str, object] = {}
        p, d = lab.ip["prefill"], lab.ip["decode"]
        self.prefill_url, self.decode_url = f"http://{p}:{PREFILL_PORT}", \
            f"http://{d}:{DECODE_PORT}"
        self.router_port = ROUTER_PORT

    @property
    def router_url(self) -> str:
        return f"http://{self.lab.ip['decode']}:{self.router_port}"

    def _start(self, name: str, side: str, args: list[str]):
        env = dict(os.environ, PYTHONUNBUFFERED="1", HYLA_CLUSTER_SECRET=self.secret,
                   OMP_NUM_THREADS="1")
        env.pop("HYLA_API_KEY", None)
        self.procs[name] = self.lab.popen(side, [
            sys.executable, "-m", "hyla", "serve", "--preset", "debug", "--threads", "1",
            "--log-level", "warning", "--max-model-len", str(self.max_model_len), *args],
            stdout=self.log, stderr=self.log, env=env)

    def start_workers(self, link_gbps: float = 10.0) -> None:
        self._start("prefill", "prefill", ["--role", "prefill", "--host",
                                           self.lab.ip["prefill"], "--port",
                                           str(PREFILL_PORT), "--link-gbps", str(link_gbps)])
        self._start("decode", "decode", ["--role", "decode", "--host", self.lab.ip["decode"],
                                         "--port", str(DECODE_PORT)])

    def start_router(self, *, link_gbps: float = 10.0, threshold: int = 64,
                     force: str | None = None, port: int | None = None) -> None:
        """(Re)start the router (stopping a previous one) with these settings."""
        self.stop_one("router")
        self.router_port = port or self.router_port + 1
        args = ["--role", "router", "--host", self.lab.ip["decode"], "--port",
                str(self.router_port), "--prefill-workers", self.prefill_url,
                "--decode-workers", self.decode_url, "--threshold", str(threshold),
                "--link-gbps", str(link_gbps)]
        if force:
            args += ["--force-path", force]
        self._start("router", "decode", args)

    def wait_ready(self, timeout: float = 180.0) -> None:
        """Until the router says both workers are up; RuntimeError with the logs' tail."""
        def poll():
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                for name, p in self.procs.items():
                    if p.poll() is not None:
                        raise RuntimeError(f"{name} exited with {p.returncode}:\n"
                                           f"{self.tail()}")
                try:
                    h = httpx.get(self.router_url + "/health", timeout=2).json()
                    if h.get("decode_workers_up") and h.get("prefill_workers_up"):
                        return
                except (httpx.HTTPError, ValueError):
                    pass
                time.sleep(0.3)
            raise RuntimeError(f"the cluster was not ready in {timeout:g} s:\n{self.tail()}")
        self.lab.run_in("decode", poll)

    def get(self, path: str) -> dict:
        """GET the router's ``path`` (from the decode side)."""
        return self.lab.run_in("decode", lambda: httpx.get(self.router_url + path,
                                                           timeout=10).json())

    def tail(self, n: int = 4000) -> str:
        self.log.flush()
        self.log.seek(0)
        return self.log.read().decode(errors="replace")[-n:]

    def stop_one(self, name: str) -> None:
        p = self.procs.pop(name, None)
        if p is None:
            return
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(p.pid, sig)
                p.wait(5)
                return
            except ProcessLookupError:
                return
            except Exception:  # noqa: BLE001 - TimeoutExpired: SIGKILL next
                continue

    def stop(self) -> None:
        for name in list(self.procs):
            self.stop_one(name)
        self.log.close()


def prompt_ids(i: int, tokens: int) -> list[int]:
    """A distinct prompt of ``tokens`` token ids (no shared prefix between requests: a
    formula periodic in ``i`` repeated prompts, which a decode worker's cache then held)."""
    rng = random.Random(i)
    return [1 + rng.randrange(200) for _ in range(tokens)]


async def one_request(client: httpx.AsyncClient, base: str, ids: list[int],
                      max_tokens: int) -> dict:
    """A streaming completion: its ``status``, ``ttft_s``, ``e2e_s`` and ``tokens``
    (``status`` "ok" only if every token came and the stream ended with [DONE])."""
    t0 = time.monotonic()
    ttft, n, done, status = None, 0, False, "error"
    body = {"prompt": ids, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True}
    try:
        async with client.stream("POST", f"{base}/v1/completions", json=body) as r:
            if r.status_code != 200:
                return {"status": f"HTTP {r.status_code}", "ttft_s": None,
                        "e2e_s": time.monotonic() - t0, "tokens": 0}
            async for line in r.aiter_lines():
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: "):
                    d = json.loads(line[6:])
                    if "error" in d:
                        status = "error: " + d["error"]["message"][:200]
                        break
                    if ttft is None:
                        ttft = time.monotonic() - t0
                    n += 1
        if done and n >= 1:
            status = "ok"
    except httpx.HTTPError as e:
        status = f"error: {type(e).__name__}"
    return {"status": status, "ttft_s": ttft, "e2e_s": time.monotonic() - t0, "tokens": n}


async def drive(base: str, n: int, *, tokens: int, max_tokens: int = 4,
                concurrency: int = 2, interval_s: float = 0.0, start: int = 0,
                on_tick=None) -> list[dict]:
    """``n`` requests (at most ``concurrency`` at once, one started every ``interval_s``
    at most); each result has ``i``, ``start_s`` (since the first) and the figures of
    :func:`one_request`. ``on_tick(elapsed)`` is awaited about every 0.2 s."""
    sem = asyncio.Semaphore(concurrency)
    t0 = time.monotonic()
    out: list[dict] = []

    async with httpx.AsyncClient(timeout=120) as client:
        async def run(i):
            async with sem:
                s = time.monotonic() - t0
                r = await one_request(client, base, prompt_ids(start + i, tokens), max_tokens)
                out.append({"i": start + i, "start_s": s, **r})

        async def ticker():
            while True:
                await asyncio.sleep(0.2)
                await on_tick(time.monotonic() - t0)
        tick = asyncio.ensure_future(ticker()) if on_tick else None
        tasks = []
        for i in range(n):
            tasks.append(asyncio.ensure_future(run(i)))
            if interval_s:
                await asyncio.sleep(interval_s)
        await asyncio.gather(*tasks)
        if tick:
            tick.cancel()
    return sorted(out, key=lambda r: r["i"])


def p90(xs: list[float]) -> float | None:
    xs = sorted(x for x in xs if x is not None)
    return xs[min(len(xs) - 1, int(round(0.9 * (len(xs) - 1))))] if xs else None
