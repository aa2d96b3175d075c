"""OpenAI-compatible HTTP API over an AsyncEngine (FastAPI).

Routes: ``POST /v1/completions`` (``echo`` with prompt logprobs, batched prompts),
``POST /v1/chat/completions`` (JSON, or server-sent events with ``"stream": true``),
``GET /v1/models``, ``POST /tokenize``, ``POST /detokenize``, ``GET /tokenizer_info``
(vLLM's, :mod:`hyla.serve.api.tokens`), ``GET /health`` (status plus what the
engine holds: running and waiting requests, state slots and KV blocks in use) and
``GET /metrics`` (Prometheus). With an API key set, every route but ``/health`` needs
``Authorization: Bearer KEY`` (401 otherwise). Bodies over ``max_body_bytes`` are a 413;
prompts are tokenised off the event loop (:mod:`hyla.serve.api.limits`).

Every error is OpenAI's body ``{"error": {"message", "type", "param", "code"}}``: bad input
(malformed JSON and wrong types included: FastAPI's 422 becomes 400) is 400, a full queue
429 with ``Retry-After``, a request whose output could not be produced 503 (it alone
fails), an engine whose step failed 503 (it restarts; a dead one makes ``/health`` 503).
A client that goes away (mid-stream or while waiting) has its request aborted, which frees
its state slot and KV blocks.

Example:
    >>> from fastapi.testclient import TestClient
    >>> from hyla.model import HylaLM, preset
    >>> from hyla.data.tokenizer import ByteTokenizer
    >>> from hyla.serve.engine import Engine
    >>> eng = AsyncEngine(Engine(HylaLM(preset("debug")), ByteTokenizer()))
    >>> r = TestClient(create_app(eng, model_name="debug")).post(
    ...     "/v1/completions", json={"prompt": "Hi", "max_tokens": 4})
    >>> r.json()["usage"]; eng.shutdown()
    {'prompt_tokens': 2, 'completion_tokens': 4, 'total_tokens': 6}
"""

from __future__ import annotations

import asyncio
import re
import threading
import time
import uuid
from collections.abc import Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from hyla.serve.api.format import Echo, Formatter, Result, render_chat
from hyla.serve.api.limits import (
    DEFAULT_MAX_BODY_BYTES,
    APIKeyMiddleware,
    BodyLimitMiddleware,
    PromptEncoder,
)
from hyla.serve.api.response_format import compile_grammar, grammar_of
from hyla.serve.api.schemas import APIError, ChatCompletionRequest, CompletionRequest, error_body
from hyla.serve.api.tokens import add_tokenizer_routes
from hyla.serve.api.tools import chat_messages, parse_tools
from hyla.serve.async_engine import AsyncEngine, EngineFailed, QueueFull, RequestFailed
from hyla.serve.http_guard import BodyDeadlineMiddleware, ServerLimits
from hyla.serve.sequence import GrammarSpec, SamplingParams

_TAG = re.compile(r"^(str|int|float|bool|none|list\[.*\]|dict\[.*\]|literal\[.*\]|[A-Z]\w*)$")
_PARAMS = ("max_tokens", "temperature", "top_k", "top_p", "logprobs", "stop", "seed",
           "stop_token_ids", "top_logprobs", "presence_penalty", "frequency_penalty",
           "repetition_penalty", "grammar")
_ALIASES = {"prompt_logprobs": "logprobs"}     # echo's logprobs become the prompt's
_FIRST_WORD = re.compile(r"^\W*(\w+)")


class _ClientGone(Exception):
    pass


