"""Signed internal routes: every ``/internal/*`` call between a cluster's processes carries an
HMAC under the cluster secret, so nobody without the secret can use them.

The signature (header ``X-Hyla-Signature: t=TS,n=NONCE,r=ROLE,m=MAC``) covers the method,
the path and query, a timestamp, a one-time nonce, the caller's role and the body's SHA-256:

- a missing, malformed or wrong signature is a 401;
- a timestamp more than ``window_s`` (30 s) away from the receiver's clock, or a nonce
  already seen within that window, is a 401 (no replay);
- routes that only the router may call (``/internal/registry``: where a prefill worker may
  ship states) also need ``r=router``. Every holder of the secret is trusted: the role
  stops a mistaken caller, not an insider.

The caller signs with :class:`InternalAuth` (an ``httpx.Auth``); the worker checks with
:class:`InternalAuthMiddleware` (ASGI) around its app.

Example:
    >>> key = internal_key("s3cret")
    >>> v = Verifier(key, clock=lambda: 1000.0)
    >>> h = sign(key, "POST", "/internal/registry", b"{}", role="router", now=1000.0)
    >>> v.check("POST", "/internal/registry", b"{}", h, need_role="router")
    >>> v.check("POST", "/internal/registry", b"{}", h)          # the same nonce again
    'replayed request (nonce already used)'
    >>> v.check("POST", "/internal/registry", b"{}", None)
    'missing X-Hyla-Signature header'
"""

from __future__ import annotations

import hashlib
import hmac
import json
import secrets
import threading
import time
from collections import OrderedDict

import httpx

HEADER = "x-hyla-signature"
REPLAY_WINDOW_S = 30.0
#: routes only the router may call
ROUTER_ONLY = frozenset({"/internal/registry"})
MAX_INTERNAL_BODY = 32 << 20       # a prompt of 1M token ids is about 8 MB of JSON


def internal_key(secret: str | bytes | None) -> bytes | None:
    """The HMAC key of internal HTTP calls from the cluster secret (None: no secret), apart
    from the transfer channel's key (another label).

    Example:
        >>> len(internal_key("s")), internal_key(None)
        (32, None)
    """
    if not secret:
        return None
    raw = secret.encode() if isinstance(secret, str) else secret
    return hmac.new(raw, b"hyla-internal-http-v1", hashlib.sha256).digest()


def _mac(key: bytes, method: str, path: str, ts: str, nonce: str, role: str,
         body: bytes) -> str:
    msg = "\n".join([method.upper(), path, ts, nonce, role, hashlib.sha256(body).hexdigest()])
    return hmac.new(key, msg.encode(), hashlib.sha256).hexdigest()


def sign(key: bytes, method: str, path: str, body: bytes, *, role: str = "router",
         now: float | None = None) -> str:
    """The ``X-Hyla-Signature`` value of one call (``path`` with its query string)."""
    ts = f"{time.time() if now is None else now:.3f}"
    nonce = secrets.token_hex(12)
    if not role.isalnum():
        raise ValueError(f"role must be alphanumeric, got {role!r}")
    return f"t={ts},n={nonce},r={role},m={_mac(key, method, path, ts, nonce, role, body)}"


