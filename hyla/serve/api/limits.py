"""What keeps one HTTP request from hurting the server: a body size limit (413), prompt
encoding off the event loop with a length bound checked before tokenising, text that
cannot be encoded answered with a 400, and an API key on every route but ``/health``.

Shared by ``hyla serve`` (:mod:`hyla.serve.api`) and the cluster's router
(:mod:`hyla.disagg.live.router.app`), so both answer alike.

Example:
    >>> import asyncio
    >>> from hyla.data.tokenizer import ByteTokenizer
    >>> enc = PromptEncoder(ByteTokenizer(), max_len=8)
    >>> asyncio.run(enc.encode("hi", "prompt"))
    [104, 105]
    >>> try:
    ...     asyncio.run(enc.encode("a\\ud800b", "prompt"))
    ... except APIError as e:
    ...     print(e.status, e.param)
    400 prompt
    >>> enc.close()
"""

from __future__ import annotations

import asyncio
import hmac
import math
from concurrent.futures import ThreadPoolExecutor

from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from hyla.serve.api.schemas import APIError, error_body

DEFAULT_MAX_BODY_BYTES = 4 << 20       # a max_model_len prompt is far smaller in any tokenizer
OPEN_PATHS = ("/health",)              # the only route open without the key (liveness probes)


class BodyTooLarge(HTTPException):
    def __init__(self, limit: int):
        super().__init__(413, f"The request body is larger than this server's limit of "
                              f"{limit} bytes")


class BodyLimitMiddleware:
    """ASGI middleware: a request body over ``max_bytes`` is a 413, by its Content-Length
    before anything is read, or as soon as a chunked body passes the limit (the app's
    ``receive`` raises :class:`BodyTooLarge`, which the app's HTTPException handler
    answers)."""

    def __init__(self, app, max_bytes: int = DEFAULT_MAX_BODY_BYTES):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None:
            try:
                too_big = int(length) > self.max_bytes
            except ValueError:
                too_big = False          # the server rejects a malformed header itself
            if too_big:
                await self._reject(scope, receive, send)
                return
        seen = 0

        async def limited():
            nonlocal seen
            msg = await receive()
            if msg["type"] == "http.request":
                seen += len(msg.get("body", b""))
                if seen > self.max_bytes:
                    if msg.get("more_body"):
                        await _drain(receive)
                    raise BodyTooLarge(self.max_bytes)
            return msg
        await self.app(scope, limited, send)

    async def _reject(self, scope, receive, send):
        await _drain(receive)
        e = BodyTooLarge(self.max_bytes)
        resp = JSONResponse(error_body(e.detail, code="request_too_large"), 413,
                            headers={"Connection": "close"})
        await resp(scope, receive, send)


async def _drain(receive, cap: int = 256 << 20, timeout_s: float = 30.0) -> None:
    """Read and discard the rest of a request body (up to ``cap`` bytes), holding none of it:
    a client still sending when the 413 goes out would otherwise see its connection reset
    instead of the answer."""
    got = 0

    async def run():
        nonlocal got
        while got <= cap:
            msg = await receive()
            if msg["type"] != "http.request":
                return
            got += len(msg.get("body", b""))
            if not msg.get("more_body"):
                return
    try:
        await asyncio.wait_for(run(), timeout_s)
    except TimeoutError:
        pass


class APIKeyMiddleware:
    """ASGI middleware: every route but ``/health`` needs ``Authorization: Bearer <key>``
    (compared in constant time). Pure ASGI, not BaseHTTPMiddleware, so streaming
    responses still see client disconnects."""

    def __init__(self, app, key: str, open_paths: tuple[str, ...] = OPEN_PATHS):
        self.app, self.want, self.open = app, f"Bearer {key}".encode(), open_paths

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] not in self.open:
            got = dict(scope["headers"]).get(b"authorization")
            if got is None or not hmac.compare_digest(got, self.want):
                msg = ("Missing API key: send 'Authorization: Bearer <key>'" if got is None
                       else "Incorrect API key provided")
                resp = JSONResponse(error_body(msg, code="invalid_api_key"), 401,
                                    headers={"WWW-Authenticate": "Bearer"})
                await resp(scope, receive, send)
                return
        await self.app(scope, receive, send)


def bearer_ok(header: str | None, key: str | None) -> bool:
    """Whether an ``Authorization`` header carries ``key`` (constant time; no key: yes).

    Example:
        >>> bearer_ok("Bearer k", "k"), bearer_ok("Bearer x", "k"), bearer_ok(None, None)
        (True, False, True)
    """
    if not key:
        return True
    return header is not None and hmac.compare_digest(header.encode(errors="replace"),
                                                      f"Bearer {key}".encode())


def max_token_bytes(tok) -> int | None:
    """The most UTF-8 bytes of text one token of ``tok`` can stand for (an upper bound),
    or None when it cannot be told: then a text of ``n`` bytes has at least
    ``n / max_token_bytes`` tokens, which bounds a prompt's length before tokenising it.

    Example:
        >>> from hyla.data.tokenizer import ByteTokenizer
        >>> max_token_bytes(ByteTokenizer())
        1
    """
    own = getattr(tok, "max_token_bytes", None)
    if isinstance(own, int):
        return own
    if type(tok).__name__ == "ByteTokenizer":
        return 1
    inner = getattr(tok, "_tok", None)
    if inner is not None and hasattr(inner, "get_vocab"):
        try:
            vocab = inner.get_vocab(with_added_tokens=True)
        except Exception:  # noqa: BLE001 - an unusual tokenizer: no bound
            return None
        # A vocabulary entry's own UTF-8 length is at least the bytes it decodes to in
        # byte-level ('Ġ' is one space) and sentencepiece ('▁', '<0x0A>') vocabularies.
        return max((len(k.encode("utf-8", errors="surrogatepass")) for k in vocab), default=None)
    return None


def utf8_bytes(text: str, param: str) -> int:
    """``text``'s UTF-8 length; text that has none (a lone surrogate, which JSON's ``\\ud800``
    escapes can carry) is a 400 naming ``param``."""
    try:
        return len(text.encode("utf-8"))
    except UnicodeEncodeError as e:
        raise APIError(f"{param} holds text that cannot be encoded as UTF-8 "
                       f"({e.reason}: {text[e.start:e.end]!r} at character {e.start})",
                       param=param) from None


class PromptEncoder:
    """Encodes prompts on a small thread pool (never on the event loop), refusing before
    tokenising a text certainly longer than ``max_len`` tokens, and answering text that
    cannot be encoded (a lone surrogate, say) with a 400 naming the field."""

    def __init__(self, tok, max_len: int, workers: int = 2):
        self.tok, self.max_len = tok, max_len
        self.max_token_bytes = max_token_bytes(tok)
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="hyla-tokenize")

    async def encode(self, text: str, param: str) -> list[int]:
        return await asyncio.get_running_loop().run_in_executor(
            self._pool, self.encode_sync, text, param)

    async def run(self, fn, *args):
        """``fn(*args)`` on the pool (a chat template, say)."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def encode_sync(self, text: str, param: str) -> list[int]:
        nbytes = utf8_bytes(text, param)
        if self.max_token_bytes:
            least = math.ceil(nbytes / self.max_token_bytes)
            if least >= self.max_len:
                raise APIError(f"This model's maximum context length is {self.max_len} "
                               f"tokens; the {param} has at least {least} ({nbytes} bytes)",
                               param=param, code="context_length_exceeded")
        try:
            return list(self.tok.encode(text))
        except (TypeError, ValueError, UnicodeError) as e:
            raise APIError(f"{param} could not be tokenized: {e}", param=param) from None

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
