"""What one client or tenant may hold of a `tokenmill serve` process's HTTP connections, so that it cannot make
another tenant's requests fail.

uvicorn (h11) gives a connection no deadline for its request head, and its `limit_concurrency` counts every open
connection, those that have sent nothing included, answering a request past it with a plain-text 503: anyone who
reached the port could open that many connections, send nothing and shut every tenant out. And nothing bounded one
tenant's requests at once: a few slow uploads held every connection. Here:

* `HeadDeadlineH11Protocol`: a connection that has not delivered a whole request head `request_head_timeout` seconds
  after it opened, or after its previous response ended, is closed (the head's size is bounded by h11: 16 KiB).
* `ConnectionGuard` (ASGI middleware, outside every other): uvicorn's `limit_concurrency` is not used; requests
  (connections that have delivered a head) are counted instead, at most `max_http_connections` at once, past it a
  503 in OpenAI's shape with Retry-After. A tenant may have `max_tenant_requests` of them (at most
  `max_http_connections - 1` and `request_threads - 1`), and `max_tenant_uploads` of those `POST /v1/files`; past either a 429 with
  Retry-After, before any of the body is read. A body must arrive at `min_body_rate` bytes a second, counted over the
  time the server waits for it after a first `request_head_timeout` seconds; a slower one is answered 408.

Connections without a head are bounded only by the descriptors (`resources`) and by the head deadline: put a proxy
that limits connections per client address in front of a server reachable by untrusted clients.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from typing import Any

import h11
from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

from tokenmill.apps.api.auth import Keys
from tokenmill.apps.api.errors import APIError
from tokenmill.apps.api.guard import UPLOAD_PATH, answer
from tokenmill.apps.api.settings import ServeSettings

log = logging.getLogger(__name__)
#: What a 429 or 503 here says to wait: a request of the tenant, or of the server, ends soon.
RETRY_SOON = {"Retry-After": "1"}

class HeadDeadlineH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a deadline for each request head.

    Replaces: nothing of uvicorn's is replaced; `connection_made`, `on_response_complete` and `connection_lost` each
    call uvicorn's, then arm or cancel one timer. Why a subclass: uvicorn 0.55 has no option for it
    (`timeout_keep_alive` starts only once a response has ended, and a byte received cancels it). Relies on h11_impl's
    `transport`, `conn`, `cycle` and `cycle.response_complete`. `serve` runs a subclass with its `head_timeout`
    (`uvicorn_options`)."""

    head_timeout: float = 10.0
    head_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_head_deadline()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._arm_head_deadline()  # the next request's head, or the rest of a body nobody reads

    def connection_lost(self, exc: Exception | None) -> None:
        if self.head_timer is not None:
            self.head_timer.cancel()
        super().connection_lost(exc)

    def _arm_head_deadline(self) -> None:
        if self.head_timer is not None:
            self.head_timer.cancel()
        self.head_timer = self.loop.call_later(self.head_timeout, self._head_deadline_passed)

    def _head_deadline_passed(self) -> None:
        self.head_timer = None
        if self.transport.is_closing() or (self.cycle is not None and not self.cycle.response_complete):
            return  # a request is being served: its response re-arms the deadline
        log.debug("closing %s: no request head within %gs", self.client, self.head_timeout)
        if self.conn.our_state is not h11.ERROR:
            try:
                self.conn.send(h11.ConnectionClosed())
            except h11.LocalProtocolError:
                pass
        self.transport.close()


class _TooSlow(Exception):
    """Raised into the app by `receive` once a body falls behind `min_body_rate`."""


