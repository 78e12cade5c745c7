"""What one `tokenmill serve` process may hold, whatever the load (issue 57): threads, Redis connections, descriptors.

Threads: the event loop's; the supervisor's, the webhook deliverer's and the results subscription's reader
(`SharedSubscription`); at most `max_drivers` drivers (`driver.Supervisor`); at most `request_threads` running request
handlers (FastAPI's thread pool, `bound_the_loop`).

Redis connections, at most `redis_connections + 2 * max_publishers`:

* one pool of at most `redis_connections` on the result backend's Redis (`Records.redis`, redis-py's
  `BlockingConnectionPool`), which every part of the server borrows from: the request handlers, the supervisor, the
  webhook deliverer and the drivers (a command at a time), and every queue client of the server (`Connections.client`:
  its result reads, cancels and run lists). Every wait for results, a driver's or a request's, is fed by one pub/sub
  connection of that pool, the server's `SharedSubscription`, held from the first wait on. A thread that finds every
  connection taken waits for one, `redis_socket_timeout` seconds at most, where redis-py's default pool raised
  `MaxConnectionsError` at once.
* the broker connections of the queue clients that are publishing: kombu's Redis channel holds two (its pool's, and
  the one it pings when it opens). At most `max_publishers` clients publish at once (`Connections.publishing`), and a
  client's channels are closed when its publishing ends.

Descriptors: at start the soft RLIMIT_NOFILE is raised to the hard limit (`raise_open_files_limit`, logged); a request
past `max_http_connections` is answered 503, and a connection that sends no whole request head within
`request_head_timeout` is closed (`tokenmill.apps.api.connections`). Until then it holds a descriptor; when none is left, an accept fails. CPython's accept handler then goes on to try every
other connection waiting in the listen backlog, each failure reported and each scheduling its own retry; the server's
(`AcceptBackoff`) stops at the first failure and pauses that listening socket, longer while accepts keep failing, and
`AcceptErrors` logs the failures once a second, with the count.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import resource
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from tokenmill.apps.api.settings import ServeSettings
from tokenmill.client import Client, SharedSubscription

log = logging.getLogger(__name__)

#: The message CPython's event loop reports an accept failing for want of descriptors (or memory) with.
ACCEPT_FAILED = "socket.accept() out of system resource"
#: The errors of such an accept: it may succeed once descriptors (or memory) free, not before.
_OUT_OF_RESOURCE = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})


class Connections:
    """The server's queue clients: their result reads on the records' bounded pool (`redis`), their waits for results
    on one subscription (`results`), their publishing `max_publishers` at a time."""

    def __init__(self, settings: ServeSettings, redis: Any) -> None:
        self.settings = settings
        self.redis = redis
        self.results = SharedSubscription(redis, confirm_timeout=settings.redis_socket_timeout)
        self._publishers = threading.BoundedSemaphore(settings.max_publishers)

    def client(self, share: str | None = None) -> Client:
        """A queue client (close it after use) whose results and cancels go through `redis`'s pool (the Celery
        backend's own pool is never made) and whose waits share the server's subscription (`results`)."""
        client = Client(self.settings.broker_url, result_backend=self.settings.result_backend,
                        queue=self.settings.queue, share=share, subscription=self.results)
        client.app.backend.client = self.redis  # both are on `backend_url`
        return client

    def close(self) -> None:
        """Give the subscription's connection back (at shutdown, once no wait is left)."""
        self.results.close()

    @contextmanager
    def publishing(self, client: Client, waiting: Callable[[], None], interval: float) -> Iterator[None]:
        """Publish with `client` inside: waits for one of the `max_publishers` turns, calling `waiting()` every
        `interval` seconds meanwhile (it raises to give up: a driver's heartbeat, a request's deadline). On leaving,
        the client's broker channels are closed (it publishes again on new ones, under another turn)."""
        while not self._publishers.acquire(timeout=interval):
            waiting()
        try:
            yield
        finally:
            try:
                client.publisher.close()
            finally:
                self._publishers.release()


def raise_open_files_limit(settings: ServeSettings) -> None:
    """Raise the soft limit of open descriptors to the hard one, and log it (a warning when it is below what the
    settings' bounds may take)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard
    if hard == resource.RLIM_INFINITY:  # Linux refuses more than fs.nr_open
        try:
            target = int(Path("/proc/sys/fs/nr_open").read_text())
        except (OSError, ValueError):
            target = soft
    if target > soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError) as exc:
            log.warning("could not raise the open files limit from %d to %d: %s", soft, target, exc)
    needed = descriptors_needed(settings)
    if soft < needed:
        log.warning("open files limit %d (hard %d), below the %d the settings' bounds may take: past it new "
                    "connections wait in the listen backlog (raise `ulimit -n`, or lower "
                    "TOKENMILL_MAX_HTTP_CONNECTIONS)",
                    soft, hard, needed)
    else:
        log.info("open files limit %d (hard %d); the settings' bounds take about %d, with connections still sending "
                 "their request head (each closed within TOKENMILL_REQUEST_HEAD_TIMEOUT) beyond", soft, hard, needed)


def descriptors_needed(settings: ServeSettings) -> int:
    """Descriptors the bounds allow the server (connections without a whole request head aside, which only the head
    deadline bounds): its requests' HTTP connections and Redis connections, a file open by each
    driver and request thread (two for a driver writing its output while it reads its input), and a margin for the
    process's own (standard streams, the event loop's, the listening socket, the store's client)."""
    return (settings.max_http_connections + settings.redis_connections + 2 * settings.max_publishers
            + 2 * settings.max_drivers + settings.request_threads + 64)


