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
throughput) and feeds the policy the link's utilisation (egress over the measured
capacity), the remote and local prefill queues and whether the remote pool is up.

The link is measured, not configured (:mod:`hyla.disagg.live.router.links`): every remote
request's transfer reports its bytes, wire time and end-to-end time (to the decode side's
acknowledgement); per prefill -> decode path the router keeps a throughput and latency
estimate and a circuit breaker, and the policy's cost model
(:meth:`~hyla.disagg.policy.prfaas.PrfaasRouter.check_link`) keeps a request local when
shipping its state would be slower than prefilling it here, or while the path is down,
but for a few probes. Each transfer's deadline comes from that estimate and the state's
size; past it the request is re-run locally. ``--link-gbps`` is only the initial estimate
(and the prefill workers' pacing cap).

``GET /cluster`` lists the workers (role, address, pid, health), the policy's state, each
path's ``links`` entry (``gbps_estimate``, ``rtt_s``, ``state`` ok/degraded/down,
``last_transfer_s``, ``probes_in_flight``), the routing counts and the long-timescale P/D
split recommendation.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import time
from dataclasses import dataclass, field

import httpx

from hyla.disagg.live.internal_auth import InternalAuth, internal_key
from hyla.disagg.live.router.links import LinkBook
from hyla.disagg.live.router.remote import RemotePath, WorkerFailed, _Fallback, _out
from hyla.disagg.live.router.workers import Worker  # noqa: F401  (re-exported)
from hyla.disagg.live.transfer.frames import EgressMeter
from hyla.disagg.policy import LOCAL, RouterConfig, build_policy, recommend_pd_split
from hyla.disagg.policy.link import LinkConfig
from hyla.disagg.policy.prefix_index import PrefixIndex, chunk_chain
from hyla.serve.api.app import (
    param_of,
)
from hyla.serve.api.schemas import APIError
from hyla.serve.sequence import SamplingParams

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
    transfer_timeout_s: float = 30.0       # the longest a shipped state may take
    # the measured link of each path (None: from policy.link_gbps and transfer_timeout_s)
    link: LinkConfig | None = None
    max_remote_inflight: int = 4
    poll_s: float = 0.5
    read_timeout_s: float = 120.0
    api_key: str | None = None
    # signs every /internal/* call (the workers refuse unsigned ones): the cluster secret
    cluster_secret: str | None = field(default=None, repr=False)
    force: str | None = None          # "local" / "remote": bypass the policy (benchmarks)
    # The PD workers' prefix caches as the router estimates them: prompts are indexed in
    # chunks of the engine's GLA snapshot interval, as many per worker as it keeps snapshots.
    prefix_chunk_tokens: int = 256
    prefix_capacity: int = 16
    # The decode workers' KV blocks as the router estimates them, answers included: a
    # remote request's state goes without the rows the chosen worker holds (any block
    # boundary will do there: the state's fixed-size part is shipped whole)
    kv_chunk_tokens: int = 16
    kv_capacity: int = 8192
    # ... unless that worker has more than this many requests beyond the least busy one's:
    # then the load is spread and the whole state shipped (a hot conversation prefix would
    # otherwise pile every request on one worker)
    kv_affinity_slack: int = 2


