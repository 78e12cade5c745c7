"""`WorkerService`: what a worker does with a job, from its Celery message to its stored result.

It owns the engine process, the S3 sink, the metrics, a Redis client, the single-job intake and its finisher. Every
job runs through `tokenmill.worker.batch_task.BatchRun` on this service's steps: parse, claim, admit, generate,
complete, store and ack. Each job gets exactly one result, and its message is acked only once that result is stored;
past `shutdown_grace` after SIGTERM, unfinished jobs are requeued.
See docs/internals/worker.md, section "The pipeline".
"""

from __future__ import annotations

import logging
import os
import itertools
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any

import redis
from celery.utils.nodenames import default_nodename, host_format
from redis.backoff import ExponentialBackoff
from redis.retry import Retry

from tokenmill.queue.app import socket_options
from tokenmill.queue.batching import Coalescer, HeldScript
from tokenmill.queue.names import CANCEL_KEY, DELIVERIES_KEY
from tokenmill.queue.schemas import Job
from tokenmill.queue.served import Announcer
from tokenmill.queue.tls import redis_client
from tokenmill.queue.transport import hand_back_held
from tokenmill.worker.admission import CHECK_IN, Attempt, CheckIn, Decision, Run, admission
from tokenmill.worker.cancel_listener import CancelListener
from tokenmill.worker.cpus import format_cpu_list, pin_process, placement
from tokenmill.worker.engine_process import EngineProcess, Sink
from tokenmill.worker.finisher import Finisher
from tokenmill.worker.intake import Intake
from tokenmill.worker.metrics import WorkerMetrics
from tokenmill.worker.outcomes import Outcomes
from tokenmill.worker.settings import WorkerSettings
from tokenmill.worker.sinks import RetryPolicy, S3Sink

log = logging.getLogger("tokenmill.worker")

FATAL_EXIT_CODE = 70  # EX_SOFTWARE: the engine failed; a supervisor restarts the worker
HAND_BACK_TIMEOUT = 10.0  # seconds a stalled worker tries to requeue its held messages before it exits anyway
#: Seconds after which a worker exiting for its engine exits even if logging or the hand-back blocks (`_exit_watchdog`).
EXIT_WATCHDOG_SECONDS = HAND_BACK_TIMEOUT + 5.0
CHECK_IN_LIMIT = 500  # single jobs per check-in script call (Redis runs a script alone) and per engine message
STORE_LIMIT = 8  # groups' result stores per script call (each at most a group's jobs; Redis runs a script alone)

# KEYS: n result keys, then pairs of unacked hash and unacked index. ARGV[1]: the results' expiry in seconds,
# ARGV[2]: n, ARGV[2 + i]: the encoded result for KEYS[i]; then per pair a count and that many delivery tags.
# SET NX never overwrites a stored result; only a new one is published. The tags are acked as kombu acks them
# (ZREM, HDEL) in the same script, so a message is acked exactly when its job's result is stored.
_STORE = """
local n = tonumber(ARGV[2])
local new = 0
for i = 1, n do
  if redis.call('SET', KEYS[i], ARGV[i + 2], 'EX', ARGV[1], 'NX') then
    redis.call('PUBLISH', KEYS[i], ARGV[i + 2])
    new = new + 1
  end
end
local at = n + 3
for k = n + 1, #KEYS, 2 do
  local last = at + tonumber(ARGV[at])
  for first = at + 1, last, 1000 do
    local upto = math.min(first + 999, last)
    redis.call('ZREM', KEYS[k + 1], unpack(ARGV, first, upto))
    redis.call('HDEL', KEYS[k], unpack(ARGV, first, upto))
  end
  at = last + 1
end
return new
"""


