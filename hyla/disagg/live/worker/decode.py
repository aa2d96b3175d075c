"""The decode role (``hyla serve --role decode``): a full prefill/decode (PD) worker that
also decodes from states shipped by prefill workers.

It serves the normal OpenAI-compatible API of :mod:`hyla.serve.api` and adds:

- ``POST /internal/generate`` ``{request_id, prompt_ids, params, prefilled,
  transfer_timeout_s}``: streams the request's outputs as NDJSON, one
  :class:`~hyla.serve.engine.StepOutput` a line (``token_ids``, ``text``, ``finished``,
  ``finish_reason``, ``logprobs``, ``num_prompt_tokens``, ``num_output_tokens``). With
  ``prefilled`` it first waits for the state to arrive on its transfer socket; a rejected
  or late transfer is one line ``{"error": ..., "kind": "transfer"}`` (the router then
  re-runs the prompt locally). Other errors: ``kind`` ``invalid``, ``busy`` or ``engine``.
- ``GET /internal/info``: role, pid, transfer address, model fingerprint, load.
"""

from __future__ import annotations

import asyncio
import json
import os

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from hyla.disagg.live.transfer.frames import TransferError, model_fingerprint
from hyla.disagg.live.transfer.net import StateReceiver, fault_injection_enabled
from hyla.disagg.live.worker.prefill import logprob_to_dict, params_from_dict
from hyla.serve.api.limits import bearer_ok
from hyla.serve.api.schemas import error_body
from hyla.serve.async_engine import AsyncEngine, EngineFailed, QueueFull, RequestFailed


def _line(**fields) -> bytes:
    return (json.dumps(fields, separators=(",", ":")) + "\n").encode()


def add_decode_routes(app: FastAPI, engine: AsyncEngine, receiver: StateReceiver,
                      fingerprint: str, api_key: str | None = None) -> None:
    """Add the internal routes of a decode worker to ``app`` (made by ``create_app``)."""
    tok = engine.engine.tokenizer

    def health_problem() -> str | None:
        """Why this worker cannot serve (None: it can)."""
        if not engine.alive:
            return f"the engine is dead: {engine.error!r}"
        if not receiver.alive:
            return "the state receiver stopped"
        return None
    load = {"queued_prompt_tokens": 0, "inflight": 0, "served": 0, "prefilled": 0}
    faults: dict = {}

    def authorized(request: Request) -> bool:
        return bearer_ok(request.headers.get("authorization"), api_key)

    async def stream(rid, prompt, params, prefilled, timeout):
        load["inflight"] += 1
        queued = 0 if prefilled else len(prompt)
        load["queued_prompt_tokens"] += queued
        gen = None
        try:
            if prefilled:
                try:
                    tr = await receiver.wait(rid, timeout)
                except TransferError as e:
                    yield _line(error=str(e), kind="transfer")
                    return
                load["prefilled"] += 1
                first = tr.first_token
                yield _line(token_ids=[first], text="", finished=False, finish_reason=None,
                            logprobs=[tr.logprob] if tr.logprob else [],
                            num_prompt_tokens=len(prompt), num_output_tokens=1)
                gen = engine.generate(prompt, params, rid, prefilled=(first, tr.state))
            else:
                gen = engine.generate(prompt, params, rid)
            n = 0
            async for o in gen:
                if queued:
                    load["queued_prompt_tokens"] -= queued
                    queued = 0
                text = o.text
                if prefilled and n == 0 and o.finished and not o.token_ids \
                        and o.finish_reason != "stop" and tok is not None:
                    text = tok.decode([first])      # the shipped token ended it: its text
                n += 1
                plps = None if o.prompt_logprobs is None else [
                    logprob_to_dict(x) for x in o.prompt_logprobs]
                yield _line(token_ids=o.token_ids, text=text, finished=o.finished,
                            finish_reason=o.finish_reason,
                            logprobs=[logprob_to_dict(x) for x in o.logprobs],
                            num_prompt_tokens=o.num_prompt_tokens,
                            num_output_tokens=o.num_output_tokens,
                            prompt_logprobs=plps)
                if faults.get("stream_delay_s"):
                    await asyncio.sleep(faults["stream_delay_s"])
            load["served"] += 1
        except ValueError as e:
            yield _line(error=str(e), kind="invalid")
        except QueueFull as e:
            yield _line(error=f"the decode worker is busy: {e}", kind="busy")
        except RequestFailed as e:          # this request alone: the router does not retry
            yield _line(error=str(e), kind="request")
        except (EngineFailed, RuntimeError) as e:
            yield _line(error=str(e), kind="engine")
        finally:
            load["queued_prompt_tokens"] -= queued
            load["inflight"] -= 1
            if gen is not None:
                await gen.aclose()

    @app.post("/internal/generate")
    async def generate(request: Request):
        if not authorized(request):
            return JSONResponse(error_body("bad API key", code="invalid_api_key"), 401)
        try:
            body = await request.json()
            params = params_from_dict(body["params"])
            prompt = [int(t) for t in body["prompt_ids"]]
            rid = str(body["request_id"])
            prefilled = bool(body.get("prefilled", False))
            timeout = float(body.get("transfer_timeout_s", 30.0))
        except (ValueError, KeyError, TypeError) as e:
            return JSONResponse(error_body(f"bad generate request: {e}"), 400)
        return StreamingResponse(stream(rid, prompt, params, prefilled, timeout),
                                 media_type="application/x-ndjson")

    @app.get("/internal/info")
    async def info(request: Request):
        if not authorized(request):
            return JSONResponse(error_body("bad API key", code="invalid_api_key"), 401)
        e = engine.engine
        s = e.stats
        tps = s["prompt_tokens"] / s["prefill_time_s"] if s["prefill_time_s"] > 0 else 20_000.0
        problem = health_problem()
        body = {"status": "ok" if problem is None else "error", "error": problem,
                "role": "decode",
                "pid": os.getpid(), "fingerprint": fingerprint,
                "transfer_address": receiver.address, "running": e.scheduler.num_running,
                "waiting": engine.num_waiting, "max_num_seqs": e.config.max_num_seqs,
                "max_model_len": e.config.max_model_len, "tokens_per_s": tps,
                "block_size": e.config.block_size,
                "queue_s": load["queued_prompt_tokens"] / tps, **load,
                "prefill_time_s": s["prefill_time_s"], "decode_time_s": s["decode_time_s"],
                "engine_stats": dict(s), "transfers": dict(receiver.stats),
                # states shipped without a cached prefix's rows: loaded after the cached
                # blocks, or (evicted meanwhile) the prompt computed here
                "shipped_prefix": {"hits": e.scheduler.shipped_prefix_hits,
                                   "misses": e.scheduler.shipped_prefix_misses},
                "engine_restarts": engine.restarts}
        return JSONResponse(body, 200 if problem is None else 503)

    if fault_injection_enabled():
        @app.post("/internal/fault")
        async def fault(request: Request):
            if not authorized(request):
                return JSONResponse(error_body("bad API key", code="invalid_api_key"), 401)
            body = await request.json()
            if body.pop("engine_dead", False):      # the engine dies, the process stays up
                engine.on_dead = None
                engine._die(RuntimeError("fault injection: engine dead"))
            if body.pop("clear", False):
                faults.clear()
            faults.update(body)
            return {"ok": True, "faults": faults}


