"""What a request may take of a `tokenmill serve` process, checked ahead of FastAPI, before any of its body is read.

Why before: FastAPI reads a request's whole body (a multipart upload is spooled to the temporary directory) before it
runs the route's dependencies, so anything checked there is checked once all of the body has arrived. Here, in order:

1. a tenant's requests at once, past `max_tenant_requests` (at most `max_http_connections - 1` and
   `request_threads - 1`, so one tenant always leaves the others a request and a handler thread), or its uploads
   (`POST /v1/files`) past `max_tenant_uploads`: 429 with Retry-After;
2. the process's requests at once past `max_http_connections` (requests, not connections: an idle connection
   holds nothing here, and `connections.HeadDeadlineH11Protocol` closes one that sends no head): 503 with Retry-After;
3. a `/v1/` request without a valid key: 401;
4. the key's rate, a token bucket of `rate_limit` a minute and bursts of `rate_burst`: 429 with Retry-After;
5. a body larger than its route's limit (`POST /v1/files`: `max_upload_bytes` and the multipart envelope; any other
   `/v1/` route: `MAX_BODY_BYTES`), by its Content-Length or as it arrives: 413;
6. a body slower than `min_body_rate` bytes a second, counted over the time the server waits for it after a first
   `request_head_timeout` seconds: 408.

Every answer is in OpenAI's error shape and closes the connection. All counts are per server process. The routes
still take the tenant from their `Tenant` dependency.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import Counter
from dataclasses import dataclass
from typing import NoReturn

from starlette.datastructures import Headers
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tokenmill.apps.api.auth import Keys
from tokenmill.apps.api.errors import APIError, upload_too_large
from tokenmill.apps.api.settings import ServeSettings

log = logging.getLogger(__name__)

#: The multipart envelope around an uploaded file (its part headers and boundaries), on top of the file's limit.
MULTIPART_SLACK = 64 * 1024
#: Largest body of any other request: `POST /v1/batches` sends a few hundred bytes.
MAX_BODY_BYTES = 1024 * 1024
UPLOAD_PATH = "/v1/files"
#: What a 429 or 503 for requests at once says to wait: a request of the tenant, or of the server, ends soon.
RETRY_SOON = {"Retry-After": "1"}


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


class _Refused(Exception):
    """Raised into the app by `receive` once its body is refused (too large or too slow)."""


@dataclass
class _Body:
    """One request's body as the app reads it: its limit, its pace, and the refusal that ended it, if any."""

    limit: int | None  # bytes; None: no size limit (routes outside /v1/)
    too_large: APIError | None
    read: int = 0
    waited: float = 0.0  # seconds spent waiting for it
    done: bool = False
    refusal: APIError | None = None
    started: bool = False  # the app began its own response
    answered: bool = False  # the refusal was sent