class WorkerService(Outcomes):
    """One per worker process; its steps are thread-safe. Owns its `intake` and `finisher`; an `intake` given (one
    Celery fed before this service existed) is served by this service alone, and only once `start` succeeded."""

    def __init__(self, settings: WorkerSettings, engine: EngineProcess, metrics: WorkerMetrics, sink: S3Sink | None,
                 intake: Intake | None = None) -> None:
        self.settings = settings
        self.engine = engine
        self.metrics = metrics
        self.sink = sink
        self.hostname = host_format(default_nodename(settings.hostname))  # Celery's node name, "%h" expanded
        # Every call has a bound: a silent peer times out and the call is retried on a new connection, instead of
        # holding every job thread waiting on it for good.
        self.redis = redis_client(
            settings.backend_url,
            retry=Retry(ExponentialBackoff(cap=1.0, base=0.05), retries=120),
            retry_on_error=[redis.ConnectionError, redis.TimeoutError],
            **socket_options(settings.redis_socket_timeout),
        )
        self._check_in_script = HeldScript(self.redis, CHECK_IN)
        self._store_script = HeldScript(self.redis, _STORE)
        self._running: dict[str, Future | None] = {}  # job id -> the future a joining delivery waits on
        self._engine_ids: dict[str, str] = {}  # job id -> its engine request id, while it generates
        self._cancelling: set[str] = set()  # running jobs asked to stop (applied at submit if not submitted yet)
        self._request_numbers = itertools.count()  # engine request ids: a job's runs here never share one
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self.grace_expired = threading.Event()
        self.cancels = CancelListener(self.redis, self.running_ids, self.cancel_running)
        self.announcer = Announcer(self.redis, self.hostname, settings.model, settings.queues or [settings.queue])
        # pool threads' check-ins and engine requests: one call of each for those that need one at once
        self._admits: Coalescer[tuple[Attempt, bytes], tuple[Decision, tuple[Future | None, str] | None]] = Coalescer(
            self._admit_many, limit=CHECK_IN_LIMIT)
        # results stored by several groups at once: one script call
        self._stores: Coalescer[tuple[dict[bytes, bytes], Sequence[tuple[str, str, str]]], None] = Coalescer(
            self._store_many, limit=STORE_LIMIT)
        # single jobs in groups: the finisher settles each turn's runs inside the intake's `holding_acks`
        self.intake = intake if intake is not None else Intake()
        self.finisher = Finisher(settling=self.intake.holding_acks)

    @classmethod
    def start(cls, settings: WorkerSettings, intake: Intake | None = None) -> WorkerService:
        """Start the metrics endpoint (first: a port problem fails before an engine exists), the engine process, the
        cancel listener and the announcer, then serve `intake`. A start that raises leaves nothing behind (all
        stopped, metrics unregistered, `intake` not served), so the process may build a service again."""
        started = time.monotonic()
        model = settings.engine_model()
        metrics = WorkerMetrics()
        engine: EngineProcess | None = None
        service: WorkerService | None = None
        try:
            metrics.serve(settings.metrics_port, settings.metrics_addr, tries=settings.metrics_port_tries)
            cpus = placement(settings.engine_cpus)  # (the engine's, the worker's), or None
            engine = EngineProcess(
                model, settings.engine_options(), on_fatal=exit_on_engine_failure, on_stats=metrics.on_engine_status,
                cpus=cpus[0] if cpus else None, on_stall=_exit_on_engine_stall,
                stall_timeout=settings.engine_stall_timeout,
            )
            metrics.engine_stalled.set_function(engine.stalled_for)
            engine.start()
            log.info("engine process ready with model %s after %.1fs", settings.model, time.monotonic() - started)
            if cpus:
                pin_process(cpus[1])
                log.info("engine process on CPU %s, the worker on CPU %s", *map(format_cpu_list, cpus))
            sink = S3Sink(
                settings.s3_endpoint_url,
                settings.s3_region,
                RetryPolicy(max_delay=settings.s3_retry_max_delay),
                on_retry=metrics.output_retries.inc,
            )
            service = cls(settings, engine, metrics, sink, intake)
            service.cancels.start()
            service.announcer.start()  # the model is loaded: `tokenmill serve` may send it jobs
            service.intake.serve(service)
        except BaseException:
            try:
                if service is not None:
                    service.close()  # its threads, and the engine process
                elif engine is not None:
                    engine.stop(timeout=10)  # also one still loading its model
            finally:
                metrics.close()
            raise
        return service

    # -- lifecycle -----------------------------------------------------------------------------

    def begin_shutdown(self) -> None:
        """SIGTERM: running jobs may finish within `shutdown_grace`; after that they are requeued."""
        if self._stopping.is_set():
            return
        self._stopping.set()
        log.info("shutting down: finishing %d in-flight jobs (grace %.0fs)", len(self._running), self.settings.shutdown_grace)
        timer = threading.Timer(self.settings.shutdown_grace, self.grace_expired.set)
        timer.daemon = True
        timer.start()

    @property
    def shutting_down(self) -> bool:
        return self._stopping.is_set()

    def close(self) -> None:
        self.grace_expired.set()
        self.announcer.stop()
        self.cancels.stop()
        self.engine.stop(timeout=10)

    # -- the steps of a run (`tokenmill.worker.batch_task.BatchRun`) ---------------------------------

    def claim(self, jobs: list[Job]) -> tuple[list[Job], list[tuple[Job, Future]]]:
        """Register `jobs` as running here; returns (jobs now mine; jobs already running here, with a future of that
        run's result). Only jobs now mine count as deliveries. A run's future is made only once a delivery joins it."""
        mine, running = [], []
        with self._lock:
            for job in jobs:
                if job.id not in self._running:
                    self._running[job.id] = None
                    mine.append(job)
                    continue
                joined = self._running[job.id]
                if joined is None:
                    joined = self._running[job.id] = Future()
                running.append((job, joined))
        return mine, running

    def release(self, jobs: list[Job], results: dict[str, Any] | None = None, error: BaseException | None = None) -> None:
        """These jobs' runs here ended: a delivery that joined one gets its result in `results` (None: none, such as a
        result found stored) or `error`. A delivery from now on is a new one (counted; it finds the result stored)."""
        with self._lock:
            joined = [(job, future) for job in jobs if (future := self._running.pop(job.id, None)) is not None]
            for job in jobs:
                self._engine_ids.pop(job.id, None)
                self._cancelling.discard(job.id)
        for job, future in joined:  # no delivery can join these runs any more: resolved outside the lock
            if error is not None:
                future.set_exception(error)
            else:
                future.set_result((results or {}).get(job.id))

    def running_ids(self) -> list[str]:
        with self._lock:
            return list(self._running)

    def cancel_running(self, job_id: str) -> None:
        """Stop a job running here at the engine's next step (its result: `cancelled`, with its partial text).
        A job not yet handed to the engine is stopped as it is handed over; one not running here is ignored."""
        with self._lock:
            if job_id not in self._running or job_id in self._cancelling:
                return
            self._cancelling.add(job_id)
            request_id = self._engine_ids.get(job_id)
        log.info("job %s cancelled; stopping it", job_id)
        if request_id is not None:
            self.engine.cancel(request_id, "cancelled")

    def admit_one(self, run: Attempt, result_key: bytes) -> tuple[Decision, tuple[Future | None, str] | None]:
        """`admit` a pool thread's job with concurrent ones (one script call, one engine message for all); returns its
        decision and, if it runs, its engine request."""
        return self._admits.call((run, result_key))

    def _admit_many(self, items: list[tuple[Attempt, bytes]]) -> list[tuple[Decision, tuple[Future | None, str] | None]]:
        """`admit_one`'s batch: check in (one script call), hand those that run to the engine (one message)."""
        runs = [run for run, _ in items]
        decisions = self.admit(runs, [key for _, key in items])
        runnable = [run for run, decision in zip(runs, decisions) if isinstance(decision, Run)]
        submitted = dict(zip((id(run) for run in runnable), self.submit_many(runnable))) if runnable else {}
        return [(decision, submitted.get(id(run))) for run, decision in zip(runs, decisions)]

    def submit_many(self, runs: list[Attempt], sink: Sink | None = None, wait: bool = True
                    ) -> list[tuple[Future | None, str]]:
        """Hand jobs to the engine in one pipe message; returns each one's engine future and request id. With `sink`,
        each answer goes there instead (`EngineProcess.send_many`) and the futures are None."""
        self.metrics.finished.queue_waits(max(0.0, run.started_at - run.job.submitted_at) for run in runs
                                          if run.job.submitted_at is not None)
        requests = []
        for run in runs:
            job = run.job
            messages = [m.model_dump() for m in job.messages] if job.messages else None
            # an embedding job: the engine pools; a score job: it scores the continuations; neither samples
            params = job.embed if job.embed is not None else job.score if job.score is not None else job.sampling
            requests.append((f"{job.id}#{next(self._request_numbers)}", params, job.prompt or job.prompt_token_ids,
                             messages, run.share))
        futures: list[Future | None] = [None] * len(requests)
        if requests and sink is not None:
            self.engine.send_many(requests, sink, wait=wait)
        elif requests:
            futures = self.engine.submit_many(requests)
        with self._lock:
            self._engine_ids.update((run.job.id, request[0]) for run, request in zip(runs, requests))
            stop = [request[0] for run, request in zip(runs, requests) if run.job.id in self._cancelling]
        for request_id in stop:  # cancelled while it was being handed over
            self.engine.cancel(request_id, "cancelled")
        return [(future, request[0]) for future, request in zip(futures, requests)]

    def admit(self, runs: list[Attempt], result_keys: list[bytes]) -> list[Decision]:
        """Count a delivery of each run's job (one check-in script call for all) and decide its admission; each
        run's `attempt` becomes its delivery number."""
        job_ids = [run.job.id for run in runs]
        keys = [*result_keys, *(DELIVERIES_KEY.format(job_id=job_id) for job_id in job_ids),
                *(CANCEL_KEY.format(job_id=job_id) for job_id in job_ids)]
        checks = CheckIn.from_replies(self._check_in_script(keys, [int(self.settings.result_expires)]))
        for run, check in zip(runs, checks):
            run.attempt = check.attempt
        return [admission(check, run.job_hash, self.settings.max_deliveries) for run, check in zip(runs, checks)]

    def store_results(self, encoded: dict[bytes, bytes], acks: Sequence[tuple[str, str, str]] = ()) -> None:
        """Store each encoded result under its key unless one is there, announcing new ones as Celery does; one
        script call, shared with concurrent stores. `acks`: messages acked in the same script
        (`transport.ack_records`); their consumer then only frees their slots (`transport.acked_by_script`)."""
        if encoded:
            self._stores.call((encoded, acks))

    def _store_many(self, batches: list[tuple[dict[bytes, bytes], Sequence[tuple[str, str, str]]]]) -> list[None]:
        encoded = {key: value for results, _ in batches for key, value in results.items()}
        tags: dict[tuple[str, str], list[str]] = {}
        for _, acks in batches:
            for hash_key, index_key, tag in acks:
                tags.setdefault((hash_key, index_key), []).append(tag)
        keys, args = list(encoded), [int(self.settings.result_expires), len(encoded), *encoded.values()]
        for (hash_key, index_key), held in tags.items():
            keys += [hash_key, index_key]
            args += [len(held), *held]
        self._store_script(keys, args)
        return [None] * len(batches)


