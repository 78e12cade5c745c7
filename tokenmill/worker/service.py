"""What a worker does with one job, from its Celery message to its written result.

`WorkerService` owns the engine process, the S3 sink, the metrics, a Redis client for bookkeeping, and the single-job
intake and its finisher (`tokenmill.worker.intake`, `tokenmill.worker.finisher`), which it hands to whoever needs them;
the Celery worker process keeps its one service in `tokenmill.worker.runtime`. Celery runs `run_job` in one of its pool
threads per job; the thread hands the request to the engine process and waits, so up to `concurrency` jobs share the
engine's running batch.

Per job, in order:

1. Parse the job (`Job.from_wire`); a malformed job ends as a failed result (`invalid_job`), one whose S3
   `output` is outside `output_prefixes` as a failed result (`invalid_request`, field `output`).
2. If the same job id is already running in this process (delivered again while it runs here),
   wait for that run instead of starting a second one; this is not counted as a delivery.
3. Admission (`tokenmill.worker.admission`): one script call counts the delivery and reads the job's stored result
   and cancel mark; a job whose final result is stored (its own, or another content's: a conflict) is acknowledged
   without running, a cancelled one gets its `cancelled` result, one started more than `max_deliveries` times is
   dead-lettered, and the rest run.
4. Generate. A request the engine refuses (`InvalidRequestError`) ends as a failed result
   (`invalid_request`, naming the field); the engine and the other jobs go on.
5. With an S3 destination, write the full result there, retrying while S3 is down; Redis then gets a
   stub holding `output_uri`.
6. Return the result; Celery stores it in Redis, then acks the message.

Steps 3-4 and the result write are shared with the other jobs that reach them at the same moment (one Redis
script or engine-process message for all, see `tokenmill.queue.batching`); each job's outcome is its own.

On SIGTERM Celery stops taking jobs and waits for the running ones; they get `shutdown_grace`
seconds, after which any job still generating or still retrying S3 is requeued (`Reject`), so the
worker always exits and nothing is lost.
"""

from __future__ import annotations

import json
import logging
import os
import itertools
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import TYPE_CHECKING, Any

import redis
from celery.exceptions import Ignore, Reject
from celery.utils.nodenames import default_nodename, host_format
from redis.backoff import ExponentialBackoff
from redis.retry import Retry

from tokenmill.errors import InvalidRequestError
from tokenmill.queue import dead_letters
from tokenmill.queue.app import socket_options
from tokenmill.queue.batching import Coalescer, HeldScript
from tokenmill.queue.cancels import encode_result
from tokenmill.queue.names import CANCEL_KEY, DEAD_LETTER_KEY, DELIVERIES_KEY
from tokenmill.queue.schemas import Job, JobResult, is_job_id
from tokenmill.queue.served import Announcer
from tokenmill.queue.tls import redis_client
from tokenmill.queue.transport import hand_back_held
from tokenmill.worker.admission import (CHECK_IN, Attempt, Cancelled, CheckIn, Conflict, DeadLetter, Decision, Run,
                                        Stored, admission, settled_by)
from tokenmill.worker.batch_task import SHUTDOWN_CHECK_INTERVAL
from tokenmill.worker.cancel_listener import CancelListener
from tokenmill.worker.cpus import format_cpu_list, pin_process, placement
from tokenmill.worker.engine_process import EngineProcess, Sink
from tokenmill.worker.finisher import Finisher
from tokenmill.worker.intake import Intake
from tokenmill.worker.metrics import WorkerMetrics
from tokenmill.worker.output import EngineOutput, result_wire
from tokenmill.worker.settings import WorkerSettings
from tokenmill.worker.sinks import OutputWriteError, RetryPolicy, S3Sink, WriteAbandoned, output_refusal

if TYPE_CHECKING:
    from celery.backends.base import KeyValueStoreBackend

log = logging.getLogger("tokenmill.worker")

FATAL_EXIT_CODE = 70  # EX_SOFTWARE: the engine failed; a supervisor restarts the worker
HAND_BACK_TIMEOUT = 10.0  # seconds a stalled worker tries to requeue its held messages before it exits anyway
#: Seconds after which a worker exiting for its engine exits even if what comes before the exit (logging, the hand-back)
#: has not returned: a timer thread calls `os._exit` with the same code (`_exit_watchdog`).
EXIT_WATCHDOG_SECONDS = HAND_BACK_TIMEOUT + 5.0
CHECK_IN_LIMIT = 500  # single jobs per check-in script call (Redis runs a script alone) and per engine message
STORE_LIMIT = 8  # groups' result stores per script call (each at most a group's jobs; Redis runs a script alone)

