"""The API key, the key's request rate and the body's size, checked ahead of FastAPI, before a request's body is read.

Why: FastAPI reads a request's whole body (a multipart upload is spooled to the temporary directory) before it runs
the route's dependencies, so a request without a key, or larger than the limit, was refused only once all of it had
arrived: anyone who reached the port could fill the server's disk, one upload at a time (a chunked request has no
Content-Length to check first). Here every `/v1/` request without a valid key is answered 401 before any of its body
is read, and a body is cut off at its route's limit (`POST /v1/files`: `max_upload_bytes` and the multipart envelope;
any other: `MAX_BODY_BYTES`) with a 413. The routes still take the tenant from their `Tenant` dependency.

Each tenant's requests are rate-limited by a token bucket (`rate_limit` a minute, bursts of `rate_burst`), per server
process: past it a 429 in OpenAI's shape with `Retry-After`, so that one tenant's loop cannot slow the others' calls.
"""

from __future__ import annotations

import math
import time
from typing import Any

from starlette.datastructures import Headers
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tokenmill.apps.api.auth import Keys
from tokenmill.apps.api.errors import APIError, upload_too_large

#: The multipart envelope around an uploaded file (its part headers and boundaries), on top of the file's limit.
MULTIPART_SLACK = 64 * 1024
#: Largest body of any other request: `POST /v1/batches` sends a few hundred bytes.
MAX_BODY_BYTES = 1024 * 1024
UPLOAD_PATH = "/v1/files"


class _TooLarge(Exception):
    """Raised into the app by `receive` once a body passes its limit."""


class Buckets:
    """A token bucket per tenant: `per_minute` tokens a minute, at most `burst` saved up; one token a request."""

    def __init__(self, per_minute: float, burst: int) -> None:
        self.rate = per_minute / 60.0
        self.burst = float(burst)
        self._buckets: dict[str, tuple[float, float]] = {}  # tenant -> (tokens, when counted); bounded by the keys

    def take(self, tenant: str) -> float:
        """0 when the request may go, else the seconds until it may."""
        now = time.monotonic()
        tokens, then = self._buckets.get(tenant, (self.burst, now))
        tokens = min(self.burst, tokens + (now - then) * self.rate)
        if tokens >= 1.0:
            self._buckets[tenant] = (tokens - 1.0, now)
            return 0.0
        self._buckets[tenant] = (tokens, now)
        return (1.0 - tokens) / self.rate


class RequestGuard:
    """ASGI middleware: the key, its rate, then the body's size (see the module docstring)."""

    def __init__(self, app: ASGIApp, keys: Keys, max_upload_bytes: int, rate_limit: float,
                 rate_burst: int) -> None:
        self.app = app
        self.keys = keys
        self.max_upload_bytes = max_upload_bytes
        self.buckets = Buckets(rate_limit, rate_burst)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith("/v1/"):
            await self.app(scope, receive, send)
            return
        upload = scope["method"] == "POST" and scope["path"] == UPLOAD_PATH
        limit = self.max_upload_bytes + MULTIPART_SLACK if upload else MAX_BODY_BYTES
        too_large = upload_too_large(self.max_upload_bytes) if upload else APIError(
            413, f"request: the body is larger than {MAX_BODY_BYTES} bytes", None, "request_too_large")
        headers = Headers(scope=scope)
        try:
            wait = self.buckets.take(self.keys.tenant(headers.get("authorization")))
            if wait:
                await answer(APIError(429, f"Rate limit reached for this key: at most {self.buckets.rate * 60:g} "
                                            f"requests a minute (TOKENMILL_RATE_LIMIT); try again in {wait:.1f} s.",
                                       None, "rate_limit_exceeded"), scope, receive, send,
                              {"Retry-After": str(math.ceil(wait))})
                return
            if int(headers.get("content-length") or 0) > limit:
                raise too_large
        except APIError as exc:
            await answer(exc, scope, receive, send)
            return
        await self._limited(scope, receive, send, limit, too_large)

    async def _limited(self, scope: Scope, receive: Receive, send: Send, limit: int, too_large: APIError) -> None:
        """The app, its body cut off past `limit`: whatever it then answers (FastAPI turns the error into a 400) is
        replaced by the 413."""
        state: dict[str, Any] = {"read": 0, "over": False, "answered": False}

        async def counted() -> Message:
            message = await receive()
            if message["type"] == "http.request":
                state["read"] += len(message.get("body", b""))
                if state["read"] > limit:
                    state["over"] = True
                    raise _TooLarge
            return message

        async def answering(message: Message) -> None:
            if not state["over"]:
                await send(message)
            elif not state["answered"]:
                state["answered"] = True
                await answer(too_large, scope, receive, send)

        try:
            await self.app(scope, counted, answering)
        except _TooLarge:
            pass
        if state["over"] and not state["answered"]:
            await answer(too_large, scope, receive, send)


async def answer(error: APIError, scope: Scope, receive: Receive, send: Send,
                  headers: dict[str, str] | None = None) -> None:
    """`error` in OpenAI's shape; the connection is closed after it, so an unread body is not waited for."""
    response = JSONResponse(error.body(), status_code=error.status, headers={"Connection": "close", **(headers or {})})
    await response(scope, receive, send)
