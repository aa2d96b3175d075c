"""What keeps idle, slow or malformed HTTP connections from holding ``hyla serve``: a header
deadline, a body deadline, an idle (keep-alive) timeout, a cap on open connections, and a
400 for a request with both ``Content-Length`` and ``Transfer-Encoding``.

- :class:`GuardedH11Protocol` (uvicorn's h11 protocol): a connection must finish sending a
  request's headers within ``header_timeout`` seconds of opening (or of its previous
  response), however it trickles them in, or it is closed; past ``max_connections`` open
  connections a new one gets a 503 and is closed at once (file descriptors stay bounded).
- :class:`BodyDeadlineMiddleware` (ASGI): a request's body must arrive within
  ``body_timeout`` seconds of its headers, or the answer is a 408 and the connection closes;
  ``Content-Length`` together with ``Transfer-Encoding`` is a 400 (the framing a proxy and
  this server could disagree on: request smuggling), and the connection closes.
- uvicorn's own ``timeout_keep_alive`` closes a connection idle between requests.

:func:`server_config` builds the ``uvicorn.Config`` with all of them.

Example:
    >>> from fastapi import FastAPI
    >>> cfg = server_config(FastAPI(), "127.0.0.1", 8000, ServerLimits(header_timeout=5))
    >>> cfg.http.header_timeout, cfg.timeout_keep_alive
    (5.0, 5.0)
"""

from __future__ import annotations

import asyncio
import dataclasses
import time

import h11
from starlette.exceptions import HTTPException
from uvicorn.protocols.http.h11_impl import H11Protocol

from hyla.serve.api.schemas import error_body


@dataclasses.dataclass(frozen=True)
class ServerLimits:
    """Timeouts (seconds) and the connection cap of an HTTP server (``hyla serve`` flags
    ``--header-timeout``, ``--body-timeout``, ``--keep-alive-timeout``,
    ``--max-connections``)."""

    header_timeout: float = 30.0
    body_timeout: float = 30.0
    keep_alive_timeout: float = 5.0
    max_connections: int = 1024

    def __post_init__(self):
        for name in ("header_timeout", "body_timeout", "keep_alive_timeout"):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and 0 < value <= 3600):
                raise ValueError(f"{name} must be in (0, 3600] seconds, got {value!r}")
            object.__setattr__(self, name, float(value))
        if not (isinstance(self.max_connections, int) and self.max_connections >= 1):
            raise ValueError(f"max_connections must be an int >= 1, "
                             f"got {self.max_connections!r}")


_BUSY = (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
         b"connection: close\r\ncontent-length: %d\r\n\r\n%s")


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a header deadline and a cap on open connections (set by
    :func:`guarded_protocol`)."""

    header_timeout: float = 30.0
    max_connections: int = 1024

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._header_timer = None
        if len(self.connections) > self.max_connections:
            body = (b'{"error": {"message": "too many open connections", "type": '
                    b'"server_error", "param": null, "code": "too_many_connections"}}')
            transport.write(_BUSY % (len(body), body))
            transport.close()
            return
        self._await_headers()

    def _await_headers(self) -> None:
        self._cancel_header_timer()
        self._header_timer = self.loop.call_later(self.header_timeout, self._headers_late)

    def _cancel_header_timer(self) -> None:
        timer = getattr(self, "_header_timer", None)
        if timer is not None:
            timer.cancel()
            self._header_timer = None

    def _headers_late(self) -> None:
        self._header_timer = None
        if not self.transport.is_closing():
            self.logger.info("closing a connection that sent no complete request headers "
                             "within %gs", self.header_timeout)
            try:
                self.conn.send(h11.ConnectionClosed())
            except h11.LocalProtocolError:
                pass
            self.transport.close()

    def data_received(self, data: bytes) -> None:
        cycle = self.cycle
        super().data_received(data)
        if self.cycle is not cycle:          # a request's headers are complete
            self._cancel_header_timer()

    def on_response_complete(self) -> None:
        cycle = self.cycle
        super().on_response_complete()
        if self.cycle is cycle and not self.transport.is_closing():
            self._await_headers()            # the next request's headers, if any

    def connection_lost(self, exc) -> None:
        self._cancel_header_timer()
        super().connection_lost(exc)


def guarded_protocol(limits: ServerLimits) -> type[GuardedH11Protocol]:
    """A :class:`GuardedH11Protocol` subclass with ``limits``' header deadline and cap."""
    return type("GuardedH11Protocol", (GuardedH11Protocol,),
                {"header_timeout": limits.header_timeout,
                 "max_connections": limits.max_connections})


class BodyTimeout(HTTPException):
    def __init__(self, seconds: float):
        super().__init__(408, f"The request body did not arrive within {seconds:g} seconds",
                         headers={"Connection": "close"})


class BodyDeadlineMiddleware:
    """ASGI middleware: the body of a request must be complete within ``timeout`` seconds
    of its headers (else :class:`BodyTimeout`, a 408 through the app's HTTPException
    handler, with ``Connection: close``); ``Content-Length`` with ``Transfer-Encoding`` is
    refused with a 400 before anything is read."""

    def __init__(self, app, timeout: float = 30.0):
        self.app, self.timeout = app, timeout

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        names = {k.lower() for k, _ in scope["headers"]}
        if b"content-length" in names and b"transfer-encoding" in names:
            await _refuse_framing(send)
            return
        deadline = time.monotonic() + self.timeout
        complete = False

        async def timed():
            nonlocal complete
            if complete:                    # after the body: only http.disconnect is left
                return await receive()
            left = deadline - time.monotonic()
            try:
                msg = await asyncio.wait_for(receive(), max(left, 0.0))
            except TimeoutError:
                raise BodyTimeout(self.timeout) from None
            if msg["type"] != "http.request" or not msg.get("more_body", False):
                complete = True
            return msg
        await self.app(scope, timed, send)


async def _refuse_framing(send) -> None:
    import json

    body = json.dumps(error_body(
        "The request has both Content-Length and Transfer-Encoding: its length is ambiguous "
        "(send one of them)", param="Transfer-Encoding")).encode()
    await send({"type": "http.response.start", "status": 400,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode()),
                            (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": body})


def server_config(app, host: str, port: int, limits: ServerLimits | None = None, **kw):
    """``uvicorn.Config`` for ``app`` with ``limits`` (see the module docstring); ``kw``
    goes to uvicorn (``log_level``, ``timeout_graceful_shutdown``, ...). The app itself
    should carry :class:`BodyDeadlineMiddleware` (``create_app`` adds it)."""
    import uvicorn

    limits = limits or ServerLimits()
    return uvicorn.Config(app, host=host, port=port, http=guarded_protocol(limits),
                          timeout_keep_alive=limits.keep_alive_timeout,
                          limit_concurrency=limits.max_connections + 1, **kw)