def validation_error(exc: RequestValidationError, content_type: str = "") -> APIError:
    errors = exc.errors()
    first = errors[0] if errors else {}
    if tuple(first.get("loc", ())) == ("body",) and "json" not in content_type.lower():
        # FastAPI reads a body of another type as text: its error would be about a
        # "valid dictionary" (found by a hostile client)
        return APIError(f"the body must be JSON, sent as Content-Type: application/json "
                        f"(got {content_type or 'no Content-Type'!r})")
    if first.get("type") == "json_invalid":
        return APIError("We could not parse the JSON body of your request: "
                        f"{first.get('ctx', {}).get('error', 'invalid JSON')}")
    param = _loc(first.get("loc", ())) or None
    msgs = [f"{_loc(e['loc']) or 'body'}: {e['msg']}" for e in errors[:3]]
    return APIError("Invalid request: " + "; ".join(msgs), param=param)


def _loc(loc) -> str:
    """``("body", "messages", 0, "role")`` -> ``"messages.0.role"``, without the union-member
    tags pydantic adds (``"str"``, ``"list[int]"``, ``"TextPart"``)."""
    return ".".join(str(x) for x in loc[1:] if not _TAG.match(str(x)))


def param_of(message: str) -> str | None:
    """The request field an engine's ValueError names: its first word, whatever punctuation
    follows it (``"stop: at most ..."`` is ``stop``).

    Example:
        >>> param_of("stop: at most 4 strings"), param_of("top_p must be in (0, 1]")
        ('stop', 'top_p')
    """
    m = _FIRST_WORD.match(message)
    word = _ALIASES.get(m.group(1), m.group(1)) if m else ""
    if word in _PARAMS:
        return word
    return "prompt" if "prompt" in message else None


def sampling_params(req, n_prompt: int, max_tokens: int | None, logprobs: int | None,
              max_len: int, extra_stop: tuple[str, ...] = (), prompt_param: str = "prompt",
              echo: bool = False, grammar: GrammarSpec | None = None) -> SamplingParams:
    """Request fields -> SamplingParams; APIError (HTTP 400) naming the field on bad input.

    ``echo`` (completions): the prompt's logprobs are asked for when ``logprobs`` is set,
    and ``max_tokens`` may be 0 (the prompt alone). Shared by this server and the
    disaggregated router, so both answer alike."""
    if n_prompt == 0:
        raise APIError("The prompt is empty: it must hold at least one token",
                       param=prompt_param)
    if n_prompt >= max_len:
        raise APIError(f"This model's maximum context length is {max_len} tokens; the "
                       f"prompt has {n_prompt}", param=prompt_param,
                       code="context_length_exceeded")
    if max_tokens is None:
        max_tokens = max_len - n_prompt
    if max_tokens < (0 if echo else 1):
        raise APIError(f"max_tokens must be >= {0 if echo else 1}"
                       f"{'' if echo else ' (0 only with echo)'}, got {max_tokens}",
                       param="max_tokens")
    if n_prompt + max_tokens > max_len:
        raise APIError(f"This model's maximum context length is {max_len} tokens; you "
                       f"requested {n_prompt + max_tokens} ({n_prompt} in the prompt, "
                       f"{max_tokens} for the completion)", param="max_tokens",
                       code="context_length_exceeded")
    try:
        return SamplingParams(
            max_tokens=max_tokens, temperature=1.0 if req.temperature is None else req.temperature,
            top_k=req.top_k or 0, top_p=1.0 if req.top_p is None else req.top_p,
            seed=req.seed, stop=req.stop_list + extra_stop,
            stop_token_ids=tuple(req.stop_token_ids or ()), ignore_eos=req.ignore_eos,
            logprobs=logprobs,
            # max_tokens 0 needs the engine to treat the request as scoring (k = 0: cheap)
            prompt_logprobs=(logprobs if logprobs is not None else 0 if max_tokens == 0
                             else None) if echo else None, grammar=grammar,
            presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
            repetition_penalty=req.repetition_penalty)
    except ValueError as e:
        raise APIError(str(e), param=param_of(str(e))) from None