class AcceptErrors:
    """The event loop's exception handler: `ACCEPT_FAILED` logged at most once every `interval` seconds, with how
    many were not; anything else to the handler before it (or the loop's default)."""

    def __init__(self, previous: Callable[[asyncio.AbstractEventLoop, dict[str, Any]], None] | None,
                 interval: float = 1.0) -> None:
        self.previous = previous
        self.interval = interval
        self._logged = float("-inf")
        self._unlogged = 0

    def __call__(self, loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        if context.get("message") != ACCEPT_FAILED:
            if self.previous is not None:
                self.previous(loop, context)
            else:
                loop.default_exception_handler(context)
            return
        now = time.monotonic()
        if now - self._logged < self.interval:
            self._unlogged += 1
            return
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        log.error("%s: %s (%d more since the last report); open files limit %d: new connections wait in the listen "
                  "backlog until some close", ACCEPT_FAILED, context.get("exception"), self._unlogged, soft)
        self._logged, self._unlogged = now, 0


class AcceptBackoff:
    """A selector event loop's accept handler (`_accept_connection`, which the loop registers for each listening
    socket), except for an accept that fails for want of descriptors or memory: the round of accepts ends there and
    the socket is not read for `first` seconds, twice as long after each further such failure up to `longest`, back
    to `first` once an accept succeeds. The failure goes to the loop's exception handler as CPython reports it
    (`ACCEPT_FAILED`). Accepted connections are handed to the loop's own `_accept_connection2`, as CPython's
    handler does."""

    def __init__(self, loop: asyncio.AbstractEventLoop, first: float = 0.05, longest: float = 1.0) -> None:
        self.loop: Any = loop
        self.first = first
        self.longest = longest
        self._pauses: dict[int, float] = {}  # listening socket's descriptor -> its next pause

    def __call__(self, protocol_factory: Any, sock: Any, sslcontext: Any = None, server: Any = None,
                 backlog: int = 100, *timeouts: Any) -> None:
        for _ in range(backlog):
            try:
                conn, address = sock.accept()
                conn.setblocking(False)
            except (BlockingIOError, InterruptedError, ConnectionAbortedError):
                return  # none waiting
            except OSError as exc:
                if exc.errno not in _OUT_OF_RESOURCE:
                    raise  # the loop logs it, as CPython's handler lets it
                self._pause(exc, (protocol_factory, sock, sslcontext, server, backlog, *timeouts))
                return
            self._pauses.pop(sock.fileno(), None)
            self.loop.create_task(self.loop._accept_connection2(protocol_factory, conn, {"peername": address},
                                                                sslcontext, server, *timeouts))

    def _pause(self, exc: OSError, serving: tuple[Any, ...]) -> None:
        """Report the failure, stop reading the socket, and start serving it again after its pause."""
        sock = serving[1]
        pause = self._pauses.get(sock.fileno(), self.first)
        self._pauses[sock.fileno()] = min(self.longest, 2 * pause)
        self.loop.call_exception_handler({"message": ACCEPT_FAILED, "exception": exc,
                                          "socket": asyncio.trsock.TransportSocket(sock)})
        self.loop._remove_reader(sock.fileno())
        self.loop.call_later(pause, self.loop._start_serving, *serving)


def pause_accepts_when_out_of_descriptors(loop: asyncio.AbstractEventLoop) -> bool:
    """Install `AcceptBackoff` on `loop` (before it serves): True where it could, a selector event loop (asyncio's
    default on Linux and macOS, uvicorn's without uvloop); another loop keeps its own handler."""
    if not (isinstance(loop, asyncio.selector_events.BaseSelectorEventLoop)
            and callable(getattr(loop, "_accept_connection2", None))
            and callable(getattr(loop, "_start_serving", None))):
        log.warning("event loop %s: its own accept handler is kept (it may retry accepts often while no descriptor "
                    "is left)", type(loop).__name__)
        return False
    loop._accept_connection = AcceptBackoff(loop)  # type: ignore[attr-defined]
    return True


def bound_the_loop(settings: ServeSettings) -> None:
    """In the server's event loop, at start (before it listens): request handlers on at most `request_threads`
    threads, accepts paused while descriptors run out (`AcceptBackoff`), their failures logged once a second
    (`AcceptErrors`)."""
    import anyio.to_thread

    anyio.to_thread.current_default_thread_limiter().total_tokens = settings.request_threads
    loop = asyncio.get_running_loop()
    loop.set_exception_handler(AcceptErrors(loop.get_exception_handler()))
    pause_accepts_when_out_of_descriptors(loop)