def build_decode_worker(model, tok, name: str, engine_config, *, max_waiting: int = 256,
                        api_key: str | None = None, transfer_bind: str = "tcp://127.0.0.1:0",
                        advertise_host: str | None = None, stall_s: float = 30.0,
                        transfer_key: bytes | None = None, on_dead=None,
                        internal_key: bytes | None = None, draft_model=None):
    """(app, async engine, receiver) of a decode worker; the caller shuts both down.
    ``transfer_key``: the HMAC key every shipped state's frames must carry;
    ``internal_key``: with it, every ``/internal/*`` call must be signed
    (:mod:`hyla.disagg.live.internal_auth`); ``on_dead``:
    called if the engine dies (the role exits non-zero so a supervisor restarts it);
    ``draft_model``: ``--speculative draft:SOURCE``'s (:class:`~hyla.serve.engine.Engine`)."""
    from hyla.model.state import SequenceState
    from hyla.serve.api.app import create_app
    from hyla.serve.engine import Engine
    from hyla.serve.sequence import SamplingParams

    engine = Engine(model, tok, engine_config, draft_model=draft_model)
    engine.generate([[0]], SamplingParams(max_tokens=2, temperature=0))     # warm-up
    async_engine = AsyncEngine(engine, max_waiting=max_waiting, on_dead=on_dead)
    fp = model_fingerprint(model)
    receiver = StateReceiver(fp, SequenceState.empty(model.cfg).kinds, bind=transfer_bind,
                             stall_s=stall_s, advertise_host=advertise_host, key=transfer_key,
                             vocab_size=model.cfg.vocab_size)
    app = create_app(async_engine, model_name=name, api_key=api_key,
                     health_check=lambda: None if receiver.alive else "the state receiver stopped")
    add_decode_routes(app, async_engine, receiver, fp, api_key)
    if internal_key is not None:
        from hyla.disagg.live.internal_auth import InternalAuthMiddleware

        app.add_middleware(InternalAuthMiddleware, key=internal_key)
    return app, async_engine, receiver