async def prompt_token_ids(req: CompletionRequest, enc: PromptEncoder) -> list[list[int]]:
    """The token ids of each of a completion request's prompts (text or ids; text is
    encoded off the event loop, bounded by the context length)."""
    return [await enc.encode(p, "prompt") if isinstance(p, str) else list(p)
            for p in req.prompts]


async def grammar_setup(req, tools, constraints) -> GrammarSpec | None:
    """The grammar of a request (its structured-output fields, or its tools), compiled
    off the event loop when the engine's ``constraints`` are at hand (the cluster router
    has none: its decode node compiles)."""
    asked = grammar_of(req)
    if asked is not None and tools is not None:
        raise APIError(f"{asked[1]} and tools together are not supported: send one",
                       param=asked[1])
    if tools is not None:
        asked = (tools.grammar(), "tools")
    if asked is None:
        return None
    if constraints is not None:
        await compile_grammar(constraints, *asked)
    return asked[0]


def completion_setup(req: CompletionRequest, prompts: list[list[int]], tok, max_len: int,
                     request_id: str, model_name: str, grammar: GrammarSpec | None = None
                     ) -> tuple[list[SamplingParams], Formatter]:
    """One SamplingParams per prompt and the Formatter of a completion request (shared
    with the cluster router)."""
    params = [sampling_params(req, len(ids), req.max_tokens, req.logprobs, max_len,
                              echo=req.echo, grammar=grammar) for ids in prompts]
    echo = None
    if req.echo:
        echo = [Echo(p if isinstance(p, str) else tok.decode(ids), ids)
                for p, ids in zip(req.prompts, prompts, strict=True)]
    fmt = Formatter(tok, request_id, model_name, chat=False, logprobs=req.logprobs,
                    include_usage=wants_usage(req), echo=echo)
    return params, fmt


async def chat_setup(req: ChatCompletionRequest, enc: PromptEncoder, tok, max_len: int,
                     model_name: str, constraints=None
                     ) -> tuple[list[int], SamplingParams, Formatter]:
    """A chat request's prompt ids, SamplingParams and Formatter (shared with the cluster
    router)."""
    tools = parse_tools(req.tools, req.tool_choice, req.parallel_tool_calls)
    grammar = await grammar_setup(req, tools, constraints)
    ids, stops = await chat_token_ids(req, enc, tools)
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None \
        else req.max_tokens
    params = sampling_params(req, len(ids), max_tokens, logprobs, max_len, stops,
                             prompt_param="messages", grammar=grammar)
    fmt = Formatter(tok, f"chatcmpl-{uuid.uuid4().hex}", model_name, chat=True,
                    logprobs=logprobs, include_usage=wants_usage(req),
                    tools=tools is not None)
    return ids, params, fmt


async def chat_token_ids(req: ChatCompletionRequest, enc: PromptEncoder, tools=None
                         ) -> tuple[list[int], tuple[str, ...]]:
    """A chat request's prompt ids and the stop strings its template implies; the template
    and the tokenizer run off the event loop."""
    for i, m in enumerate(req.messages):
        try:
            m.text.encode("utf-8")
        except UnicodeEncodeError as e:
            raise APIError(f"messages.{i}.content holds text that cannot be encoded as "
                           f"UTF-8 ({e.reason} at character {e.start})",
                           param=f"messages.{i}.content") from None
    messages, extra = chat_messages(req.messages, tools,
                                    getattr(enc.tok, "chat_template", None))
    try:
        text, stops = await enc.run(lambda: render_chat(enc.tok, messages, **extra))
    except Exception as e:  # noqa: BLE001 - templates raise their own errors on bad turns
        raise APIError(f"messages could not be rendered with the chat template: {e}",
                       param="messages") from None
    return await enc.encode(text, "messages"), stops