class ConnectionGuard:
    """ASGI middleware: the requests served at once, each tenant's, and the pace of their bodies (module docstring)."""

    def __init__(self, app: ASGIApp, settings: ServeSettings, keys: Keys) -> None:
        self.app = app
        self.keys = keys
        self.max_requests = settings.max_http_connections
        # one tenant always leaves the others a request and a handler thread
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
        tenant = None
        if scope["path"].startswith("/v1/"):
            try:
                tenant = self.keys.tenant(Headers(scope=scope).get("authorization"))
            except APIError:
                pass  # answered 401 by `RequestGuard` before any of its body is read
        upload = scope["method"] == "POST" and scope["path"] == UPLOAD_PATH
        if tenant is not None:
            refusal = None
            if self.tenant_requests[tenant] >= self.max_tenant_requests:
                refusal = (f"at most {self.max_tenant_requests} requests of one key at once "
                           "(TOKENMILL_MAX_TENANT_REQUESTS, and TOKENMILL_REQUEST_THREADS - 1)")
            elif upload and self.tenant_uploads[tenant] >= self.max_tenant_uploads:
                refusal = (f"at most {self.max_tenant_uploads} uploads of one key at once "
                           "(TOKENMILL_MAX_TENANT_UPLOADS)")
            if refusal:
                await answer(APIError(429, f"Too many requests at once: {refusal}; try again once one has ended.",
                                      None, "rate_limit_exceeded"), scope, receive, send, RETRY_SOON)
                return
        if self.requests >= self.max_requests:
            log.warning("refused a request: %d served at once (TOKENMILL_MAX_HTTP_CONNECTIONS)", self.requests)
            await answer(APIError(503, f"The server is serving its most requests at once ({self.max_requests}, "
                                       "TOKENMILL_MAX_HTTP_CONNECTIONS); try again shortly.", None,
                                  "server_overloaded"), scope, receive, send, RETRY_SOON)
            return
        self.requests += 1
        if tenant is not None:
            self.tenant_requests[tenant] += 1
            if upload:
                self.tenant_uploads[tenant] += 1
        try:
            await self._paced(scope, receive, send)
        finally:
            self.requests -= 1
            if tenant is not None:
                _decrement(self.tenant_requests, tenant)
                if upload:
                    _decrement(self.tenant_uploads, tenant)

    async def _paced(self, scope: Scope, receive: Receive, send: Send) -> None:
        """The app, its body read at `min_body_rate` at least: once it falls behind, whatever the app then answers
        (FastAPI turns the error into a 400) is replaced by a 408, the connection closed after it."""
        state: dict[str, Any] = {"waited": 0.0, "read": 0, "done": False, "slow": False, "started": False,
                                 "answered": False}

        async def paced() -> Message:
            if state["done"]:
                return await receive()
            allowed = self.grace + state["read"] / self.min_body_rate - state["waited"]
            start = time.monotonic()
            try:
                async with asyncio.timeout(max(allowed, 0.0)):
                    message = await receive()
            except TimeoutError:
                state["slow"] = True
                raise _TooSlow from None
            state["waited"] += time.monotonic() - start
            if message["type"] == "http.request":
                state["read"] += len(message.get("body", b""))
                state["done"] = not message.get("more_body", False)
            else:
                state["done"] = True
            return message

        async def answering(message: Message) -> None:
            if not state["slow"]:
                state["started"] = True
                await send(message)
            elif not state["answered"] and not state["started"]:
                state["answered"] = True
                await self._too_slow(scope, receive, send, state)

        try:
            await self.app(scope, paced, answering)
        except _TooSlow:
            pass
        except Exception:
            if not state["slow"]:
                raise
        if state["slow"] and not state["answered"] and not state["started"]:
            state["answered"] = True
            await self._too_slow(scope, receive, send, state)

    async def _too_slow(self, scope: Scope, receive: Receive, send: Send, state: dict[str, Any]) -> None:
        log.info("%s %s: body slower than %g bytes/s (%d bytes in %.1f s), answered 408", scope["method"],
                 scope["path"], self.min_body_rate, state["read"], state["waited"])
        await answer(APIError(408, f"request: the body arrived slower than {self.min_body_rate:g} bytes a second "
                                   "(TOKENMILL_MIN_BODY_RATE)", None, "request_timeout"), scope, receive, send)


def _decrement(counter: Counter[str], key: str) -> None:
    counter[key] -= 1
    if counter[key] <= 0:
        del counter[key]


def uvicorn_options(settings: ServeSettings) -> dict[str, Any]:
    """What `uvicorn.run` takes besides the app: h11 with the head deadline (whatever else is installed); no
    `limit_concurrency` (`ConnectionGuard` counts the requests; connections without a head are not counted); no
    WebSocket upgrades (no route takes one, and a WebSocket would escape `ConnectionGuard`'s counts)."""
    protocol = type("ServeH11Protocol", (HeadDeadlineH11Protocol,), {"head_timeout": settings.request_head_timeout})
    return {"http": protocol, "ws": "none", "limit_concurrency": None}
