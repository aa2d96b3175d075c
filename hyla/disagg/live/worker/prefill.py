"""The prefill role (``hyla serve --role prefill``): prefill prompts, ship their states.

A prefill worker takes internal requests ``POST /internal/prefill`` with ``{request_id,
prompt_ids, params, dest, prefix_tokens}`` (``dest``: the decode worker's transfer address;
``prefix_tokens``, optional: how much of the prompt that worker's prefix cache holds, whose
rows of growing state it is not sent, :meth:`~hyla.model.state.SequenceState.suffix`). It prefills
them one at a time on an :class:`~hyla.serve.engine.Engine` as prefill-only requests (the
engine checks the prompt, seeds the sampler, chunks the prompt, samples the first token and
hands over the :class:`~hyla.model.state.SequenceState`), ships each state whole to
``dest`` (:class:`~hyla.disagg.live.transfer.net.StateSender`, paced to ``--link-gbps``)
while it goes on to the next prompt, and answers with the first token and the transfer's
figures once the decode worker has acknowledged the state (a state that is rejected or not
acknowledged within the request's ``deadline_s`` is a 502 ``transfer_failed``). ``GET
/health`` and ``GET /internal/info`` report its queue, prefill throughput and egress.
"""

from __future__ import annotations

import asyncio
import os
import queue
import threading
import time

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from hyla.disagg.live.internal_auth import InternalAuthMiddleware
from hyla.disagg.live.transfer.frames import model_fingerprint
from hyla.disagg.live.transfer.net import StateSender, fault_injection_enabled
from hyla.model.state import SequenceState
from hyla.serve.api.limits import bearer_ok
from hyla.serve.api.schemas import error_body
from hyla.serve.engine import Engine, EngineConfig
from hyla.serve.sequence import SamplingParams


def params_from_dict(d: dict) -> SamplingParams:
    """SamplingParams from its JSON form (lists back to tuples); ValueError if invalid."""
    return SamplingParams.from_dict(d)


class TransferFailed(RuntimeError):
    """The state was not acknowledged by the decode worker (rejected, or its deadline
    passed); ``stats`` are the transfer's figures (answered to the router, which counts
    the failure against the link)."""

    def __init__(self, msg: str, stats: dict):
        super().__init__(msg)
        self.stats = stats


def logprob_to_dict(lp) -> dict | None:
    return None if lp is None else {"token": lp.token, "logprob": lp.logprob,
                                    "top": [list(x) for x in lp.top]}