def engine_error(e: Exception) -> APIError:
    """The HTTP error for an exception the engine raised for one request."""
    if isinstance(e, QueueFull):
        return APIError(f"The server is busy: {e}. Retry shortly.", status=429,
                        type="rate_limit_error", code="rate_limit_exceeded",
                        headers={"Retry-After": "1"})
    if isinstance(e, ValueError):
        return APIError(str(e), param=param_of(str(e)))
    if isinstance(e, RequestFailed) and "the grammar failed" in str(e):
        # the request's own grammar outgrew the parser's limits partway: its fault, a 400
        return APIError(str(e), param="grammar", code="grammar_failed")
    code = ("request_failed" if isinstance(e, RequestFailed) else
            "engine_failed" if isinstance(e, EngineFailed) else None)
    return APIError(str(e), status=503, type="server_error", code=code)


def create_app(engine: AsyncEngine, *, model_name: str, api_key: str | None = None,
               max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
               health_check: Callable[[], str | None] | None = None,
               body_timeout: float = ServerLimits.body_timeout,
               ready: threading.Event | None = None, aliases: tuple[str, ...] = ()) -> FastAPI:
    """The FastAPI app serving ``engine`` as the model ``model_name`` (requests may also name
    it by one of ``aliases``, e.g. the short name it was loaded by).

    The caller owns ``engine`` (``engine.shutdown()`` after the server stops). With
    ``api_key`` every route but ``/health`` needs it; bodies over ``max_body_bytes`` are
    a 413. ``health_check``: another check ``/health`` makes (it returns why the server cannot
    serve, or None). A body not complete ``body_timeout`` seconds after its headers is a
    408; a request with both Content-Length and Transfer-Encoding a 400
    (:mod:`hyla.serve.http_guard`, which also has the connection-level limits). ``ready``:
    until it is set (the engine warming up in the background), ``/health`` answers 503
    ``{"status": "starting"}`` and generation requests wait for it.
    """
    app = FastAPI(title="hyla", description="OpenAI-compatible hybrid GLA/attention LM server")
    tok = engine.engine.tokenizer
    max_len = engine.engine.config.max_model_len
    enc = PromptEncoder(tok, max_len)
    app.state.encoder = enc
    created = int(time.time())
    app.add_middleware(BodyLimitMiddleware, max_bytes=max_body_bytes)
    app.add_middleware(BodyDeadlineMiddleware, timeout=body_timeout)
    if api_key:
        app.add_middleware(APIKeyMiddleware, key=api_key)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return JSONResponse(exc.body(), exc.status, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        err = validation_error(exc, request.headers.get("content-type", ""))
        return JSONResponse(err.body(), 400)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return JSONResponse(error_body(str(exc.detail), kind), exc.status_code,
                            headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception):
        return JSONResponse(error_body(f"internal error: {exc!r}", "server_error"), 500)

    served = (model_name, *(a for a in aliases if a != model_name))

    def check_model(name: str | None) -> None:
        if name is not None and name not in served:
            raise APIError(f"The model {name!r} does not exist: this server serves "
                           f"{model_name!r}", param="model", code="model_not_found")

    async def until_disconnect(request: Request, awaitable):
        """Await ``awaitable``, cancelling it (which aborts the request) if the client
        disconnects meanwhile."""
        task = asyncio.ensure_future(awaitable)
        while True:
            done, _ = await asyncio.wait({task}, timeout=0.25)
            if done:
                return task.result()
            if await request.is_disconnected():
                task.cancel()
                raise _ClientGone

    async def until_ready() -> None:
        while ready is not None and not ready.is_set():
            await asyncio.sleep(0.02)

    async def run_batch(request: Request, prompts: list[list[int]],
                        params: list[SamplingParams], fmt: Formatter):
        """Several prompts of one request, run together; one choice each."""
        await until_ready()
        async def collect(i: int) -> Result:
            r, gen = Result(), engine.generate(prompts[i], params[i], f"{fmt.id}-{i}",
                                               group=fmt.id)    # served as one request
            try:
                async for out in gen:
                    r.add(out)
            finally:
                await gen.aclose()          # aborts it when unfinished
            return r

        async def all_of():
            tasks = [asyncio.ensure_future(collect(i)) for i in range(len(prompts))]
            try:
                return await asyncio.gather(*tasks)
            finally:            # one failed or the client left: abort the others
                for t in tasks:
                    t.cancel()
        try:
            results = await until_disconnect(request, all_of())
        except _ClientGone:
            return Response(status_code=499)
        except (ValueError, RuntimeError) as e:
            raise engine_error(e) from None
        return fmt.response(results)

    async def run(request: Request, req, ids: list[int], params: SamplingParams,
                  fmt: Formatter):
        await until_ready()
        gen = engine.generate(ids, params, fmt.id)
        try:
            first = await until_disconnect(request, anext(gen))
        except _ClientGone:
            return Response(status_code=499)
        except (ValueError, RuntimeError) as e:
            raise engine_error(e) from None
        if req.stream:
            return StreamingResponse(_events(fmt, first, gen), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})

        async def collect() -> Result:
            r = Result()
            r.add(first)
            async for out in gen:
                r.add(out)
            return r
        try:
            result = await until_disconnect(request, collect())
        except _ClientGone:
            return Response(status_code=499)
        except (ValueError, RuntimeError) as e:
            raise engine_error(e) from None
        return fmt.response(result)

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request):
        check_model(req.model)
        req.check_unsupported()
        prompts = await prompt_token_ids(req, enc)
        grammar = await grammar_setup(req, None, engine.engine.constraints)
        params, fmt = completion_setup(req, prompts, tok, max_len, f"cmpl-{uuid.uuid4().hex}",
                                       model_name, grammar)
        if len(prompts) > 1:
            return await run_batch(request, prompts, params, fmt)
        return await run(request, req, prompts[0], params[0], fmt)

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, request: Request):
        check_model(req.model)
        req.check_unsupported()
        ids, params, fmt = await chat_setup(req, enc, tok, max_len, model_name,
                                            engine.engine.constraints)
        return await run(request, req, ids, params, fmt)

    add_tokenizer_routes(app, tok, max_len)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": name, "object": "model",
                                            "created": created, "owned_by": "hyla",
                                            "max_model_len": max_len} for name in served]}

    @app.get("/health")
    async def health():
        s = engine.engine.scheduler
        body = {"status": "ok", "model": model_name, "running": s.num_running,
                "waiting": engine.num_waiting, "state_slots_used": s.pool.num_used,
                "kv_blocks_used": s.blocks.num_used if s.blocks is not None else 0,
                "engine_restarts": engine.restarts, "last_engine_failure": engine.last_failure}
        runner = engine.engine.runner
        body["decode_mode"] = runner.decode_mode(s.config.decode_widths)
        if runner.eager_until_built:        # graphs building in the background
            body["decode_widths_compiled"] = sorted(runner.built_widths)
        if runner.compile_error is not None:
            body["compile_error"] = runner.compile_error
        problem = (None if engine.alive else f"the engine is dead: {engine.error!r}") or \
            (health_check() if health_check is not None else None)
        if problem is not None:
            return JSONResponse(body | {"status": "error", "error": problem}, 503)
        if ready is not None and not ready.is_set():
            return JSONResponse(body | {"status": "starting"}, 503)
        return body

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(engine.metrics.render(engine.engine),
                                 media_type=CONTENT_TYPE_LATEST)

    return app


def wants_usage(req) -> bool:
    return bool(req.stream and req.stream_options and req.stream_options.include_usage)


async def _events(fmt: Formatter, first, gen):
    """The SSE body; closing ``gen`` on the way out aborts an unfinished request."""
    try:
        async for event in fmt.stream(first, gen):
            yield event
    except RuntimeError as e:       # the engine failed mid-stream
        yield f"data: {JSONResponse(error_body(str(e), 'server_error')).body.decode()}\n\n"
    finally:
        await gen.aclose()
