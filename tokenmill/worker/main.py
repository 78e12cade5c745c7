"""`tokenmill worker`: load the model once, then run a Celery worker whose tasks feed the engine.

The model is loaded once, in the engine process (`tokenmill.worker.engine_process`); this process
never imports torch. The Celery worker uses the *threads* pool with concurrency = the in-flight
capacity (1.25 x the engine's batch by default): each pool thread holds one job, hands its request to
the engine process and waits for it, so the worker keeps pulling jobs until the batch is full, and a
new job joins the batch at the next engine step. (The prefork pool would load one model per child
process; solo would run one job at a time.)
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
from tokenmill.worker.engine_process import freeze_startup_objects
from tokenmill.worker.settings import WorkerSettings

log = logging.getLogger("tokenmill.worker")

# Celery logs each task's return value ("succeeded in 0.3s: {...text...}") from this logger and each
# received task from the other; the first would put completions in the logs, both cost time per job.
_PER_TASK_LOGGERS = ("celery.app.trace", "celery.worker.strategy")


#: Objects the garbage collector tracks per job the worker holds, about twice what a job was found to hold
#: (docs/benchmarks/queue.md). See `gc_thresholds`.
GC_OBJECTS_PER_JOB = 100
#: Most new objects between collections, whatever the capacity: what cyclic garbage may pile up to and what one
#: collection walks.
GC_MAX_THRESHOLD = 1_000_000


def gc_thresholds(in_flight_capacity: int) -> tuple[int, int, int]:
    """The worker's garbage-collector thresholds (Python's: 700, 10, 10).

    A job's objects (its message, request, result) die with it, by reference count: no cycles (none found in
    `gc.garbage` under `DEBUG_SAVEALL` after thousands of jobs). But a collection comes every `threshold` net
    allocations and walks every young object, so while a worker fills up to its capacity each collection would walk
    the jobs in flight for nothing. At twice the objects a full worker holds, none comes from filling up."""
    return min(GC_MAX_THRESHOLD, max(20_000, GC_OBJECTS_PER_JOB * in_flight_capacity)), 50, 100


def setup_logging(settings: WorkerSettings) -> None:
    """Plain stderr logging; per-task Celery lines only when prompts may be logged."""
    logging.basicConfig(
        level=settings.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s [%(process)d]: %(message)s",
        stream=sys.stderr,
    )
    if not settings.log_prompts:
        for name in _PER_TASK_LOGGERS:
            logging.getLogger(name).setLevel(logging.WARNING)


def lower_priority(increment: int) -> None:
    """Lower this thread's CPU priority, and so that of every thread it starts from now on: the Celery
    consumer and pool threads. The engine process (started already) keeps its priority, so when cores are short the
    engine, which every job in the batch waits on, runs first (docs/benchmarks/annotate.md); where cores are free (a
    GPU host) it changes nothing. (Linux applies nice per thread.)
    """
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
