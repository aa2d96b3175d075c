"""The router role (``hyla serve --role router``): the cluster's OpenAI-compatible front.

For each request the router tokenizes the prompt, looks up how much of it the PD workers'
prefix caches hold (:class:`~hyla.disagg.policy.prefix_index.PrefixIndex`, the router's own
estimate), and asks the routing policy (:class:`~hyla.disagg.policy.prfaas.PrfaasRouter`,
built by :func:`~hyla.disagg.policy.build_policy` from ``LiveRouterConfig.policy``, as the
simulator builds its own) where its prefill runs, on the incremental length, and which
worker gets it (``policy.pick``):

- **local**: the request is proxied to a decode (PD) worker, the one holding its longest
  cached prefix if any, which prefills and decodes it;
- **remote**: a prefill worker prefills it and ships the state to a decode worker that
  streams the decode back through the router.

Nothing is lost silently. A remote prefill that fails (worker killed, transfer corrupt,
partial, mismatched or stalled) is re-run locally. A decode worker that fails before the
client saw a token is replaced by another; a streaming response that already sent tokens
ends with an error event, and a non-streaming one is re-run from the start. When no worker
can serve, the client gets a 503 with an OpenAI error body.

Every ``poll_s`` the router reads each worker's ``/internal/info`` (health, queue,
throughput) and feeds the policy the measured egress Gbps (bytes the prefill workers
shipped), the remote and local prefill queues and whether the remote pool is up. ``GET
/cluster`` lists the workers (role, address, pid, health), the policy's state, the routing
counts and the long-timescale P/D split recommendation.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import time
from dataclasses import dataclass, field

import httpx

from hyla.disagg.live.transfer import EgressMeter
from hyla.disagg.policy import LOCAL, RouterConfig, build_policy, recommend_pd_split
from hyla.disagg.policy.prefix_index import PrefixIndex, chunk_chain
from hyla.model.sampler import TokenLogprob
from hyla.serve.api import (
    param_of,
)
from hyla.serve.api_schemas import APIError
from hyla.serve.engine import StepOutput
from hyla.serve.sequence import SamplingParams


class _Fallback(Exception):
    """The remote path failed before any output: re-run locally."""


class WorkerFailed(Exception):
    """A decode worker failed (connection lost, engine error) while streaming."""

    def __init__(self, msg: str, sent: int):
        super().__init__(msg)
        self.sent = sent


@dataclass
class Worker:
    url: str
    role: str
    info: dict = field(default_factory=dict)
    healthy: bool = False
    error: str | None = "not polled yet"
    inflight: int = 0
    last_ok: float = 0.0
    queued_tokens: int = 0          # not tracked per worker: the policy picks by inflight
    slow_polls: int = 0             # health polls in a row that timed out

    @property
    def name(self) -> str:
        return self.url

    def view(self) -> dict:
        i = self.info
        return {"role": self.role, "address": self.url, "pid": i.get("pid"),
                "healthy": self.healthy, "health": "ok" if self.healthy else "down",
                "error": self.error, "inflight": self.inflight,
                "transfer_address": i.get("transfer_address"),
                "queue_s": i.get("queue_s"), "fingerprint": i.get("fingerprint")}


SLOW_POLLS_DOWN = 3                 # timed-out health polls in a row before a worker is down

# Queues closer than this count as balanced: the policy's datacenter default is 1 s, but a
# small cluster's prefills take tens of milliseconds.
LIVE_QUEUE_MARGIN_S = 0.1


def live_policy(**kw) -> RouterConfig:
    """The policy's knobs with a small live cluster's defaults (``threshold`` 1024 tokens,
    a 10 Gbps link, queues within 0.1 s balanced); ``kw`` overrides any of them.

    Example:
        >>> live_policy(threshold=512).threshold, live_policy().queue_margin_s
        (512, 0.1)
    """
    return RouterConfig(**{"threshold": 1024, "link_gbps": 10.0,
                           "queue_margin_s": LIVE_QUEUE_MARGIN_S, **kw})


@dataclass(kw_only=True)
class LiveRouterConfig:
    """The router's knobs. ``policy`` holds the routing policy's (threshold, link capacity,
    adaptation; see :class:`~hyla.disagg.policy.RouterConfig`); ``max_remote_inflight``
    requests per prefill worker before the pool counts as saturated (then requests stay
    local)."""

    prefill_urls: list[str]
    decode_urls: list[str]
    model_name: str
    max_model_len: int = 2048
    policy: RouterConfig = field(default_factory=live_policy)
    transfer_timeout_s: float = 30.0
    max_remote_inflight: int = 4
    poll_s: float = 0.5
    read_timeout_s: float = 120.0
    api_key: str | None = None
    force: str | None = None          # "local" / "remote": bypass the policy (benchmarks)
    # The PD workers' prefix caches as the router estimates them: prompts are indexed in
    # chunks of the engine's GLA snapshot interval, as many per worker as it keeps snapshots.
    prefix_chunk_tokens: int = 256
    prefix_capacity: int = 16


def _lp(x: dict | None) -> TokenLogprob | None:
    return None if x is None else TokenLogprob(x["token"], x["logprob"],
                                               [tuple(t) for t in x["top"]])


def _out(d: dict, rid: str) -> StepOutput:
    lps = [_lp(x) for x in d.get("logprobs") or []]
    plps = d.get("prompt_logprobs")
    return StepOutput(rid, d["token_ids"], d["text"], d["finished"], d["finish_reason"], lps,
                      d["num_prompt_tokens"], d["num_output_tokens"],
                      prompt_logprobs=None if plps is None else [_lp(x) for x in plps])


class LiveRouter:
    """Worker registry, policy and request paths (see the module docstring)."""

    def __init__(self, cfg: LiveRouterConfig, tokenizer):
        self.cfg, self.tok = cfg, tokenizer
        self.prefill = [Worker(u.rstrip("/"), "prefill") for u in cfg.prefill_urls]
        self.decode = [Worker(u.rstrip("/"), "decode") for u in cfg.decode_urls]
        self.policy = build_policy(cfg.policy)
        self.egress = EgressMeter(window_s=5.0)
        self.prefix = PrefixIndex(cfg.prefix_chunk_tokens, cfg.prefix_capacity)
        self.counts = {"local": 0, "remote": 0, "remote_ok": 0, "fallback_local": 0,
                       "decode_retries": 0, "failed_mid_stream": 0, "failed": 0,
                       "cached_local": 0, "cached_tokens": 0}
        self.fallback_reasons: dict[str, int] = {}
        self.last_errors: list[str] = []
        self.t0 = time.monotonic()
        self._busy_prev: dict[str, tuple] = {}
        self.pd = {"note": "not measured yet"}
        self._rr = itertools.count()
        headers = {"authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
        self.http = httpx.AsyncClient(headers=headers, timeout=httpx.Timeout(
            cfg.read_timeout_s, connect=5.0), limits=httpx.Limits(max_connections=1000,
                                                                   max_keepalive_connections=100))
        self._poller: asyncio.Task | None = None

    # -- health and policy inputs ------------------------------------------------------
    async def poll_once(self) -> None:
        async def one(w: Worker):
            try:
                r = await self.http.get(f"{w.url}/internal/info", timeout=3.0)
                info = r.json() if r.headers.get("content-type", "").startswith(
                    "application/json") else {}
                # Semantic health: a worker counts only if it says it can serve (a dead
                # engine or state receiver answers 503 with "status": "error").
                if r.status_code != 200 or info.get("status") != "ok":
                    raise ValueError(f"HTTP {r.status_code}, status {info.get('status')!r}"
                                     f": {info.get('error', '')}"[:300])
                w.info, w.healthy, w.error = info, True, None
                w.last_ok = time.monotonic()
            except httpx.TimeoutException as e:
                # A busy worker on a loaded machine can be slow to answer: down after
                # several slow polls in a row (a refused connection or a 503 counts at once).
                w.slow_polls += 1
                if w.slow_polls >= SLOW_POLLS_DOWN:
                    w.healthy, w.error = False, f"{type(e).__name__}: {e}"
                return
            except (httpx.HTTPError, ValueError) as e:
                w.healthy, w.error = False, f"{type(e).__name__}: {e}"
            w.slow_polls = 0
        await asyncio.gather(*(one(w) for w in self.prefill + self.decode))
        await self._register_decoders()
        up = [w for w in self.prefill if w.healthy]
        loc = [w for w in self.decode if w.healthy]
        remote_q = min((w.info.get("queue_s", 0.0) for w in up), default=0.0)
        local_q = min((w.info.get("queue_s", 0.0) for w in loc), default=0.0)
        self.policy.observe(time.monotonic() - self.t0, egress_gbps=self.egress.gbps(),
                            remote_queue_s=remote_q, local_queue_s=local_q,
                            remote_up=bool(up))
        self._pd_split(loc)

    async def _register_decoders(self) -> None:
        """Tell every prefill worker the decode workers it may ship states to (their
        transfer addresses): a prefill worker sends nowhere else."""
        dests = sorted({w.info["transfer_address"] for w in self.decode
                        if w.healthy and w.info.get("transfer_address")})

        async def push(w: Worker):
            try:
                r = await self.http.post(f"{w.url}/internal/registry", json={"decode": dests},
                                         timeout=3.0)
                r.raise_for_status()
            except httpx.HTTPError as e:
                w.healthy, w.error = False, f"registry: {type(e).__name__}: {e}"
        await asyncio.gather(*(push(w) for w in self.prefill if w.healthy))

    def _pd_split(self, loc: list[Worker]) -> None:
        """Long timescale: busy fractions of the local pool's prefill and decode work."""
        now = time.monotonic()
        pre = sum(w.info.get("prefill_time_s", 0.0) for w in loc)
        dec = sum(w.info.get("decode_time_s", 0.0) for w in loc)
        prev = self._busy_prev.get("local")
        if prev is None or now - prev[0] < 10.0:
            self._busy_prev.setdefault("local", (now, pre, dec))
            return
        self._busy_prev["local"] = (now, pre, dec)
        span = (now - prev[0]) * max(1, len(loc))
        pb, db = min(1.0, (pre - prev[1]) / span), min(1.0, (dec - prev[2]) / span)
        n = len(loc)
        self.pd = {"local_instances": n, "prefill_busy": round(pb, 3),
                   "decode_busy": round(db, 3), "window_s": round(now - prev[0], 1)}
        if n >= 2:
            self.pd["recommended_prefill_instances"] = recommend_pd_split(
                n, max(1, n // 2), min(1.0, 2 * pb), min(1.0, 2 * db))
            self.pd["note"] = ("of the local PD instances, how many should be dedicated "
                               "prefill instances for the measured load")
        else:
            self.pd["note"] = "one local instance: nothing to split"

    async def _poll_loop(self) -> None:
        while True:
            try:
                await self.poll_once()
            except Exception as e:  # noqa: BLE001 - keep polling
                self.record_error(f"poll failed: {e!r}")
            await asyncio.sleep(self.cfg.poll_s)

    def start(self) -> None:
        self._poller = asyncio.get_running_loop().create_task(self._poll_loop())

    async def close(self) -> None:
        if self._poller is not None:
            self._poller.cancel()
        await self.http.aclose()

    def record_error(self, msg: str) -> None:
        self.last_errors = (self.last_errors + [msg])[-20:]

    def cluster_view(self) -> dict:
        p = self.policy
        return {"router": {"role": "router", "pid": os.getpid(), "health": "ok"},
                "workers": [w.view() for w in self.prefill + self.decode],
                "policy": {"threshold": p.t, "link_gbps": self.cfg.policy.link_gbps,
                           "egress_gbps": self.egress.gbps(), "link_util": p.link_util,
                           "remote_queue_s": p.remote_queue_s,
                           "local_queue_s": p.local_queue_s, "remote_up": p.remote_up,
                           "forced": self.cfg.force},
                "counts": dict(self.counts), "fallback_reasons": dict(self.fallback_reasons),
                "pd_split": self.pd, "last_errors": self.last_errors[-5:]}

    # -- picking workers ---------------------------------------------------------------
    def _pick(self, pool: list[Worker], exclude=(), cap: int | None = None,
              need_transfer: bool = False, prefer: str | None = None) -> Worker | None:
        """The worker of ``pool`` that gets a request: those that can take it (healthy, not
        tried yet, under ``cap``, with a transfer socket if ``need_transfer``), then the
        policy's choice among them (``prefer``: the one holding the prompt's prefix)."""
        ok = [w for w in pool if w.healthy and w.url not in exclude
              and (cap is None or w.inflight < cap)
              and (not need_transfer or w.info.get("transfer_address"))]
        return self.policy.pick(ok, prefill=not need_transfer, prefer=prefer,
                                turn=next(self._rr))

    # -- request paths -----------------------------------------------------------------
    async def generate(self, ids: list[int], params: SamplingParams, rid: str):
        """Async iterator of StepOutputs for one request, by whichever path works.

        Raises APIError before the first output when nothing can serve it, and
        :class:`WorkerFailed` (with ``sent`` > 0) when a decode worker dies mid-stream.
        """
        target, chain, cached_on = self.plan(ids)
        if params.prompt_logprobs is not None:
            target = LOCAL          # prompt logprobs come from a PD worker's prefill
        if target == "remote":
            # forced remote (a baseline) queues at the prefill pool instead of falling back
            cap = None if self.cfg.force == "remote" else self.cfg.max_remote_inflight
            p = self._pick(self.prefill, cap=cap)
            d = self._pick(self.decode, need_transfer=True)
            if p is None or d is None:
                self._fallback("remote pool saturated or down" if p is None
                               else "no decode worker for a shipped state")
            else:
                self.counts["remote"] += 1
                sent = 0
                try:
                    async for o in self._remote(p, d, ids, params, rid):
                        sent += 1
                        self.counts["remote_ok"] += o.finished
                        yield o
                    return
                except _Fallback as e:
                    self._fallback(str(e))
                except WorkerFailed as e:
                    if e.sent or sent:
                        raise
                    self._fallback(str(e))
        self.counts["local"] += 1
        tried: set[str] = set()
        errors = []
        while True:
            w = self._pick(self.decode, exclude=tried, prefer=cached_on)
            if w is None:
                break
            tried.add(w.url)
            sent = 0
            try:
                async for o in self._stream(w, ids, params, rid, prefilled=False):
                    if not sent:                # prefilled there: its cache holds it now
                        self.prefix.insert(w.url, chain)
                    sent += 1
                    yield o
                return
            except WorkerFailed as e:
                self.prefix.forget(w.url)
                if sent:
                    raise WorkerFailed(str(e), sent) from None
                errors.append(str(e))
                self.counts["decode_retries"] += 1
        self.counts["failed"] += 1
        msg = "; ".join(errors) or "no healthy decode worker"
        raise APIError(f"No worker could serve the request: {msg}", status=503,
                       type="server_error", code="no_worker_available")

    def plan(self, ids: list[int]) -> tuple[str, list[int], str | None]:
        """(target, the prompt's chunk hashes, the PD worker holding its longest cached
        prefix) for a prompt: the policy decides on the incremental length.

        The remote pool keeps no prefix cache, so only the local side counts one (and a
        remote prefill recomputes the whole prompt)."""
        chain = chunk_chain(ids, self.prefix.chunk_tokens)
        up = [w.url for w in self.decode if w.healthy]
        cached_on, cached = self.prefix.best(chain, up)
        if self.cfg.force:
            return self.cfg.force, chain, cached_on
        d = self.policy.route(len(ids), {LOCAL: cached}, time.monotonic() - self.t0)
        if d.target == LOCAL and d.cached_tokens:
            self.counts["cached_local"] += 1
            self.counts["cached_tokens"] += d.cached_tokens
        return d.target, chain, cached_on

    def _fallback(self, reason: str) -> None:
        self.counts["fallback_local"] += 1
        key = reason.split(":")[0][:80]
        self.fallback_reasons[key] = self.fallback_reasons.get(key, 0) + 1
        self.record_error(f"fallback to local: {reason}")

    async def _lines(self, w: Worker, resp, rid: str, sent0: int = 0):
        """Parsed NDJSON lines of a decode worker's stream; WorkerFailed on loss."""
        sent = sent0
        try:
            async for line in resp.aiter_lines():
                if not line:
                    continue
                d = json.loads(line)
                if "error" in d:
                    kind = d.get("kind")
                    if kind == "invalid":
                        raise APIError(d["error"], param=param_of(d["error"]))
                    if kind == "request":       # this request alone failed: not the worker
                        raise APIError(d["error"], status=503, type="server_error",
                                       code="request_failed")
                    if kind == "engine":        # its engine failed: route around it
                        w.healthy, w.error = False, f"engine failed: {d['error']}"[:300]
                    raise WorkerFailed(f"decode worker {w.url}: {d['error']}", sent)
                sent += 1
                yield d
                if d["finished"]:
                    return
        except (httpx.HTTPError, json.JSONDecodeError) as e:
            w.healthy, w.error = False, f"{type(e).__name__}: {e}"
            raise WorkerFailed(f"decode worker {w.url} failed: {type(e).__name__}: {e}",
                                sent) from None
        raise WorkerFailed(f"decode worker {w.url} ended the stream early", sent)

    def _body(self, ids, params, rid, prefilled):
        return {"request_id": rid, "prompt_ids": ids, "params": params.__dict__,
                "prefilled": prefilled, "transfer_timeout_s": self.cfg.transfer_timeout_s}

    async def _open(self, w: Worker, body: dict):
        try:
            req = self.http.build_request("POST", f"{w.url}/internal/generate", json=body)
            resp = await self.http.send(req, stream=True)
        except httpx.HTTPError as e:
            w.healthy, w.error = False, f"{type(e).__name__}: {e}"
            raise WorkerFailed(f"decode worker {w.url} unreachable: {e!r}", 0) from None
        if resp.status_code != 200:
            text = (await resp.aread()).decode(errors="replace")[:300]
            await resp.aclose()
            raise WorkerFailed(f"decode worker {w.url}: HTTP {resp.status_code} {text}", 0)
        return resp

    async def _stream(self, w: Worker, ids, params, rid, prefilled):
        w.inflight += 1
        resp = None
        try:
            resp = await self._open(w, self._body(ids, params, rid, prefilled))
            async for d in self._lines(w, resp, rid):
                yield _out(d, rid)
        finally:
            w.inflight -= 1
            if resp is not None:
                await resp.aclose()

    async def _remote(self, p: Worker, d: Worker, ids, params, rid):
        p.inflight += 1
        d.inflight += 1
        resp = prefill = first = None
        try:
            resp = await self._open(d, self._body(ids, params, rid, True))
            lines = self._lines(d, resp, rid)
            prefill = asyncio.ensure_future(self.http.post(
                f"{p.url}/internal/prefill", timeout=self.cfg.transfer_timeout_s + 60,
                json={"request_id": rid, "prompt_ids": ids, "params": params.__dict__,
                      "dest": d.info["transfer_address"]}))
            first = asyncio.ensure_future(anext(lines))
            done, _ = await asyncio.wait({prefill, first}, return_when=asyncio.FIRST_COMPLETED)
            if prefill in done and first not in done:
                self._check_prefill(p, prefill)
            try:
                line = await first
            except WorkerFailed as e:
                if prefill.done():
                    self._check_prefill(p, prefill)
                raise _Fallback(str(e)) from None
            yield _out(line, rid)
            async for x in lines:
                yield _out(x, rid)
        finally:
            p.inflight -= 1
            d.inflight -= 1
            for t in (first, prefill):
                if t is not None and not t.done():
                    t.cancel()
            if prefill is not None and prefill.done() and not prefill.cancelled() \
                    and prefill.exception() is None and prefill.result().status_code == 200:
                self.egress.add(int(prefill.result().json().get("bytes", 0)))
            if resp is not None:
                await resp.aclose()

    def _check_prefill(self, p: Worker, task) -> None:
        err = task.exception()
        if err is not None:
            if isinstance(err, httpx.TransportError):
                p.healthy, p.error = False, f"{type(err).__name__}: {err}"
            raise _Fallback(f"prefill worker {p.url} failed: {type(err).__name__}: {err}")
        r = task.result()
        if r.status_code != 200:
            raise _Fallback(f"prefill worker {p.url}: HTTP {r.status_code} {r.text[:200]}")