class RequestGuard:
    """ASGI middleware, outside every route: the checks of the module docstring, in that order."""

    def __init__(self, app: ASGIApp, settings: ServeSettings, keys: Keys) -> None:
        self.app = app
        self.keys = keys
        self.max_upload_bytes = settings.max_upload_bytes
        self.buckets = Buckets(settings.rate_limit, settings.rate_burst)
        self.max_requests = settings.max_http_connections
        self.max_tenant_requests = max(1, min(settings.max_tenant_requests, settings.max_http_connections - 1,
                                              settings.request_threads - 1))
        self.max_tenant_uploads = min(settings.max_tenant_uploads, self.max_tenant_requests)
        if self.max_tenant_requests < settings.max_tenant_requests:
            log.info("a tenant's requests at once: %d (TOKENMILL_MAX_TENANT_REQUESTS %d, capped below "
                     "TOKENMILL_MAX_HTTP_CONNECTIONS and TOKENMILL_REQUEST_THREADS)", self.max_tenant_requests,
                     settings.max_tenant_requests)
        self.min_body_rate = float(settings.min_body_rate)
        self.grace = settings.request_head_timeout
        self.requests = 0
        self.tenant_requests: Counter[str] = Counter()
        self.tenant_uploads: Counter[str] = Counter()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        api = scope["path"].startswith("/v1/")
        upload = api and scope["method"] == "POST" and scope["path"] == UPLOAD_PATH
        headers = Headers(scope=scope)
        tenant, unknown = None, None
        if api:
            try:
                tenant = self.keys.tenant(headers.get("authorization"))
            except APIError as error:
                unknown = error
        try:
            self._check_room(tenant, upload)
            if unknown is not None:
                raise unknown
            if tenant is not None:
                self._check_rate(tenant)
            body = self._body(api, upload)
            if body.limit is not None and int(headers.get("content-length") or 0) > body.limit:
                raise body.too_large
        except APIError as error:
            await answer(error, scope, receive, send)
            return
        self._count(tenant, upload, 1)
        try:
            await self._guarded(scope, receive, send, body)
        finally:
            self._count(tenant, upload, -1)

    def _check_room(self, tenant: str | None, upload: bool) -> None:
        if tenant is not None:
            if self.tenant_requests[tenant] >= self.max_tenant_requests:
                self._too_many(f"at most {self.max_tenant_requests} requests of one key at once "
                               "(TOKENMILL_MAX_TENANT_REQUESTS, and TOKENMILL_REQUEST_THREADS - 1)")
            if upload and self.tenant_uploads[tenant] >= self.max_tenant_uploads:
                self._too_many(f"at most {self.max_tenant_uploads} uploads of one key at once "
                               "(TOKENMILL_MAX_TENANT_UPLOADS)")
        if self.requests >= self.max_requests:
            log.warning("refused a request: %d served at once (TOKENMILL_MAX_HTTP_CONNECTIONS)", self.requests)
            raise APIError(503, f"The server is serving its most requests at once ({self.max_requests}, "
                                "TOKENMILL_MAX_HTTP_CONNECTIONS); try again shortly.", None, "server_overloaded",
                           RETRY_SOON)

    @staticmethod
    def _too_many(what: str) -> NoReturn:
        raise APIError(429, f"Too many requests at once: {what}; try again once one has ended.", None,
                       "rate_limit_exceeded", RETRY_SOON)

    def _check_rate(self, tenant: str) -> None:
        wait = self.buckets.take(tenant)
        if wait:
            raise APIError(429, f"Rate limit reached for this key: at most {self.buckets.rate * 60:g} requests a "
                                f"minute (TOKENMILL_RATE_LIMIT); try again in {wait:.1f} s.", None,
                           "rate_limit_exceeded", {"Retry-After": str(math.ceil(wait))})

    def _body(self, api: bool, upload: bool) -> _Body:
        if upload:
            return _Body(self.max_upload_bytes + MULTIPART_SLACK, upload_too_large(self.max_upload_bytes))
        if api:
            return _Body(MAX_BODY_BYTES, APIError(413, f"request: the body is larger than {MAX_BODY_BYTES} bytes",
                                                  None, "request_too_large"))
        return _Body(None, None)

    def _count(self, tenant: str | None, upload: bool, step: int) -> None:
        self.requests += step
        if tenant is not None:
            _add(self.tenant_requests, tenant, step)
            if upload:
                _add(self.tenant_uploads, tenant, step)

    async def _guarded(self, scope: Scope, receive: Receive, send: Send, body: _Body) -> None:
        """The app, its body cut off past its limit or once it falls behind `min_body_rate`: whatever the app then
        answers (FastAPI turns the error into a 400) is replaced by the 413 or 408, unless it began answering."""

        async def reading() -> Message:
            if body.done:
                return await receive()
            allowed = self.grace + body.read / self.min_body_rate - body.waited
            start = time.monotonic()
            try:
                async with asyncio.timeout(max(allowed, 0.0)):
                    message = await receive()
            except TimeoutError:
                body.refusal = self._too_slow(scope, body)
                raise _Refused from None
            body.waited += time.monotonic() - start
            if message["type"] != "http.request":
                body.done = True
                return message
            body.read += len(message.get("body", b""))
            body.done = not message.get("more_body", False)
            if body.limit is not None and body.read > body.limit:
                body.refusal = body.too_large
                raise _Refused
            return message

        async def answering(message: Message) -> None:
            if body.refusal is None:
                body.started = True
                await send(message)
            else:
                await refuse()

        async def refuse() -> None:
            if body.refusal is not None and not (body.answered or body.started):
                body.answered = True
                await answer(body.refusal, scope, receive, send)

        try:
            await self.app(scope, reading, answering)
        except _Refused:
            pass
        except Exception:
            if body.refusal is None:
                raise
            log.exception("%s %s: the app failed after its body was refused (%d)", scope["method"], scope["path"],
                          body.refusal.status)
        await refuse()

    def _too_slow(self, scope: Scope, body: _Body) -> APIError:
        log.info("%s %s: body slower than %g bytes/s (%d bytes in %.1f s), answered 408", scope["method"],
                 scope["path"], self.min_body_rate, body.read, body.waited)
        return APIError(408, f"request: the body arrived slower than {self.min_body_rate:g} bytes a second "
                             "(TOKENMILL_MIN_BODY_RATE)", None, "request_timeout")


def _add(counter: Counter[str], key: str, step: int) -> None:
    counter[key] += step
    if counter[key] <= 0:
        del counter[key]


async def answer(error: APIError, scope: Scope, receive: Receive, send: Send) -> None:
    """`error` in OpenAI's shape, with its headers; the connection is closed after it, so an unread body is not
    waited for."""
    response = JSONResponse(error.body(), status_code=error.status,
                            headers={"Connection": "close", **(error.headers or {})})
    await response(scope, receive, send)