# KEYS: n result keys, then pairs of unacked hash and unacked index. ARGV[1]: the results' expiry in seconds,
# ARGV[2]: n, ARGV[2 + i]: the encoded result for KEYS[i]; then per pair a count and that many delivery tags.
# SET NX never overwrites a stored result; only a newly stored one is published. The tags are acked as kombu acks
# (ZREM, HDEL): in the same script, so a message is acked exactly when its job's result is stored.
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


class WorkerService:
    """One per worker process; thread-safe `run_job`. Owns its `intake` and `finisher`: `intake` given is one Celery
    handed requests to before this service existed (`tokenmill.worker.runtime`); it is served by this service alone."""

    def __init__(self, settings: WorkerSettings, engine: EngineProcess, metrics: WorkerMetrics, sink: S3Sink | None,
                 intake: Intake | None = None) -> None:
        self.settings = settings
        self.engine = engine
        self.metrics = metrics
        self.sink = sink
        self.hostname = host_format(default_nodename(settings.hostname))  # Celery's node name, "%h" expanded
        # Every call has a bound: a connection whose peer went silent (a paused Redis, a dropped route) times out and is
        # retried on a new one, instead of holding every job thread that waits on the shared call for good.
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
        # single jobs' check-ins and engine requests: one call of each for all the pool threads that need one at once
        self._admits: Coalescer[tuple[Attempt, bytes], tuple[Decision, tuple[Future, str] | None]] = Coalescer(
            self._admit_many, limit=CHECK_IN_LIMIT)
        # results stored by several groups at once (jobs of different groups finishing in one engine step): one call
        self._stores: Coalescer[tuple[dict[bytes, bytes], Sequence[tuple[str, str, str]]], None] = Coalescer(
            self._store_many, limit=STORE_LIMIT)
        # single jobs in groups: the finisher settles each turn's runs inside the intake's `holding_acks`
        self.intake = intake if intake is not None else Intake()
        self.finisher = Finisher(settling=self.intake.holding_acks)
        self.intake.serve(self)

    @classmethod
    def start(cls, settings: WorkerSettings, intake: Intake | None = None) -> WorkerService:
        """Start the metrics endpoint, then the engine process (the model loads there, once). `intake`: see the class.

        The endpoint first: a port problem then fails the start before an engine process exists.
        """
        started = time.monotonic()
        model = settings.engine_model()
        metrics = WorkerMetrics()
        metrics.serve(settings.metrics_port, settings.metrics_addr, tries=settings.metrics_port_tries)
        cpus = placement(settings.engine_cpus)  # (the engine's, the worker's), or None
        engine = EngineProcess(
            model, settings.engine_options(), on_fatal=_exit_on_engine_failure, on_stats=metrics.on_engine_status,
            cpus=cpus[0] if cpus else None, on_stall=_exit_on_engine_stall, stall_timeout=settings.engine_stall_timeout,
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

    # -- one job -------------------------------------------------------------------------------

    def run_job(self, task_id: str, payload: dict[str, Any] | None, fields: dict[str, Any],
                backend: KeyValueStoreBackend, time_limit: float | None = None) -> dict[str, Any]:
        """Everything between a delivered message and the result Celery stores (see module docstring).

        `backend` is the task's Celery result backend; `time_limit` the message's Celery time limit (the job's
        `deadline_s` wins). A cancelled job's result is stored here, as REVOKED, and Celery is told to store
        nothing (`Ignore`).
        """
        result_key = backend.get_key_for_task(task_id)
        started_at = time.time()
        raw = {**(payload or {}), **fields}
        raw.setdefault("id", task_id)
        try:
            job = Job.from_wire(raw)
        except InvalidRequestError as exc:
            return self.failed(JobResult.failure(_safe_id(raw, task_id), "invalid_job", exc.message, exc.field, started_at=started_at))
        refused = self.refuse_output(job, started_at)
        if refused is not None:
            return refused
        mine, running = self.claim([job])
        if running:  # not a new delivery to count: the run in progress answers it
            log.info("job %s is already running here; waiting for that run", job.id)
            result = self._wait(running[0][1], job)
            if result is None or result["status"] == "cancelled":  # that run stored it already, or found it stored
                raise Ignore()
            if self.joined_another(job, result):
                raise Ignore()
            return result
        try:
            result = self._run_once(Attempt(job, started_at, 0, time_limit), result_key)
        except BaseException as exc:
            self.release([job], error=exc)
            raise
        self.release([job], {job.id: result})
        if result["status"] == "cancelled":
            self.store_results({result_key: encode_result(backend, result)})
            raise Ignore()
        return result

    def refuse_output(self, job: Job, started_at: float) -> dict[str, Any] | None:
        """The failed result of a job whose S3 destination is outside `output_prefixes` (nothing generated), or None."""
        location = job.s3_location
        problem = None if location is None else output_refusal(location, self.settings.output_prefixes)
        if problem is None:
            return None
        return self.failed(JobResult.failure(job.id, "invalid_request", problem, "output", started_at=started_at,
                                             queued_at=job.submitted_at, metadata=job.metadata, job_hash=job.content_hash()))

    def claim(self, jobs: list[Job]) -> tuple[list[Job], list[tuple[Job, Future]]]:
        """Register `jobs` as running here; returns (jobs now mine; jobs already running here, with a future of that
        run's result). Only jobs now mine count as deliveries. A run's future is made only when a delivery joins it
        (rare: a redelivery while it runs), not for every job (a future and its result cost every job)."""
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

    def _run_once(self, run: Attempt, result_key: bytes) -> dict[str, Any]:
        """Steps 3-6 for a job that is not already running in this process."""
        decision, submitted = self._admits.call((run, result_key))
        if not isinstance(decision, Run):
            result = self.settle(run, decision)
            if result is None:
                raise Ignore()
            return result
        assert submitted is not None  # `_admit_many` submitted every job to run
        self.metrics.jobs_in_flight.inc()
        try:
            return self._execute(run, *submitted)
        finally:
            self.metrics.jobs_in_flight.dec()

    def _admit_many(self, items: list[tuple[Attempt, bytes]]) -> list[tuple[Decision, tuple[Future, str] | None]]:
        """Check in single jobs (one script call) and hand those to run to the engine (one pipe message): the
        threads of jobs taken together wake once, each with its admission and, if it runs, its engine request."""
        runs = [run for run, _ in items]
        decisions = self.admit(runs, [key for _, key in items])
        runnable = [run for run, decision in zip(runs, decisions) if isinstance(decision, Run)]
        submitted = dict(zip((id(run) for run in runnable), self.submit_many(runnable))) if runnable else {}
        return [(decision, submitted.get(id(run))) for run, decision in zip(runs, decisions)]

    def _execute(self, run: Attempt, future: Future, request_id: str) -> dict[str, Any]:
        try:
            output = self._wait(future, run.job, request_id, run.deadline)
        except InvalidRequestError as exc:
            return self.complete(run, error=exc)
        return self.complete(run, output=output)

    def submit_many(self, runs: list[Attempt], sink: Sink | None = None, wait: bool = True
                    ) -> list[tuple[Future | None, str]]:
        """Hand jobs to the engine in one pipe message (a group's jobs, or single jobs admitted together); returns
        each one's engine future and request id (to abort it). With `sink`, each answer goes there instead
        (`EngineProcess.send_many`, and its `wait`), and the futures are None."""
        self.metrics.finished.queue_waits(max(0.0, run.started_at - run.job.submitted_at) for run in runs
                                          if run.job.submitted_at is not None)
        requests = []
        for run in runs:
            job = run.job
            messages = [m.model_dump() for m in job.messages] if job.messages else None
            # an embedding job: the engine pools; a score job: it scores the continuations; neither samples
            params = job.embed if job.embed is not None else job.score if job.score is not None else job.sampling
            requests.append((f"{job.id}#{next(self._request_numbers)}", params, job.prompt or job.prompt_token_ids, messages))
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

    def settle(self, run: Attempt, decision: Decision) -> dict[str, Any] | None:
        """The result of a job its admission keeps from the engine (`Cancelled`, `DeadLetter`), or None for one whose
        final result is stored already (`Stored`, `Conflict`: nothing is stored again)."""
        match decision:
            case Cancelled():
                log.info("job %r was cancelled before it started; not running it", run.job.id)
                self.metrics.jobs_cancelled.inc()
                return JobResult.cancelled(run.job.id, "cancelled before it started", attempt=run.attempt,
                                           worker=self.hostname, metadata=run.job.metadata, job_hash=run.job_hash,
                                           **_times(run.job, run)).to_wire()
            case DeadLetter(deliveries):
                return self.dead_letter(run.job, deliveries, run.started_at)
            case Stored() | Conflict():
                self.skip_stored(run.job, decision, run.job_hash)
                return None
        raise ValueError(f"job {run.job.id} is to run, not to settle")

    def joined_another(self, job: Job, result: dict[str, Any]) -> bool:
        """Whether the run `job` joined (the result it gave) was another job under this id: a conflict, logged
        and counted as `skip_stored` does."""
        job_hash = job.content_hash()
        settled = settled_by(result.get("job_hash"), job_hash)
        if isinstance(settled, Conflict):
            self.skip_stored(job, settled, job_hash)
        return isinstance(settled, Conflict)

    def skip_stored(self, job: Job, settled: Stored | Conflict, job_hash: str) -> None:
        """A final result is stored under `job.id` (or another run of it finishes here): this job's (a repeated
        delivery or submission, idempotent), or another content's (the id was reused: a conflict, counted)."""
        if isinstance(settled, Conflict):
            self.metrics.jobs_failed.labels(code="conflict").inc()
            log.warning("job %s not run: its id holds the result of a job with different content (%s, this job %s); "
                        "that result is kept", job.id, settled.stored_hash[:12], job_hash[:12])
        else:
            log.info("job %s already has a result; acknowledging without running it again", job.id)

    def complete(self, run: Attempt, output: EngineOutput | None = None, error: InvalidRequestError | None = None
                 ) -> dict[str, Any]:
        """The job's final result from the engine's output (or its refusal), written to S3 if asked."""
        job = run.job
        if error is not None:
            return self.failed(JobResult.failure(job.id, "invalid_request", error.message, error.field,
                                                 job_hash=run.job_hash, **_times(job, run)))
        wire = result_wire(job, run, output, self.hostname)
        if self.settings.log_prompts:
            log.debug("job %s prompt=%r text=%r", job.id, job.prompt or job.messages or job.prompt_token_ids, wire["text"])
        if wire["status"] == "succeeded" and not job.output:
            return self._succeeded(wire)
        result = JobResult.model_validate(wire)
        if result.status == "cancelled":
            self.metrics.jobs_cancelled.inc()
            return wire
        if result.status == "failed":
            return self.failed(result)
        return self._write_output(job, result)

    def _wait(self, future: Future, job: Job, abort_id: str | None = None, deadline: float | None = None) -> Any:
        """Block until `future` resolves; once the shutdown grace is over, requeue the job instead. Past
        `deadline` the engine is told to stop the request, which then resolves with its partial output.

        Every held job has a thread here, so the shutdown check wakes each only every couple of seconds.
        """
        while True:
            timeout = SHUTDOWN_CHECK_INTERVAL if deadline is None else min(SHUTDOWN_CHECK_INTERVAL, deadline - time.time())
            try:
                return future.result(timeout=max(0.0, timeout))
            except FutureTimeout:
                if deadline is not None and time.time() >= deadline and abort_id is not None:
                    self.engine.cancel(abort_id, "deadline")
                    deadline = None  # asked once; the output follows within a step
                if self.grace_expired.is_set():
                    if abort_id is not None:
                        self.engine.abort(abort_id)
                    log.warning("job %s not finished when the shutdown grace ran out; requeueing it", job.id)
                    raise Reject("worker shutting down", requeue=True) from None

    def _write_output(self, job: Job, result: JobResult) -> dict[str, Any]:
        location = job.s3_location
        assert location is not None and self.sink is not None
        body = json.dumps(result.to_wire()).encode()
        try:
            uri = self.sink.write(location, job.id, body, stop=self.grace_expired)
        except WriteAbandoned as exc:
            log.warning("job %s: %s; requeueing it", job.id, exc)
            raise Reject(str(exc), requeue=True) from None
        except OutputWriteError as exc:
            error = {"code": "output_write_failed", "message": str(exc), "field": "output"}
            return self.failed(JobResult.model_validate({**result.to_wire(), "status": "failed", "error": error}))
        return self._succeeded(result.stub(uri).to_wire())

    # -- bookkeeping ---------------------------------------------------------------------------

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
        """Store each encoded Celery result under its key unless one is there already, and announce the new
        ones on the key's channel as Celery does: one round trip for a whole group, shared with the groups storing
        at the same moment (`Coalescer`). `acks`: messages acked in the same script (`transport.ack_records`), whose
        jobs these results settle; their consumer then only frees their slots (`transport.acked_by_script`)."""
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

    def dead_letter(self, job: Job, attempt: int, started_at: float) -> dict[str, Any]:
        message = (
            f"delivered {attempt} times and no earlier delivery finished (the worker running it died each time); "
            f"not run again, moved to the Redis list {DEAD_LETTER_KEY}"
        )
        dead_letters.push(self.redis, job.to_wire(), message, attempt, self.settings.dead_letter_max_len,
                          self.settings.dead_letter_expires)
        log.error("job %s dead-lettered after %d deliveries", job.id, attempt)
        return self.failed(
            JobResult.failure(job.id, "dead_letter", message, queued_at=job.submitted_at, started_at=started_at,
                              attempt=attempt, worker=self.hostname, metadata=job.metadata, job_hash=job.content_hash())
        )

    def _succeeded(self, wire: dict[str, Any]) -> dict[str, Any]:
        """Count a succeeded result (`JobResult.to_wire()`) and return it."""
        usage, queued, started, first, finished = (
            wire["usage"], wire["queued_at"], wire["started_at"], wire["first_token_at"], wire["finished_at"])
        self.metrics.finished.succeeded(
            usage and usage["prompt_tokens"], usage and usage["completion_tokens"],
            None if queued is None or finished is None else max(0.0, finished - queued),
            None if first is None or started is None else max(0.0, first - started))
        log.debug("job %s succeeded: %s tokens", wire["id"], usage["completion_tokens"] if usage else "?")
        return wire

    def failed(self, result: JobResult) -> dict[str, Any]:
        assert result.error is not None
        self.metrics.jobs_failed.labels(code=result.error.code).inc()
        log.warning("job %r failed: %s (field %r)", result.id, result.error.code, result.error.field)
        return result.to_wire()


def _times(job: Job, run: Attempt) -> dict[str, Any]:
    return {"queued_at": job.submitted_at, "started_at": run.started_at, "finished_at": time.time()}


def _safe_id(raw: dict[str, Any], task_id: str) -> str:
    """The id a refused job's result carries: its own when that is a valid job id, else the task's (which the
    guard checked); a raw id could hold a newline or anything else that must not reach logs and results."""
    value = raw.get("id")
    return value if is_job_id(value) else task_id


def _exit_on_engine_failure(exc: BaseException) -> None:
    """The engine failed outside any single request, or its process died: stop this worker now.

    Jobs in flight stay unacked and are delivered to a healthy worker after the visibility timeout;
    a job that causes this every time reaches `max_deliveries` and is dead-lettered.
    """
    try:
        _exit_watchdog()
        log.critical("engine failure, exiting with code %d so a supervisor restarts the worker: %r", FATAL_EXIT_CODE,
                     exc)
        logging.shutdown()
    finally:
        os._exit(FATAL_EXIT_CODE)


def _exit_on_engine_stall(why: str) -> None:
    """The engine holds jobs and makes no progress (`EngineProcess` killed it, answering none of them): stop taking
    jobs, put the held messages back on their queues for other workers, and exit for a supervisor to restart this one.
    A job whose result was stored meanwhile is not run again: its next delivery finds the result."""
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
    """`os._exit(FATAL_EXIT_CODE)` from a timer thread after `EXIT_WATCHDOG_SECONDS`, for an exit whose orderly part
    may block (a log handler on a full pipe, a hand-back that does not return). It logs nothing: logging may be what
    blocks."""
    timer = threading.Timer(EXIT_WATCHDOG_SECONDS, os._exit, args=(FATAL_EXIT_CODE,))
    timer.daemon = True
    timer.start()
