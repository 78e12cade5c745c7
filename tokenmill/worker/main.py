"""`tokenmill worker`: load the model once, in the engine process, then run a Celery worker whose tasks feed it.

This process never imports torch. Celery's *threads* pool runs with concurrency = `in_flight_capacity`: each pool
thread holds one job and waits on the engine, so the worker keeps taking jobs until the batch is full.
See docs/internals/worker.md, section "Celery and kombu adapters".
"""

from __future__ import annotations

import gc
import logging
import os
import sys
import time

import redis

from tokenmill.worker import control, runtime
from tokenmill.worker.app import app, configure
from tokenmill.worker.engine_process import LOG_FORMAT, freeze_startup_objects
from tokenmill.worker.settings import WorkerSettings

log = logging.getLogger("tokenmill.worker")

# Celery's per-task lines (received; succeeded, with the return value): completions in the logs, and time per job.
_PER_TASK_LOGGERS = ("celery.app.trace", "celery.worker.strategy")


#: Objects the garbage collector tracks per job held: about twice a job's (docs/benchmarks/queue.md; `gc_thresholds`).
GC_OBJECTS_PER_JOB = 100
#: Most new objects between collections, whatever the capacity: bounds cyclic garbage and one collection's walk.
GC_MAX_THRESHOLD = 1_000_000


def gc_thresholds(in_flight_capacity: int) -> tuple[int, int, int]:
    """The worker's garbage-collector thresholds (Python's: 700, 10, 10). A job's objects die by reference count,
    but each collection walks every young object, jobs in flight included; at twice the objects a full worker holds,
    filling up triggers none."""
    return min(GC_MAX_THRESHOLD, max(20_000, GC_OBJECTS_PER_JOB * in_flight_capacity)), 50, 100


def setup_logging(settings: WorkerSettings) -> None:
    """Plain stderr logging; per-task Celery lines only when prompts may be logged."""
    logging.basicConfig(
        level=settings.log_level.upper(),
        format=LOG_FORMAT,
        stream=sys.stderr,
    )
    if not settings.log_prompts:
        for name in _PER_TASK_LOGGERS:
            logging.getLogger(name).setLevel(logging.WARNING)


def lower_priority(increment: int) -> None:
    """Lower this thread's CPU priority, and so that of every thread it starts from now on (Linux applies nice per
    thread): Celery's consumer and pool threads. The engine process, started already, keeps its priority, so it runs
    first when cores are short."""
    if increment:
        os.nice(increment)


class BrokerUnavailable(RuntimeError):
    """The broker or result backend did not answer within `broker_wait` seconds of the start."""


def wait_for_redis(settings: WorkerSettings) -> None:
    """Before the model loads: the broker and the result backend answer a PING within `broker_wait` seconds, or
    `BrokerUnavailable` names them (without passwords) and the last error."""
    from kombu.utils.url import maybe_sanitize_url

    from tokenmill.queue.app import socket_options
    from tokenmill.queue.tls import redis_client

    deadline = time.monotonic() + settings.broker_wait
    for url in dict.fromkeys((settings.broker_url, settings.backend_url)):
        client = redis_client(url, **socket_options(min(settings.redis_socket_timeout, 5.0)))
        while True:
            try:
                client.ping()
                break
            except redis.RedisError as exc:
                if time.monotonic() >= deadline:
                    raise BrokerUnavailable(f"{maybe_sanitize_url(url)} did not answer within {settings.broker_wait:g}s "
                                            f"({exc})") from exc
                time.sleep(0.5)
        client.close()


def run_worker(settings: WorkerSettings) -> int:
    """Run until SIGTERM/SIGINT; returns the process exit code."""
    setup_logging(settings)
    settings.engine_model()  # ModelLoadError before waiting on a broker
    wait_for_redis(settings)
    configure(app, settings)
    app.conf.broker_transport_options = {**app.conf.broker_transport_options, "take_at_least": settings.take_at_least}
    control.allow_state_changes(settings.remote_control_writes)
    service = runtime.start(settings)  # the process's one service (`tokenmill.worker.runtime`)
    capacity = settings.in_flight_capacity
    log.info(
        "worker ready: model=%s queues=%s concurrency=%d visibility_timeout=%.1fs metrics_port=%s",
        settings.model, ",".join(settings.queues or []), capacity, settings.visibility_timeout, service.metrics.port or "off",
    )
    worker = app.Worker(
        hostname=service.hostname,
        pool_cls="threads",
        concurrency=capacity,
        queues=settings.queues,
        loglevel=settings.log_level.upper(),
        without_mingle=True,  # no start-up handshake with other workers: nothing of ours needs it
        without_gossip=True,
        quiet=True,
    )
    freeze_startup_objects()  # Celery, kombu, redis and pydantic's objects too
    gc.set_threshold(*gc_thresholds(capacity))
    lower_priority(settings.worker_nice)
    try:
        worker.start()
    finally:
        service.close()
    log.info("worker stopped")
    return worker.exitcode or 0
