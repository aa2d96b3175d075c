"""The prefill role (``hyla serve --role prefill``): prefill prompts, ship their states.

A prefill worker takes internal requests ``POST /internal/prefill`` with ``{request_id,
prompt_ids, params, dest}`` (``dest``: the decode worker's transfer address), prefills them
one at a time on a :class:`~hyla.serve.runner.Runner` (the next one while the last state is
still on the link), ships each layer's state to ``dest`` as soon as that layer is final
(:class:`~hyla.disagg.transfer_net.StateSender`, paced to ``--link-gbps``), samples the
first token and answers with it and the transfer's figures once the state is sent.
``GET /health`` and ``GET /internal/info`` report its queue, prefill throughput and egress.
"""

from __future__ import annotations

import asyncio
import os
import queue
import threading
import time

import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from hyla.disagg.transfer import model_fingerprint
from hyla.disagg.transfer_net import StateSender, fault_injection_enabled
from hyla.serve.api_schemas import error_body
from hyla.serve.runner import Runner
from hyla.serve.sampler import sample
from hyla.serve.sequence import SamplingParams


def params_from_dict(d: dict) -> SamplingParams:
    """SamplingParams from its JSON form (lists back to tuples); ValueError if invalid."""
    try:
        return SamplingParams(**d)
    except TypeError as e:
        raise ValueError(f"params: {e}") from None


def logprob_to_dict(lp) -> dict | None:
    return None if lp is None else {"token": lp.token, "logprob": lp.logprob,
                                    "top": [list(x) for x in lp.top]}


