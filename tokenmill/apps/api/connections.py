"""The HTTP connections of a `tokenmill serve` process: a deadline for each request head.

uvicorn (h11) gives a connection no deadline for its request head: anyone who reached the port could hold
connections open, sending nothing. `HeadDeadlineH11Protocol` closes a connection that has not delivered a whole
request head `request_head_timeout` seconds after it opened, or after its previous response ended (the head's size is
bounded by h11: 16 KiB). What a request may take once its head has come is `guard.RequestGuard`'s.

Connections without a head are bounded only by the descriptors (`resources`) and by this deadline: put a proxy that
limits connections per client address in front of a server reachable by untrusted clients.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from tokenmill.apps.api.settings import ServeSettings

log = logging.getLogger(__name__)


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


def uvicorn_options(settings: ServeSettings) -> dict[str, Any]:
    """What `uvicorn.run` takes besides the app: h11 with the head deadline (whatever else is installed); no
    `limit_concurrency` (`guard.RequestGuard` counts the requests; connections without a head are not counted); no
    WebSocket upgrades (no route takes one, and a WebSocket would escape `RequestGuard`'s counts)."""
    protocol = type("ServeH11Protocol", (HeadDeadlineH11Protocol,), {"head_timeout": settings.request_head_timeout})
    return {"http": protocol, "ws": "none", "limit_concurrency": None}