class PrefillService:
    """Serial prefill on an engine, each state shipped while the next prompt prefills.

    ``chunk_tokens``: the engine's prefill chunk (``max_num_batched_tokens``).

    Example:
        >>> import asyncio
        >>> from hyla.model import HylaLM, preset
        >>> from hyla.disagg.live.transfer.net import StateReceiver
        >>> svc = PrefillService(HylaLM(preset("debug")), max_model_len=64)
        >>> rx = StateReceiver(svc.fingerprint, svc.kinds)
        >>> r = svc.run_sync("r1", [1, 2, 3], SamplingParams(temperature=0), rx.address)
        >>> r["chunks"], asyncio.run(rx.wait("r1", 10)).state.num_tokens
        (1, 3)
        >>> svc.close(); rx.close()
    """

    def __init__(self, model, *, max_model_len: int, block_size: int = 16,
                 chunk_tokens: int = 2048, link_gbps: float | None = None,
                 key: bytes | None = None, allowed: set[str] | None = None,
                 tokenizer=None):
        """``key``: the transfer channel's HMAC key; ``allowed``: the decode workers'
        transfer addresses it may send to (None: any; the router sets them,
        :meth:`register`). ``tokenizer``: what a request's grammar needs to mask the
        first token (the decode worker's matcher takes the rest)."""
        self.model = model.eval()
        # one sequence at a time (a serial prefill instance); no prefix cache: the router
        # counts none on the remote pool
        self.engine = Engine(model, tokenizer, EngineConfig(
            max_num_seqs=1, max_num_batched_tokens=chunk_tokens, max_model_len=max_model_len,
            block_size=block_size, enable_prefix_caching=False))
        self.kinds = SequenceState.empty(model.cfg).kinds
        self.fingerprint = model_fingerprint(model)
        self.sender = StateSender(self.fingerprint, link_gbps, key=key, allowed=allowed)
        self.link_gbps = link_gbps
        self.faults: dict = {}
        self.stats = {"requests": 0, "failed": 0, "prompt_tokens": 0, "prefill_s": 0.0,
                      "busy_s": 0.0}
        self.queued_tokens = 0
        self.started = time.monotonic()
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._engine_lock = threading.Lock()
        self._thread = threading.Thread(target=self._loop, name="hyla-prefill", daemon=True)
        self._thread.start()
        # Transfers finish in order on the sender's one link; waiting for them here lets
        # the prefill thread go on to the next prompt while the last state is still shipping.
        self._shipping: queue.SimpleQueue = queue.SimpleQueue()
        self._shipper = threading.Thread(target=self._ship_loop, name="hyla-prefill-ship",
                                         daemon=True)
        self._shipper.start()

    @property
    def tokens_per_s(self) -> float:
        s = self.stats
        return s["prompt_tokens"] / s["prefill_s"] if s["prefill_s"] > 0 else 20_000.0

    def register(self, addresses: list[str]) -> None:
        """The decode workers (transfer addresses) the router has: the only destinations."""
        if not isinstance(addresses, list) or not all(isinstance(a, str) for a in addresses):
            raise ValueError("decode must be a list of tcp:// addresses")
        self.sender.allowed = set(addresses[:1024])

    @property
    def problem(self) -> str | None:
        """Why this worker cannot serve (None: it can)."""
        dead = [t.name for t in (self._thread, self._shipper, self.sender._thread)
                if not t.is_alive()]
        return f"threads stopped: {dead}" if dead else None

    def info(self) -> dict:
        return {"role": "prefill", "pid": os.getpid(), "fingerprint": self.fingerprint,
                "sockets": self.sender.num_sockets,
                "registered_decode": len(self.sender.allowed or ()),
                "queued_tokens": self.queued_tokens, "queue_s": self.queued_tokens /
                self.tokens_per_s, "tokens_per_s": self.tokens_per_s,
                "egress_gbps": self.sender.meter.gbps(), "bytes_sent": self.sender.meter.total,
                "link_gbps": self.link_gbps, "busy": self.stats["busy_s"] /
                max(1e-9, time.monotonic() - self.started), **self.stats}

    async def submit(self, rid: str, prompt: list[int], params: SamplingParams,
                     dest: str, deadline_s: float | None = None,
                     prefix_tokens: int = 0) -> dict:
        """Queue a prompt; its answer once the decode worker acknowledged its state
        (``deadline_s``: from the first byte sent to that acknowledgement; the router
        derives it from its link estimate). ValueError (before queueing) if the engine
        could never run it."""
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self.engine.check_request(prompt, params, prefill_only=True)
        self.sender.check_dest(dest)
        if type(prefix_tokens) is not int or not 0 <= prefix_tokens <= len(prompt):
            raise ValueError(f"prefix_tokens must be an int in [0, {len(prompt)}] (the "
                             f"prompt's length), got {prefix_tokens!r}")
        with self._lock:
            self.queued_tokens += len(prompt)
        self._jobs.put((rid, prompt, params, dest, loop, fut, deadline_s, prefix_tokens))
        return await fut

    def run_sync(self, rid: str, prompt: list[int], params: SamplingParams, dest: str,
                 deadline_s: float | None = None, prefix_tokens: int = 0) -> dict:
        """Prefill in the calling thread (tests, tools)."""
        return self._finish(*self._prefill(rid, prompt, params, dest, deadline_s,
                                           prefix_tokens))

    def close(self) -> None:
        self._jobs.put(None)
        self._thread.join(timeout=10)
        self._shipping.put(None)
        self._shipper.join(timeout=10)
        self.sender.close()

    def _loop(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            rid, prompt, params, dest, loop, fut, deadline_s, prefix_tokens = job
            t0 = time.monotonic()
            try:
                shipping = self._prefill(rid, prompt, params, dest, deadline_s, prefix_tokens)
            except Exception as e:  # noqa: BLE001 - answered to the router
                self.stats["failed"] += 1
                shipping = None
                loop.call_soon_threadsafe(_resolve, fut, e)
            with self._lock:
                self.queued_tokens -= len(prompt)
            self.stats["busy_s"] += time.monotonic() - t0
            if shipping is not None:
                self._shipping.put((shipping, loop, fut))

    def _ship_loop(self) -> None:
        while True:
            job = self._shipping.get()
            if job is None:
                return
            shipping, loop, fut = job
            try:
                result = self._finish(*shipping)
            except Exception as e:  # noqa: BLE001 - answered to the router
                self.stats["failed"] += 1
                result = e
            loop.call_soon_threadsafe(_resolve, fut, result)

    def _prefill(self, rid, prompt, params, dest, deadline_s=None, prefix_tokens=0) -> tuple:
        """Prefill ``prompt`` on the engine (prefill-only) and queue its state on the link,
        without the growing rows of its first ``prefix_tokens`` (the decode worker's cache
        holds them); returns what :meth:`_finish` needs once the transfer is done."""
        delay = float(self.faults.get("prefill_delay_s", 0.0))
        if delay:
            time.sleep(delay)
        t0 = time.perf_counter()
        done = None
        with self._engine_lock:
            eng = self.engine
            eng.add_request(prompt, params, rid, prefill_only=True)
            try:
                while done is None and eng.has_unfinished():
                    done = next((o for o in eng.step() if o.request_id == rid), None)
            except BaseException:
                eng.abort(rid)
                raise
        if done is None or done.state is None:
            why = done.error if done is not None else "the engine did not run it"
            raise RuntimeError(f"prefill of {rid!r} produced no state: {why}")
        prefill_s = time.perf_counter() - t0
        first = done.token_ids[0]
        lp = logprob_to_dict(done.logprobs[0]) if done.logprobs else None
        state = done.state
        if prefix_tokens:
            state = state.suffix(prefix_tokens, self.model.state_specs)
        out = self.sender.send(rid, dest, state, first, lp, deadline_s=deadline_s)
        self.stats["prompt_tokens"] += len(prompt)
        self.stats["prefill_s"] += prefill_s
        return out, {"request_id": rid, "first_token": first, "logprob": lp,
                     "prefill_s": prefill_s, "prefix_tokens": prefix_tokens}

    def _finish(self, out, result: dict) -> dict:
        """Wait for a prefilled request's state to be sent; its answer to the router."""
        stats = out.wait(timeout=3600)
        if stats["error"]:
            raise TransferFailed(f"sending the state failed: {stats['error']}", stats)
        self.stats["requests"] += 1
        return {**result, "bytes": stats["bytes"], "chunks": stats["chunks"],
                "transfer_s": stats["seconds"], "wire_s": stats["wire_s"],
                "queued_s": stats["queued_s"], "acked": True}


def _resolve(fut, result) -> None:
    if fut.done():
        return
    if isinstance(result, BaseException):
        fut.set_exception(result)
    else:
        fut.set_result(result)


def create_prefill_app(svc: PrefillService, api_key: str | None = None,
                       internal_key: bytes | None = None) -> FastAPI:
    """The prefill worker's HTTP app (internal API; ``api_key`` guards ``/internal/*``, and
    with ``internal_key`` (from the cluster secret) every call there must be signed:
    :mod:`hyla.disagg.live.internal_auth`)."""
    app = FastAPI(title="hyla prefill worker")
    if internal_key is not None:
        app.add_middleware(InternalAuthMiddleware, key=internal_key)

    def authorized(request: Request) -> bool:
        return bearer_ok(request.headers.get("authorization"), api_key)

    def denied():
        return JSONResponse(error_body("bad API key", code="invalid_api_key"), 401)

    @app.post("/internal/prefill")
    async def prefill(request: Request):
        if not authorized(request):
            return denied()
        try:
            body = await request.json()
            params = params_from_dict(body["params"])
            prompt = body["prompt_ids"]
            if not isinstance(prompt, list) or not all(type(t) is int for t in prompt):
                raise ValueError("prompt_ids must be a list of ints")
            deadline = body.get("deadline_s")
            if deadline is not None and not (isinstance(deadline, int | float)
                                             and 0 < deadline <= 3600):
                raise ValueError(f"deadline_s must be a number in (0, 3600], got {deadline!r}")
            return await svc.submit(str(body["request_id"]), prompt, params, body["dest"],
                                    deadline, body.get("prefix_tokens", 0))
        except TransferFailed as e:
            return JSONResponse(error_body(str(e), "server_error", code="transfer_failed")
                                | {"transfer": {k: e.stats.get(k) for k in
                                                ("bytes", "seconds", "error", "queued_s")}},
                                502)
        except (ValueError, KeyError, TypeError) as e:
            return JSONResponse(error_body(f"bad prefill request: {e}"), 400)
        except Exception as e:  # noqa: BLE001
            return JSONResponse(error_body(f"prefill failed: {e!r}", "server_error"), 500)

    @app.post("/internal/registry")
    async def registry(request: Request):
        if not authorized(request):
            return denied()
        try:
            svc.register((await request.json())["decode"])
        except (ValueError, KeyError, TypeError) as e:
            return JSONResponse(error_body(f"bad registry: {e}"), 400)
        return {"ok": True, "decode": len(svc.sender.allowed or ())}

    @app.get("/health")
    async def health():
        problem = svc.problem
        return JSONResponse({"status": "ok" if problem is None else "error",
                             "error": problem}, 200 if problem is None else 503)

    @app.get("/internal/info")
    async def info(request: Request):
        if not authorized(request):
            return denied()
        problem = svc.problem
        return JSONResponse({"status": "ok" if problem is None else "error", "error": problem,
                             **svc.info()}, 200 if problem is None else 503)

    if fault_injection_enabled():
        @app.post("/internal/fault")
        async def fault(request: Request):
            if not authorized(request):
                return denied()
            body = await request.json()
            if body.get("clear"):
                svc.sender.faults.clear()
                svc.faults.clear()
            for k in ("corrupt", "stall_after_chunks", "fingerprint"):
                if k in body:
                    svc.sender.faults[k] = body[k]
            if "prefill_delay_s" in body:
                svc.faults["prefill_delay_s"] = body["prefill_delay_s"]
            return {"ok": True, "sender": svc.sender.faults, "service": svc.faults}

    return app