class PrefillService:
    """Serial prefill with layer-wise state shipping.

    Example:
        >>> import asyncio
        >>> from hyla.model import HylaLM, preset
        >>> from hyla.disagg.transfer_net import StateReceiver
        >>> svc = PrefillService(HylaLM(preset("debug")), max_model_len=64)
        >>> rx = StateReceiver(svc.fingerprint, svc.kinds)
        >>> r = svc.run_sync("r1", [1, 2, 3], SamplingParams(temperature=0), rx.address)
        >>> r["layers"], asyncio.run(rx.wait("r1", 10)).state.num_tokens
        (4, 3)
        >>> svc.close(); rx.close()
    """

    def __init__(self, model, *, max_model_len: int, block_size: int = 16,
                 chunk_tokens: int = 2048, link_gbps: float | None = None):
        self.model = model.eval()
        self.max_model_len, self.block_size, self.chunk = max_model_len, block_size, chunk_tokens
        self.kinds = [b.kind for b in model.blocks]
        has_attn = "attention" in self.kinds
        self.runner = Runner(model, max_num_seqs=1, block_size=block_size,
                             num_kv_blocks=-(-max_model_len // block_size) if has_attn else 0)
        self.fingerprint = model_fingerprint(model)
        self.sender = StateSender(self.fingerprint, link_gbps)
        self.link_gbps = link_gbps
        self.faults: dict = {}
        self.stats = {"requests": 0, "failed": 0, "prompt_tokens": 0, "prefill_s": 0.0,
                      "busy_s": 0.0}
        self.queued_tokens = 0
        self.started = time.monotonic()
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
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

    def info(self) -> dict:
        return {"role": "prefill", "pid": os.getpid(), "fingerprint": self.fingerprint,
                "queued_tokens": self.queued_tokens, "queue_s": self.queued_tokens /
                self.tokens_per_s, "tokens_per_s": self.tokens_per_s,
                "egress_gbps": self.sender.meter.gbps(), "bytes_sent": self.sender.meter.total,
                "link_gbps": self.link_gbps, "busy": self.stats["busy_s"] /
                max(1e-9, time.monotonic() - self.started), **self.stats}

    async def submit(self, rid: str, prompt: list[int], params: SamplingParams,
                     dest: str) -> dict:
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._check(prompt)
        with self._lock:
            self.queued_tokens += len(prompt)
        self._jobs.put((rid, prompt, params, dest, loop, fut))
        return await fut

    def run_sync(self, rid: str, prompt: list[int], params: SamplingParams, dest: str) -> dict:
        """Prefill in the calling thread (tests, tools)."""
        self._check(prompt)
        return self._finish(*self._prefill(rid, prompt, params, dest))

    def close(self) -> None:
        self._jobs.put(None)
        self._thread.join(timeout=10)
        self._shipping.put(None)
        self._shipper.join(timeout=10)
        self.sender.close()

    def _check(self, prompt: list[int]) -> None:
        vocab = self.model.cfg.vocab_size
        if not prompt or len(prompt) > self.max_model_len:
            raise ValueError(f"the prompt must hold 1 to {self.max_model_len} tokens, got "
                             f"{len(prompt)}")
        if any(not 0 <= t < vocab for t in prompt):
            raise ValueError(f"prompt token ids must be in [0, {vocab})")

    def _loop(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            rid, prompt, params, dest, loop, fut = job
            t0 = time.monotonic()
            try:
                shipping = self._prefill(rid, prompt, params, dest)
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

    @torch.no_grad()
    def _prefill(self, rid, prompt, params, dest) -> tuple:
        """Prefill ``prompt``, queueing each layer's state on the link as it is final;
        returns what :meth:`_finish` needs once the transfer is done."""
        r, n, bs = self.runner, len(prompt), self.block_size
        out = self.sender.start(rid, dest, self.kinds, n)
        table = list(range(-(-n // bs))) if r.attn_layers else []
        delay = float(self.faults.get("layer_delay_s", 0.0))

        def on_layer(i: int) -> None:
            if delay:
                time.sleep(delay)
            if i in r.states:
                tensors = (r.states[i][0].clone(),)
            else:
                tensors = tuple(t.clone() for t in r.layer_kv(i, table, n))
            out.layer(i, self.kinds[i], tensors)

        t0 = time.perf_counter()
        try:
            r.reset_slot(0)
            for start in range(0, n, self.chunk):
                last = start + self.chunk >= n
                logits = r.prefill([(0, prompt[start:start + self.chunk], start, table)],
                                   on_layer=on_layer if last else None)
            gen = None
            if params.seed is not None and not params.greedy:
                gen = torch.Generator(device=r.device).manual_seed(params.seed)
            tokens, lps = sample(logits, [params], [gen])
        except Exception as e:
            out.abort(f"prefill failed: {e!r}")
            raise
        prefill_s = time.perf_counter() - t0
        lp = logprob_to_dict(lps[0])
        out.end(tokens[0], lp)
        self.stats["prompt_tokens"] += n
        self.stats["prefill_s"] += prefill_s
        return out, {"request_id": rid, "first_token": tokens[0], "logprob": lp,
                     "prefill_s": prefill_s}

    def _finish(self, out, result: dict) -> dict:
        """Wait for a prefilled request's state to be sent; its answer to the router."""
        stats = out.wait(timeout=3600)
        if stats["error"]:
            raise RuntimeError(f"sending the state failed: {stats['error']}")
        self.stats["requests"] += 1
        return {**result, "bytes": stats["bytes"], "layers": stats["layers"],
                "transfer_s": stats["seconds"]}


def _resolve(fut, result) -> None:
    if fut.done():
        return
    if isinstance(result, BaseException):
        fut.set_exception(result)
    else:
        fut.set_result(result)


def create_prefill_app(svc: PrefillService, api_key: str | None = None) -> FastAPI:
    """The prefill worker's HTTP app (internal API; ``api_key`` guards ``/internal/*``)."""
    app = FastAPI(title="hyla prefill worker")

    def authorized(request: Request) -> bool:
        return not api_key or request.headers.get("authorization") == f"Bearer {api_key}"

    @app.post("/internal/prefill")
    async def prefill(request: Request):
        if not authorized(request):
            return JSONResponse(error_body("bad API key", code="invalid_api_key"), 401)
        try:
            body = await request.json()
            params = params_from_dict(body["params"])
            return await svc.submit(str(body["request_id"]), list(body["prompt_ids"]),
                                    params, str(body["dest"]))
        except (ValueError, KeyError, TypeError) as e:
            return JSONResponse(error_body(f"bad prefill request: {e}"), 400)
        except Exception as e:  # noqa: BLE001
            return JSONResponse(error_body(f"prefill failed: {e!r}", "server_error"), 500)

    @app.get("/health")
    @app.get("/internal/info")
    async def info():
        return {"status": "ok", **svc.info()}

    if fault_injection_enabled():
        @app.post("/internal/fault")
        async def fault(request: Request):
            body = await request.json()
            if body.get("clear"):
                svc.sender.faults.clear()
                svc.faults.clear()
            for k in ("corrupt", "drop_after_layer", "fingerprint"):
                if k in body:
                    svc.sender.faults[k] = body[k]
            if "layer_delay_s" in body:
                svc.faults["layer_delay_s"] = body["layer_delay_s"]
            return {"ok": True, "sender": svc.sender.faults, "service": svc.faults}

    return app
