"""A request's structured-output fields -> the grammar its output must match.

OpenAI's ``response_format`` (``{"type": "text"}``, ``{"type": "json_object"}``,
``{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}``), and vLLM's
extensions, which the ``openai`` client sends through ``extra_body``:
``structured_outputs`` (``{"json": schema} | {"regex": str} | {"choice": [str]} |
{"grammar": GBNF or Lark}``) and the older ``guided_json``, ``guided_regex``,
``guided_choice`` and ``guided_grammar``. One of them a request. Grammars are compiled off
the event loop within :data:`COMPILE_SECONDS` (:func:`compile_grammar`); a bad one is a 400
naming the field and the problem.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from hyla.serve.api.schemas import APIError
from hyla.serve.sequence import MAX_GRAMMAR_CHARS, GrammarSpec

COMPILE_SECONDS = 5.0
QUEUE_SECONDS = 10.0       # waiting for a compiler thread: past this the server is busy
# grammars compile on their own threads: a client's slow schemas (which run on after their
# 400) hold these, not the pool prompts are tokenised on
_POOL = ThreadPoolExecutor(2, thread_name_prefix="hyla-grammar-compile")
_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
           "guided_grammar": "grammar"}


def grammar_of(req) -> tuple[GrammarSpec, str] | None:
    """The grammar ``req``'s fields ask for and the field that asked, or None (free text);
    APIError on bad input."""
    found = []
    rf = getattr(req, "response_format", None)
    if rf is not None:
        spec = _response_format(rf)
        if spec is not None:
            found.append(("response_format", spec))
    so = getattr(req, "structured_outputs", None)
    if so is not None:
        if not isinstance(so, dict) or len([k for k, v in so.items() if v is not None]) != 1:
            raise APIError('structured_outputs must hold exactly one of "json", "regex", '
                           '"choice", "grammar"', param="structured_outputs")
        (key, value), = [(k, v) for k, v in so.items() if v is not None]
        found.append(("structured_outputs", _extension(key, value, f"structured_outputs.{key}")))
    for field, key in _GUIDED.items():
        value = getattr(req, field, None)
        if value is not None:
            found.append((field, _extension(key, value, field)))
    if len(found) > 1:
        raise APIError(f"give one structured-output field, got {[f for f, _ in found]}",
                       param=found[1][0])
    return (found[0][1], found[0][0]) if found else None


def _response_format(rf) -> GrammarSpec | None:
    if not isinstance(rf, dict) or not isinstance(rf.get("type"), str):
        raise APIError('response_format must be an object with a "type"',
                       param="response_format")
    kind = rf["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return _spec("json_schema", '{"type": "object"}', "response_format")
    if kind == "json_schema":
        js = rf.get("json_schema")
        if not isinstance(js, dict) or not isinstance(js.get("schema", {}), dict | bool):
            raise APIError('response_format.json_schema must be {"name": ..., "schema": '
                           '{...}}', param="response_format.json_schema")
        name = js.get("name")
        if name is not None and (not isinstance(name, str) or not 0 < len(name) <= 64):
            raise APIError("response_format.json_schema.name must be a string of 1-64 "
                           "characters", param="response_format.json_schema.name")
        schema = js.get("schema", {"type": "object"})
        return _spec("json_schema", json.dumps(schema), "response_format.json_schema.schema")
    raise APIError(f"response_format.type must be 'text', 'json_object' or 'json_schema', "
                   f"got {kind!r}", param="response_format.type")


def _extension(key: str, value, param: str) -> GrammarSpec:
    if key in ("json", "json_schema"):
        if isinstance(value, str):
            return _spec("json_schema", value, param)
        if not isinstance(value, dict | bool):
            raise APIError(f"{param} must be a JSON schema (an object)", param=param)
        return _spec("json_schema", json.dumps(value), param)
    if key == "choice":
        if not isinstance(value, list) or not value or not all(
                isinstance(c, str) and c for c in value):
            raise APIError(f"{param} must be a non-empty list of non-empty strings",
                           param=param)
        return _spec("choice", json.dumps(value), param)
    if key in ("regex", "grammar"):
        if not isinstance(value, str):
            raise APIError(f"{param} must be a string", param=param)
        return _spec(key, value, param)
    raise APIError(f"{param.rsplit('.', 1)[0]} has no {key!r}: give json, regex, choice or "
                   f"grammar", param=param)


def _spec(kind: str, source: str, param: str) -> GrammarSpec:
    if len(source) > MAX_GRAMMAR_CHARS:
        raise APIError(f"{param}: the {kind} is too large: {len(source)} characters, at most "
                       f"{MAX_GRAMMAR_CHARS}", param=param)
    try:
        return GrammarSpec(kind, source)
    except ValueError as e:
        raise APIError(f"{param}: {e}", param=param) from None


async def compile_grammar(constraints, spec: GrammarSpec, param: str, pool=None) -> None:
    """Compile ``spec`` into the engine's cache on a compiler thread (the tokenizer's
    grammar tables are built on the first): APIError 400 naming ``param`` if it is invalid
    or compiles for more than :data:`COMPILE_SECONDS`, 503 if no compiler thread took it
    within :data:`QUEUE_SECONDS` (other clients' slow grammars hold them)."""
    loop = asyncio.get_running_loop()
    started = threading.Event()

    def build():
        started.set()
        return constraints.compiler.compile(spec)
    job = asyncio.ensure_future(loop.run_in_executor(pool or _POOL, build))
    queued = time.monotonic()
    while not started.is_set() and not job.done():
        if time.monotonic() - queued > QUEUE_SECONDS:
            raise APIError("the grammar compilers are busy with other requests; retry "
                           "shortly", status=503, type="server_error", param=param,
                           code="grammar_compilers_busy", headers={"Retry-After": "5"})
        await asyncio.sleep(0.01)
    try:
        await asyncio.wait_for(asyncio.shield(job), COMPILE_SECONDS)
    except TimeoutError:
        raise APIError(f"{param}: the grammar took more than {COMPILE_SECONDS:.0f} s to "
                       f"compile; simplify it", param=param) from None
    except ValueError as e:
        raise APIError(f"{param}: {e}", param=param) from None