class LiveRouter(RemotePath):
    """Worker registry, policy and request paths (see the module docstring)."""

    def __init__(self, cfg: LiveRouterConfig, tokenizer):
        self.cfg, self.tok = cfg, tokenizer
        self.prefill = [Worker(u.rstrip("/"), "prefill") for u in cfg.prefill_urls]
        self.decode = [Worker(u.rstrip("/"), "decode") for u in cfg.decode_urls]
        self.policy = build_policy(cfg.policy)
        self.egress = EgressMeter(window_s=5.0)
        self.links = LinkBook(cfg.link or LinkConfig(initial_gbps=cfg.policy.link_gbps,
                                                     max_deadline_s=cfg.transfer_timeout_s))
        self.local_tps = self.remote_tps = 20_000.0     # prompt tokens/s, as measured
        self.prefix = PrefixIndex(cfg.prefix_chunk_tokens, cfg.prefix_capacity)
        self.kv_index = PrefixIndex(cfg.kv_chunk_tokens, cfg.kv_capacity)
        self.counts = {"local": 0, "remote": 0, "remote_ok": 0, "fallback_local": 0,
                       "decode_retries": 0, "failed_mid_stream": 0, "failed": 0,
                       "cached_local": 0, "cached_tokens": 0, "abandoned": 0, "probes": 0,
                       "shipped_after_prefix": 0, "prefix_tokens_not_shipped": 0}
        self.fallback_reasons: dict[str, int] = {}
        self.last_errors: list[str] = []
        self.t0 = time.monotonic()
        self._busy_prev: dict[str, tuple] = {}
        self.pd = {"note": "not measured yet"}
        self._rr = itertools.count()
        headers = {"authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
        auth = InternalAuth(internal_key(cfg.cluster_secret), role="router")
        self.http = httpx.AsyncClient(headers=headers, auth=auth, timeout=httpx.Timeout(
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
        self.local_tps = max((w.info.get("tokens_per_s", 0.0) for w in loc), default=0.0) \
            or self.local_tps
        self.remote_tps = max((w.info.get("tokens_per_s", 0.0) for w in up), default=0.0) \
            or self.remote_tps
        self.policy.observe(time.monotonic() - self.t0,
                            link_util=self.egress.gbps() / self.links.capacity_gbps(),
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
                           "link_gbps_measured": self.links.capacity_gbps(),
                           "egress_gbps": self.egress.gbps(), "link_util": p.link_util,
                           "remote_queue_s": p.remote_queue_s,
                           "local_queue_s": p.local_queue_s, "remote_up": p.remote_up,
                           "forced": self.cfg.force},
                "links": self.links.view(),
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
        decision, chain, cached_on = self._plan(ids)
        kv_chain = chunk_chain(ids, self.kv_index.chunk_tokens)
        target = decision if isinstance(decision, str) else decision.target
        if params.prompt_logprobs is not None:
            target = LOCAL          # prompt logprobs come from a PD worker's prefill
        if target == "remote":
            # forced remote (a baseline) queues at the prefill pool instead of falling back
            cap = None if self.cfg.force == "remote" else self.cfg.max_remote_inflight
            p = self._pick(self.prefill, cap=cap)
            # the decode worker holding the longest cached prefix, if any: it is sent the
            # state without that prefix's rows (its cache has them)
            up = [w for w in self.decode if w.healthy]
            kv_on, _ = self.kv_index.best(kv_chain, [w.url for w in up])
            least = min((w.inflight for w in up), default=0)
            if any(w.url == kv_on and w.inflight > least + self.cfg.kv_affinity_slack
                   for w in up):
                kv_on = None
            d = self._pick(self.decode, need_transfer=True, prefer=kv_on)
            ship = None
            if p is None or d is None:
                self._fallback("remote pool saturated or down" if p is None
                               else "no decode worker for a shipped state")
            else:
                held = self.kv_index.match(d.url, kv_chain)
                held -= held % int(d.info.get("block_size") or 1)
                ship = self._check_link(p, d, len(ids), decision, held)
            if ship is not None:
                self.counts["remote"] += 1
                self.counts["probes"] += ship.probe
                sent = 0
                try:
                    async for o in self._served(d, ids, chain, kv_chain, self._remote(
                            p, d, ids, params, rid, ship, held)):
                        if not sent:
                            self.counts["shipped_after_prefix"] += bool(held)
                            self.counts["prefix_tokens_not_shipped"] += held
                        sent += 1
                        self.counts["remote_ok"] += o.finished
                        yield o
                    return
                except _Fallback as e:
                    self._fallback(e.kind, str(e))
                except WorkerFailed as e:
                    if e.sent or sent:
                        raise
                    self._fallback("decode worker failed", str(e))
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
                async for o in self._served(w, ids, chain, kv_chain, self._stream(
                        w, ids, params, rid, prefilled=False)):
                    sent += 1
                    yield o
                return
            except WorkerFailed as e:
                self.prefix.forget(w.url)
                self.kv_index.forget(w.url)
                if sent:
                    raise WorkerFailed(str(e), sent) from None
                errors.append(str(e))
                self.counts["decode_retries"] += 1
        self.counts["failed"] += 1
        msg = "; ".join(errors) or "no healthy decode worker"
        raise APIError(f"No worker could serve the request: {msg}", status=503,
                       type="server_error", code="no_worker_available")

    async def _served(self, w: Worker, ids: list[int], chain: list[int], kv_chain: list[int],
                      outputs):
        """``outputs`` (a worker's stream), recording what its caches then hold: the prompt
        (``chain`` and ``kv_chain``, its chunks in either index) once it is prefilled there
        (its first output), the answer too once it ends."""
        answer: list[int] = []
        first = True
        async for o in outputs:
            if first:
                first = False
                self.prefix.insert(w.url, chain)
                self.kv_index.insert(w.url, kv_chain)
            answer += o.token_ids
            if o.finished:          # (the last token was sampled, never computed)
                self.kv_index.insert(w.url, chunk_chain(ids + answer[:-1],
                                                        self.kv_index.chunk_tokens))
            yield o

    def plan(self, ids: list[int]) -> tuple[str, list[int], str | None]:
        """(target, the prompt's chunk hashes, the PD worker holding its longest cached
        prefix) for a prompt: the policy decides on the incremental length.

        The remote pool keeps no prefix cache, so only the local side counts one (and a
        remote prefill recomputes the whole prompt)."""
        d, chain, cached_on = self._plan(ids)
        return (d if isinstance(d, str) else d.target), chain, cached_on

    def _plan(self, ids: list[int]):
        """:meth:`plan` with the policy's whole RouteDecision (the forced path: a str)."""
        chain = chunk_chain(ids, self.prefix.chunk_tokens)
        up = [w.url for w in self.decode if w.healthy]
        cached_on, cached = self.prefix.best(chain, up)
        if self.cfg.force:
            return self.cfg.force, chain, cached_on
        d = self.policy.route(len(ids), {LOCAL: cached}, time.monotonic() - self.t0)
        if d.target == LOCAL and d.cached_tokens:
            self.counts["cached_local"] += 1
            self.counts["cached_tokens"] += d.cached_tokens
        return d, chain, cached_on

    def _fallback(self, kind: str, detail: str | None = None) -> None:
        """Count a remote request re-run (or kept) locally under ``kind`` (a fixed phrase:
        ``fallback_reasons`` counts by it), with its ``detail`` in ``last_errors``."""
        self.counts["fallback_local"] += 1
        self.fallback_reasons[kind] = self.fallback_reasons.get(kind, 0) + 1
        self.record_error(f"fallback to local: {detail or kind}")

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
        return {"request_id": rid, "prompt_ids": ids, "params": params.as_dict(),
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