class Verifier:
    """Checks signatures; remembers the nonces of the last ``window_s`` seconds."""

    def __init__(self, key: bytes, window_s: float = REPLAY_WINDOW_S, clock=time.time,
                 max_nonces: int = 200_000):
        self.key, self.window_s, self.clock, self.max_nonces = key, window_s, clock, max_nonces
        self._seen: OrderedDict[str, float] = OrderedDict()
        self._lock = threading.Lock()

    def check(self, method: str, path: str, body: bytes, header: str | None,
              need_role: str | None = None) -> str | None:
        """None if the call is authentic, else why not."""
        if not header:
            return f"missing {HEADER.title()} header"
        try:
            fields = dict(p.split("=", 1) for p in header.split(","))
            ts, nonce, role, mac = fields["t"], fields["n"], fields["r"], fields["m"]
            t = float(ts)
        except (ValueError, KeyError):
            return f"malformed {HEADER.title()} header"
        if not hmac.compare_digest(mac, _mac(self.key, method, path, ts, nonce, role, body)):
            return "bad signature"
        now = self.clock()
        if abs(now - t) > self.window_s:
            return f"stale signature ({now - t:+.0f} s off; window {self.window_s:g} s)"
        with self._lock:
            while self._seen and (next(iter(self._seen.values())) < now - self.window_s
                                  or len(self._seen) > self.max_nonces):
                self._seen.popitem(last=False)
            if nonce in self._seen:
                return "replayed request (nonce already used)"
            self._seen[nonce] = now
        if need_role is not None and role != need_role:
            return f"only the {need_role} may call this route (caller: {role})"
        return None


class InternalAuth(httpx.Auth):
    """Signs every request of an ``httpx`` client whose path starts ``/internal/``.

    Example:
        >>> c = httpx.Client(auth=InternalAuth(internal_key("s")))
    """

    requires_request_body = True

    def __init__(self, key: bytes | None, role: str = "router"):
        self.key, self.role = key, role

    def auth_flow(self, request: httpx.Request):
        yield self(request)

    def __call__(self, request):
        """Sign ``request`` in place (also usable as a plain callable auth)."""
        if self.key is not None and request.url.path.startswith("/internal/"):
            path = request.url.path + (f"?{request.url.query.decode()}"
                                       if request.url.query else "")
            request.headers[HEADER] = sign(self.key, request.method, path, request.content,
                                           role=self.role)
        return request


class InternalAuthMiddleware:
    """ASGI middleware: ``/internal/*`` calls must be signed (see the module docstring);
    401 with an OpenAI error body otherwise. The body is read whole (up to
    ``max_body`` bytes) to check it, then handed to the app unchanged."""

    def __init__(self, app, key: bytes, window_s: float = REPLAY_WINDOW_S,
                 max_body: int = MAX_INTERNAL_BODY):
        self.app, self.max_body = app, max_body
        self.verifier = Verifier(key, window_s)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not scope["path"].startswith("/internal/"):
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        header = headers.get(HEADER.encode())
        if header is None:          # refused before reading a byte of the body
            await _reply(send, 401, f"{scope['path']}: missing {HEADER.title()} header",
                         "invalid_signature")
            return
        try:
            declared = int(headers.get(b"content-length", b"0"))
        except ValueError:
            declared = 0
        if declared > self.max_body:
            await _reply(send, 413, f"internal request body over {self.max_body} bytes",
                         "request_too_large")
            return
        chunks, size, more = [], 0, True
        while more:
            msg = await receive()
            if msg["type"] != "http.request":
                return                      # the client went away
            chunks.append(msg.get("body", b""))
            size += len(chunks[-1])
            more = msg.get("more_body", False)
            if size > self.max_body:
                await _reply(send, 413, f"internal request body over {self.max_body} bytes",
                             "request_too_large")
                return
        body = b"".join(chunks)
        path = scope["path"] + (f"?{scope['query_string'].decode()}"
                                if scope.get("query_string") else "")
        why = self.verifier.check(scope["method"], path, body, header.decode(errors="replace"),
                                  need_role="router" if scope["path"] in ROUTER_ONLY else None)
        if why is not None:
            await _reply(send, 401, f"{scope['path']}: {why}", "invalid_signature")
            return
        sent = False

        async def replay():
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()
        await self.app(scope, replay, send)


async def _reply(send, status: int, message: str, code: str) -> None:
    payload = json.dumps({"error": {"message": message, "type": "invalid_request_error",
                                    "param": None, "code": code}}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(payload)).encode())]})
    await send({"type": "http.response.body", "body": payload})