def exit_on_engine_failure(exc: BaseException) -> None:
    """The engine failed outside any single request, or its process died: exit now. Jobs in flight stay unacked and
    are redelivered after the visibility timeout; one that causes this every time is dead-lettered."""
    try:
        _exit_watchdog()
        log.critical("engine failure, exiting with code %d so a supervisor restarts the worker: %r", FATAL_EXIT_CODE,
                     exc)
        logging.shutdown()
    finally:
        os._exit(FATAL_EXIT_CODE)


def _exit_on_engine_stall(why: str) -> None:
    """The engine stalled (`EngineProcess` killed it, answering none of its jobs): hand the held messages back to their
    queues and exit for a supervisor to restart the worker. A job stored meanwhile is not rerun: its next delivery finds
    the result."""
    try:  # the exit below is reached whatever this raises, and within `EXIT_WATCHDOG_SECONDS` whatever blocks here
        _exit_watchdog()
        log.critical("%s; handing back the jobs held here, then exiting with code %d so a supervisor restarts the "
                     "worker", why, FATAL_EXIT_CODE)
        returned: list[int] = []
        hand_back = threading.Thread(target=lambda: returned.append(hand_back_held()), name="tokenmill-hand-back",
                                     daemon=True)
        hand_back.start()
        hand_back.join(HAND_BACK_TIMEOUT)
        if returned:
            log.critical("handed back %d message(s)", returned[0])
        else:  # Redis down or slow: the visibility timeout requeues them once this worker's leases lapse
            log.critical("could not hand back the held messages within %.0fs; they are requeued after the visibility "
                         "timeout", HAND_BACK_TIMEOUT)
        logging.shutdown()
    finally:
        os._exit(FATAL_EXIT_CODE)


def _exit_watchdog() -> None:
    """`os._exit(FATAL_EXIT_CODE)` from a timer thread after `EXIT_WATCHDOG_SECONDS`, in case the orderly exit
    blocks. It logs nothing: logging may be what blocks."""
    timer = threading.Timer(EXIT_WATCHDOG_SECONDS, os._exit, args=(FATAL_EXIT_CODE,))
    timer.daemon = True
    timer.start()
