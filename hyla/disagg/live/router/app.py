"""The router role's HTTP app: OpenAI-compatible routes plus ``GET /cluster``.

Request parsing, checks and response formatting are the single-server API's
(:mod:`hyla.serve.api`), so a client cannot tell the cluster from one ``hyla serve``; the
routing itself is :class:`hyla.disagg.live.router.LiveRouter`'s.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse

from hyla.disagg.live.router.core import LiveRouter, WorkerFailed
from hyla.serve.api.app import (
    chat_setup,
    completion_setup,
    grammar_setup,
    prompt_token_ids,
    validation_error,
)
from hyla.serve.api.format import Formatter, Result
from hyla.serve.api.limits import (
    DEFAULT_MAX_BODY_BYTES,
    APIKeyMiddleware,
    BodyLimitMiddleware,
    PromptEncoder,
)
from hyla.serve.api.schemas import APIError, ChatCompletionRequest, CompletionRequest, error_body
from hyla.serve.api.tokens import add_tokenizer_routes


def _error_event(msg: str) -> str:
    return f"data: {json.dumps(error_body(msg, 'server_error'))}\n\n"


class _ClientGone(Exception):
    pass


async def until_disconnect(request: Request, awaitable):
    """Await ``awaitable``, cancelling it if the client disconnects meanwhile (which closes
    the decode worker's stream, so the worker aborts the request and frees its slot)."""
    task = asyncio.ensure_future(awaitable)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=0.25)
            if done:
                return task.result()
            if await request.is_disconnected():
                task.cancel()
                raise _ClientGone
    except asyncio.CancelledError:
        task.cancel()
        raise


def params_is_list(params) -> bool:
    return isinstance(params, list)


def create_router_app(router: LiveRouter, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
                      ) -> FastAPI:
    """The router's FastAPI app: the OpenAI API of :mod:`hyla.serve.api`, plus
    ``GET /cluster``. With an API key, every route but ``/health`` needs it."""
    cfg, tok = router.cfg, router.tok
    app = FastAPI(title="hyla router", description="Prefill-as-a-Service router",
                  on_startup=[router.start], on_shutdown=[router.close])
    created = int(time.time())
    enc = PromptEncoder(tok, cfg.max_model_len)
    app.add_middleware(BodyLimitMiddleware, max_bytes=max_body_bytes)
    if cfg.api_key:
        app.add_middleware(APIKeyMiddleware, key=cfg.api_key)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return JSONResponse(exc.body(), exc.status, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        return JSONResponse(validation_error(
            exc, request.headers.get("content-type", "")).body(), 400)

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception):
        return JSONResponse(error_body(f"internal error: {exc!r}", "server_error"), 500)

    def check_model(name):
        if name is not None and name != cfg.model_name:
            raise APIError(f"The model {name!r} does not exist: this server serves "
                           f"{cfg.model_name!r}", param="model", code="model_not_found")

    async def run(request: Request, req, ids, params, fmt: Formatter):
        if req.stream:
            gen = router.generate(ids, params, fmt.id)
            try:
                first = await until_disconnect(request, anext(gen))
            except _ClientGone:
                router.counts["abandoned"] += 1
                await gen.aclose()
                return Response(status_code=499)
            except WorkerFailed as e:
                raise APIError(str(e), status=503, type="server_error") from None
            return StreamingResponse(_events(fmt, first, gen),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})

        # a batch of completion prompts: one run each, one choice each
        batch = ids if params_is_list(params) else [ids]
        plist = params if params_is_list(params) else [params]

        async def collect(ids, params, rid) -> Result:
            errors = []
            for _ in range(3):        # a decode worker lost mid-request: run it again
                r = Result()
                gen = router.generate(ids, params, rid)
                try:
                    async for out in gen:
                        r.add(out)
                    return r
                except WorkerFailed as e:
                    errors.append(str(e))
                    router.counts["decode_retries"] += 1
                finally:
                    await gen.aclose()      # also on cancel: closes the worker's stream
            router.counts["failed"] += 1
            raise APIError("The request failed on every path: " + "; ".join(errors),
                           status=503, type="server_error")

        async def collect_all():
            tasks = [asyncio.ensure_future(collect(x, p, fmt.id if len(batch) == 1
                                                   else f"{fmt.id}-{i}"))
                     for i, (x, p) in enumerate(zip(batch, plist, strict=True))]
            try:
                results = await asyncio.gather(*tasks)
            finally:
                for t in tasks:
                    t.cancel()
            return fmt.response(results if len(results) > 1 else results[0])
        try:
            return await until_disconnect(request, collect_all())
        except _ClientGone:
            router.counts["abandoned"] += 1
            return Response(status_code=499)

    async def _events(fmt, first, gen):
        ended = False               # the stream ran to its end (or to an error event)
        try:
            async for event in fmt.stream(first, gen):
                yield event
            ended = True
        except WorkerFailed as e:
            ended = True
            router.counts["failed_mid_stream"] += 1
            router.record_error(str(e))
            yield _error_event(f"The stream was interrupted: {e}. The output so far is "
                               "incomplete; retry the request.")
        except APIError as e:
            ended = True
            yield _error_event(e.message)
        finally:
            if not ended:           # the client disconnected mid-stream
                router.counts["abandoned"] += 1
            await gen.aclose()

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request):
        check_model(req.model)
        req.check_unsupported()
        prompts = await prompt_token_ids(req, enc)
        grammar = await grammar_setup(req, None, None)      # the decode node compiles it
        params, fmt = completion_setup(req, prompts, tok, cfg.max_model_len,
                                       f"cmpl-{uuid.uuid4().hex}", cfg.model_name, grammar)
        if len(prompts) > 1:
            return await run(request, req, prompts, params, fmt)
        return await run(request, req, prompts[0], params[0], fmt)

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, request: Request):
        check_model(req.model)
        req.check_unsupported()
        ids, params, fmt = await chat_setup(req, enc, tok, cfg.max_model_len, cfg.model_name)
        return await run(request, req, ids, params, fmt)

    add_tokenizer_routes(app, tok, cfg.max_model_len)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": cfg.model_name, "object": "model",
                                            "created": created, "owned_by": "hyla",
                                            "max_model_len": cfg.max_model_len}]}

    @app.get("/health")
    async def health():
        # 200 while requests can be served (locally at least); a remote path that is
        # slow or down, or a prefill pool that is, shows as "degraded"
        up = sum(w.healthy for w in router.decode)
        pre = sum(w.healthy for w in router.prefill)
        bad = router.links.degraded()
        status = "error" if not up else "degraded" if bad or (router.prefill and not pre) \
            else "ok"
        body = {"status": status, "model": cfg.model_name, "decode_workers_up": up,
                "prefill_workers_up": pre,
                "links": bad}
        return JSONResponse(body, 200 if up else 503)

    @app.get("/cluster")
    async def cluster():
        return router.cluster_view()

    @app.get("/metrics")
    async def metrics():
        lines = [f"hyla_router_requests_total{{path=\"{k}\"}} {v}"
                 for k, v in router.counts.items()]
        lines.append(f"hyla_router_threshold_tokens {router.policy.t}")
        lines.append(f"hyla_router_egress_gbps {router.egress.gbps()}")
        lines += router.links.metrics()
        return Response("\n".join(lines) + "\n", media_type="text/plain")

    return app
