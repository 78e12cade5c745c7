"""The Celery app as both sides of the queue configure it; with no task registered, it is what a producer needs.

`queue_app(settings)` publishes jobs and reads their results (`tokenmill.client.Client` uses it); the worker's
app (`tokenmill.worker.app`) is this app plus the worker's own settings and its tasks. Torch-free.

Every setting below is chosen for "a crash loses nothing, a slow job is not run twice":

* JSON only (`accept_content`, `result_accept_content`): a pickle or YAML message is refused by the
  worker before anything in it is decoded, so a message on the queue can never execute code.
* `broker_transport`: tokenmill's Redis transport (`tokenmill.queue.transport`): a message moves from
  the queue to a per-consumer processing list in one command (BLMOVE) and from there into kombu's
  unacked records in one Lua script, so it is never on no list; a consumer that died between the
  two has its processing list requeued once its heartbeat (`consumer_ttl` = visibility timeout)
  expired. Malformed raw items are set aside instead of stopping the consumer.
* `broker_transport_options.visibility_timeout`: kombu's Redis transport redelivers an unacked
  message once it has been unacked for longer than this. Kombu measures it from the delivery, not
  from the last sign of life, so on its own a short timeout would rerun slow jobs while they still
  run; the worker therefore renews the delivery time of every message it holds
  (`tokenmill.worker.leases`) every `visibility_timeout / 8` seconds. The timeout then only bounds
  how long a *crashed* worker's jobs wait, and can be short (`TOKENMILL_VISIBILITY_TIMEOUT`).
* `unacked_restore_interval` = visibility_timeout / 8 (at most 5 s) and `unacked_restore_throttle`
  = 1: how often each worker sweeps for expired messages and dead consumers' processing lists (a
  worker also sweeps once when it starts). Kombu's defaults (every 10 s, but scanning only every
  10th time) add up to 100 s to a recovery. Since the last lease renewal happened at most
  visibility_timeout / 8 before a crash, the jobs of a crashed worker run again between 0.875 x and
  1 x visibility_timeout + one sweep interval after it died (docs/guides/delivery-guarantees.md).
* `unacked_mutex_expire`: the lock a sweep holds; a worker killed during a sweep would block all
  sweeps for kombu's default 300 s, so it is bounded by the visibility timeout (at least 5 s).
* `result_backend_always_retry`: a result write during a Redis outage waits (backoff capped at 1 s)
  until Redis is back instead of failing the job.
* `broker_connection_max_retries=None`: a worker keeps reconnecting to a restarted Redis forever.
* `socket_timeout` (broker, results and the worker's own client; `redis_socket_timeout`, 30 s), with keepalive and
  kombu's `health_check_interval` at most that: a connection whose peer went silent without closing it (a paused
  server, a dropped route) fails its call, which is retried on a new connection. Without it the worker's event loop
  can wait for good on such a connection inside a sweep, and take no job again.
* `broker_use_ssl`, `redis_backend_use_ssl`: for a `rediss://` URL, TLS with the server's certificate
  verified (`tokenmill.queue.tls`); without them kombu would connect to a `rediss://` URL in plaintext
  (its TLS switch is the transport's name, and ours is `BROKER_TRANSPORT`).
"""

from __future__ import annotations

from typing import Any

from celery import Celery

from tokenmill.queue import fastjson
from tokenmill.queue.settings import QueueSettings
from tokenmill.queue.tls import redis_tls

#: kombu transport of every tokenmill app: kombu's Redis transport with an atomic take-and-record of
#: each message (`tokenmill.queue.transport`). Producers publish exactly as with plain `redis://`.
BROKER_TRANSPORT = "tokenmill.queue.transport:Transport"


def transport_options(visibility_timeout: float, socket_timeout: float = 30.0) -> dict[str, Any]:
    """kombu Redis transport options for a given visibility timeout (see the module docstring)."""
    return {
        **socket_options(socket_timeout),
        # kombu's checks of its long-lived connections (a BRPOP reply overdue by this much is dropped and retaken)
        "health_check_interval": min(25.0, socket_timeout),
        "visibility_timeout": visibility_timeout,
        "consumer_ttl": max(1.0, visibility_timeout),
        "unacked_restore_interval": min(5.0, max(0.25, visibility_timeout / 8)),
        "unacked_restore_throttle": 1,
        "unacked_mutex_expire": int(max(5, min(300, visibility_timeout))),
    }


def socket_options(timeout: float) -> dict[str, Any]:
    """redis-py's socket options for a bound on every call (see `redis_socket_timeout`): a silent peer raises
    `TimeoutError`, which the callers retry on a new connection, instead of holding the calling thread for good."""
    return {"socket_timeout": timeout, "socket_connect_timeout": min(10.0, timeout), "socket_keepalive": True}


def celery_config(settings: QueueSettings) -> dict[str, Any]:
    """The Celery configuration both sides share; every value is explained in the module docstring."""
    broker_url, broker_tls = redis_tls(settings.broker_url)
    backend_url, backend_tls = redis_tls(settings.backend_url)
    return {
        "broker_url": broker_url,
        "broker_transport": BROKER_TRANSPORT,
        "broker_use_ssl": broker_tls or False,
        "result_backend": backend_url,
        "redis_backend_use_ssl": backend_tls,
        "task_serializer": "json",
        "result_serializer": "json",
        "accept_content": ["json"],
        "result_accept_content": ["json"],
        "task_default_queue": settings.queue,
        "result_expires": settings.result_expires,
        "result_backend_always_retry": True,
        "result_backend_max_sleep_between_retries_ms": 1000,
        "broker_transport_options": transport_options(settings.visibility_timeout, settings.redis_socket_timeout),
        **{f"redis_{name}": value for name, value in socket_options(settings.redis_socket_timeout).items()},
        "broker_connection_retry_on_startup": True,
        "broker_connection_max_retries": None,
    }


def queue_app(settings: QueueSettings | None = None) -> Celery:
    """A new Celery app for `settings`, with no task registered: it sends task messages and reads results."""
    fastjson.register_with_kombu()
    app = Celery("tokenmill", set_as_current=False)
    app.conf.update(celery_config(settings or QueueSettings()))
    return app
