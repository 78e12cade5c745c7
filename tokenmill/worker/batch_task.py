"""The `tokenmill.generate_batch` task's run: several jobs in one message (`[[{"jobs": [job, ...]}], {}, {}]`).

Each job keeps a single job's guarantees: the same admission, exactly one result under its own Celery result key
(`SET NX`), a redelivery running only the jobs without a result. The message is acked only once all its results are
stored; any failure requeues it with its finished results stored. Torch-free.
See docs/internals/worker.md, section "Groups".
"""

from __future__ import annotations

import functools
import logging
import queue
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import TYPE_CHECKING, Any, Protocol

from celery import states
from celery.exceptions import Ignore, Reject

from tokenmill.errors import InvalidRequestError
from tokenmill.queue.cancels import encode_result, result_meta
from tokenmill.queue.schemas import Job, JobResult, check_size, is_job_id
from tokenmill.queue.transport import jobs_ended
from tokenmill.worker.admission import Attempt, Decision, Run

if TYPE_CHECKING:
    from celery.backends.base import KeyValueStoreBackend

    from tokenmill.worker.engine_process import Answer, EngineProcess, Sink
    from tokenmill.worker.metrics import WorkerMetrics
    from tokenmill.worker.output import EngineOutput
    from tokenmill.worker.settings import WorkerSettings

log = logging.getLogger("tokenmill.worker")

#: Seconds between checks of the shutdown grace while a job or a group waits for the engine.
SHUTDOWN_CHECK_INTERVAL = 2.0
#: Seconds a group that failed outside the engine waits before it is requeued (at most until the shutdown grace ends).
REQUEUE_PAUSE = 1.0


class JobService(Protocol):
    """What a run needs of `tokenmill.worker.service.WorkerService` (a protocol: that module imports this one)."""

    settings: WorkerSettings
    engine: EngineProcess
    metrics: WorkerMetrics
    #: Set once the shutdown grace has run out: unfinished jobs are requeued.
    grace_expired: threading.Event

    def claim(self, jobs: list[Job]) -> tuple[list[Job], list[tuple[Job, Future]]]:
        """Register `jobs` as running here: (those claimed, those already running with that run's future)."""

    def release(self, jobs: list[Job], results: dict[str, Any] | None = None, error: BaseException | None = None
                ) -> None:
        """The claimed `jobs` end: a delivery waiting on one gets its result (or `error`)."""

    def admit(self, runs: list[Attempt], result_keys: list[bytes]) -> list[Decision]:
        """Count a delivery of each run's job (one script call) and decide its admission."""

    def admit_one(self, run: Attempt, result_key: bytes) -> tuple[Decision, tuple[Future | None, str] | None]:
        """Admit a pool thread's job with concurrent ones; hand it to the engine if it runs."""

    def settle(self, run: Attempt, decision: Decision) -> dict[str, Any] | None:
        """The result of a job its admission keeps from the engine, or None when one is stored already."""

    def joined_another(self, job: Job, result: dict[str, Any]) -> bool:
        """Whether the run `job` joined was another content's under its id (a conflict, counted)."""

    def refuse_output(self, job: Job, started_at: float) -> dict[str, Any] | None:
        """The failed result of a job whose S3 destination is refused, or None."""

    def failed(self, result: JobResult) -> dict[str, Any]:
        """Count a failed result and return its wire form."""

    def submit_many(self, runs: list[Attempt], sink: Sink | None = None, wait: bool = True
                    ) -> list[tuple[Future | None, str]]:
        """Hand jobs to the engine in one message: each one's future (None with `sink`) and engine request id."""

    def complete(self, run: Attempt, output: EngineOutput | None = None, error: InvalidRequestError | None = None
                 ) -> dict[str, Any]:
        """The job's final result from the engine's output or refusal."""

    def store_results(self, encoded: dict[bytes, bytes], acks: Sequence[tuple[str, str, str]] = ()) -> None:
        """Store encoded results unless stored already (and ack these messages), in one script call."""


class BatchRun:
    """One delivery of one group on one worker: parse, claim, admit, submit, complete, store. Subclasses: `PoolRun`
    (a lone job on Celery's pool) and `tokenmill.worker.intake.IntakeRun` (the intake's groups)."""

    #: True: any failure requeues the run (finished results stored); False: the error reaches the caller.
    requeue_on_error = True

    def __init__(self, service: JobService, task_id: str, backend: KeyValueStoreBackend,
                 time_limit: float | None = None, share: str | None = None) -> None:
        self.service = service
        self.task_id = task_id
        self.backend = backend
        self.time_limit = time_limit  # the message's Celery time limit: each job's deadline unless it sets its own
        self.share = share  # the message's fair share (`SHARE_HEADER`), if any
        self.started_at = time.time()
        self._stored: set[str] = set()
        self._mine: dict[str, Job] = {}  # claimed by this run (`WorkerService.claim`) until stored or released
        self._message_jobs = 0  # the jobs the group's message carries (`run`); those not submitted free their room

    def settled(self, job_ids: list[str], results: dict[str, dict[str, Any]]) -> None:
        """Hook: these jobs' final results are in Redis (stored now, with `results`, or found stored)."""

    def source(self, job_id: str) -> bytes | None:
        """Hook: the JSON text job `job_id` was decoded from, if known (spares `check_size` its work)."""
        return None

    def attempt(self, job: Job) -> Attempt:
        """Hook: this delivery of `job`, with the content hash its sender put in its message (`JOB_HASH_HEADER`; none
        here: it is hashed) and the fair share its message came from (`SHARE_HEADER`)."""
        return Attempt(job, self.started_at, 0, self.time_limit, share=self.share)

    def joined(self, running: list[tuple[Job, Future]]) -> None:
        """Hook: these jobs already run here (with that run's future), which stores them; other content under the
        running one's id is a conflict."""
        for job, future in running:
            future.add_done_callback(functools.partial(self._joined_done, job))

    def _joined_done(self, job: Job, future: Future) -> None:
        result = None if future.cancelled() or future.exception() is not None else future.result()
        if result is not None:
            self.service.joined_another(job, result)

    def run(self, raw_jobs: Any) -> dict[str, Any]:
        if not isinstance(raw_jobs, list) or not all(isinstance(j, dict) for j in raw_jobs):
            log.error("group %r discarded: 'jobs' must be a list of job objects", self.task_id)
            return {"jobs": 0, "ran": 0, "error": "'jobs' must be a list of job objects"}
        self._message_jobs = len(raw_jobs)
        jobs, done = self._parse(raw_jobs)
        ran = self.run_jobs(jobs, done)
        return {"jobs": len(raw_jobs), "ran": ran, "skipped": len(jobs) - ran}

    def run_jobs(self, jobs: list[Job], done: dict[str, dict[str, Any]]) -> int:
        """Claim, admit, generate and store parsed `jobs`; returns how many ran. `done`: results known already (parse
        failures), filled with every result. A job already running here is left to that run (`joined`)."""
        mine = self._claim(jobs)
        try:
            ran = self._run_mine(mine, done)
        except BaseException as exc:
            self._release_mine(done, exc)
            raise
        self._release_mine(done)
        return ran

    def _claim(self, jobs: list[Job]) -> list[Job]:
        """The jobs not already running here, now registered as this run's until stored or released; the others go
        to `joined`."""
        mine, running = self.service.claim(jobs)
        self._mine = {job.id: job for job in mine}
        self.joined(running)
        return mine

    def _release_mine(self, done: dict[str, dict[str, Any]], error: BaseException | None = None) -> None:
        """Release the jobs still registered to this run; a delivery waiting on one gets its result in `done` (None:
        found stored) or `error`."""
        self.service.release(list(self._mine.values()), done, error)
        self._mine = {}

    def _run_mine(self, jobs: list[Job], done: dict[str, dict[str, Any]]) -> int:
        """Check in, dead-letter or run, store; returns how many ran. Any error (a Redis error at check-in or store
        included) requeues the run when `requeue_on_error`, after `REQUEUE_PAUSE`: raised as such, Celery would ack
        the message with no result stored for its jobs. An error that persists after the check-in ends with the
        jobs' deliveries (`max_deliveries`); one before it repeats, slowly, until it is mended."""
        try:
            todo = self._check_in(jobs, done) if jobs else []
            self._free_room(self._message_jobs - len(todo))  # invalid, joined to a run here, or settled at check-in
            try:
                if todo:
                    self._generate(todo, done)
            finally:
                self._store(done)  # whatever finished, also when the rest is requeued
        except Reject:
            raise
        except Exception as exc:
            if not self.requeue_on_error:
                raise
            log.exception("group %r failed (%s); requeueing it for its jobs without a stored result", self.task_id,
                          type(exc).__name__)
            self.service.grace_expired.wait(REQUEUE_PAUSE)  # an error that persists: a slow loop, not a hot one
            raise Reject(f"group failed: {type(exc).__name__}", requeue=True) from exc
        return len(todo)

    def _free_room(self, count: int) -> None:
        """`count` more of the message's jobs hold no engine slot: free their prefetch room (`transport.jobs_ended`).
        The message is still acked only once all its results are stored."""
        if count > 0:
            jobs_ended(self.task_id, count)

    def _job_ended(self, _: Future) -> None:
        self._free_room(1)

    def _check_in(self, jobs: list[Job], done: dict[str, dict[str, Any]]) -> list[Attempt]:
        """Count a delivery of each job; returns the `Attempt`s to run. Jobs found stored are settled; cancelled and
        dead-lettered ones get their results in `done`."""
        runs = [self.attempt(job) for job in jobs]
        decisions = self._admit(runs)
        todo, stored = [], []
        for run, decision in zip(runs, decisions):
            if isinstance(decision, Run):
                todo.append(run)
            elif (result := self.service.settle(run, decision)) is None:
                stored.append(run.job.id)
            else:
                done[run.job.id] = result
        if stored:
            self.settled(stored, {})  # acked together
        return todo

    def _admit(self, runs: list[Attempt]) -> list[Decision]:
        """Count a delivery of each run's job and decide its admission (one script call for the group)."""
        return self.service.admit(runs, [self.backend.get_key_for_task(run.job.id) for run in runs])

    def _parse(self, raw_jobs: list[dict[str, Any]]) -> tuple[list[Job], dict[str, dict[str, Any]]]:
        """The group's jobs, each checked as a single job is; a bad one gets its failed result, if its id is usable."""
        jobs, failed, seen = [], {}, set()
        for raw in raw_jobs:
            job_id = raw.get("id")
            if not is_job_id(job_id) or job_id in seen:
                log.error("group %r: a job without a usable, unique id was discarded", self.task_id)
                continue
            seen.add(job_id)
            try:
                check_size(raw, self.service.settings.max_job_bytes, self.source(job_id))  # per job, as for a single job
                job = Job.from_wire(raw)
            except InvalidRequestError as exc:
                failed[job_id] = self.service.failed(
                    JobResult.failure(job_id, "invalid_job", exc.message, exc.field, started_at=self.started_at))
                continue
            except Exception as exc:  # validation itself broke on this job: it fails alone, the group goes on
                log.exception("group %r: job %r could not be validated", self.task_id, job_id)
                failed[job_id] = self.service.failed(JobResult.failure(
                    job_id, "invalid_job", f"cannot be validated: {type(exc).__name__}", "job", started_at=self.started_at))
                continue
            refused = self.service.refuse_output(job, self.started_at)  # an S3 output outside output_prefixes
            if refused is None:
                jobs.append(job)
            else:
                failed[job_id] = refused
        return jobs, failed

    def _generate(self, runs: list[Attempt], done: dict[str, dict[str, Any]]) -> None:
        """Submit every job to the engine at once, then wait for all. A job past its deadline is stopped
        (`deadline_exceeded`); once the shutdown grace runs out the group is requeued (`Reject`). On any way out, the
        unfinished requests are aborted; the caller stores the finished results."""
        futures = self._submit(runs)
        deadlines = {future: run.deadline for future, (run, _) in futures.items() if run.deadline is not None}
        pending = set(futures)
        finishing: queue.SimpleQueue[Future] = queue.SimpleQueue()  # each future once, as it resolves
        for future in futures:
            future.add_done_callback(finishing.put)
            future.add_done_callback(self._job_ended)
        try:
            while pending:
                # one wake-up when all are done, else each check interval or at the next deadline
                timeout = min([SHUTDOWN_CHECK_INTERVAL, *(d - time.time() for d in deadlines.values())])
                finished = self._finished(finishing, len(pending), max(0.0, timeout))
                pending -= finished
                for future in [f for f, d in deadlines.items() if f in pending and d <= time.time()]:
                    self.service.engine.cancel(futures[future][1], "deadline")  # its partial output follows
                    del deadlines[future]
                for future in finished:
                    run = futures[future][0]
                    done[run.job.id] = self._complete(run, future.exception() or future.result())
                if pending and self.service.grace_expired.is_set():
                    log.warning("group %r: %d jobs not finished when the shutdown grace ran out; requeueing it",
                                self.task_id, len(pending))
                    raise Reject("worker shutting down", requeue=True)
        finally:
            for future in pending:
                self.service.engine.abort(futures[future][1])
            self.service.metrics.jobs_in_flight.dec(len(runs))

    def _submit(self, runs: list[Attempt]) -> dict[Future, tuple[Attempt, str]]:
        """Hand `runs` to the engine in one message; returns each one's engine future -> (its `Attempt`, its engine
        request id). The caller owes `jobs_in_flight` a decrement per run."""
        futures = {future: (run, request_id) for run, (future, request_id) in zip(runs, self._hand_over(runs))}
        self.service.metrics.jobs_in_flight.inc(len(runs))
        return futures

    def _hand_over(self, runs: list[Attempt]) -> list[tuple[Future | None, str]]:
        """Hook: hand `runs` to the engine in one message: each one's engine future and request id."""
        return self.service.submit_many(runs)

    def _complete(self, run: Attempt, answer: Answer | BaseException) -> dict[str, Any]:
        """The job's final result from the engine's answer (`engine_process.Answer`); an exception other than a
        refusal is raised."""
        try:
            if isinstance(answer, BaseException):
                raise answer
            return self.service.complete(run, output=answer)
        except InvalidRequestError as exc:
            return self.service.complete(run, error=exc)

    def _finished(self, finishing: queue.SimpleQueue[Future], pending: int, timeout: float) -> set[Future]:
        """The futures resolved since the last call: all `pending` ones, or those resolved within `timeout`. Reads the
        queue the futures' callbacks feed, so a call's work does not grow with the group."""
        finished: set[Future] = set()
        end = time.monotonic() + timeout
        while len(finished) < pending:
            try:
                finished.add(finishing.get(timeout=max(0.0, end - time.monotonic())))
            except queue.Empty:
                break
        return finished

    def _store(self, results: dict[str, dict[str, Any]]) -> None:
        """Each job's result under its own Celery key (as Celery's meta), unless one is stored already."""
        encoded = self.encode(results, self.unstored(results))
        if encoded:
            self.service.store_results(encoded)
            self.stored(results)

    def unstored(self, results: dict[str, dict[str, Any]]) -> list[str]:
        """The ids of the results not stored yet (by this run)."""
        if len(results) <= len(self._stored):
            return []
        return [job_id for job_id in results if job_id not in self._stored]

    def encode(self, results: dict[str, dict[str, Any]], job_ids: list[str], meta: dict[str, Any] | None = None
               ) -> dict[bytes, bytes]:
        """These jobs' results, encoded as Celery's meta under their keys. `meta`: `result_meta` for SUCCESS, when the
        caller made it already."""
        if not job_ids:
            return {}
        # the meta's other fields (date_done, children) are the same for every job stored now
        meta = meta or result_meta(self.backend, states.SUCCESS)
        key = self.backend.get_key_for_task
        return {key(job_id): encode_result(self.backend, results[job_id], meta) for job_id in job_ids}

    def stored(self, results: dict[str, dict[str, Any]]) -> None:
        """The results not stored yet are in Redis: never stored again, their jobs released (a later delivery is
        a new one: counted, it finds the result stored)."""
        new = self.unstored(results)
        self._stored.update(new)
        self.service.release([self._mine.pop(job_id) for job_id in new if job_id in self._mine], results)
        self.settled(new, results)


class PoolRun(BatchRun):
    """A single `tokenmill.generate` job on Celery's pool (`tokenmill.worker.runtime.run_job`): a group of one.
    Celery's tracer stores its result and acks, except a cancelled one (stored here as REVOKED, then `Ignore`). A
    delivery of a job running here waits for that run. Admission and the engine message are shared with concurrent
    pool threads (`JobService.admit_one`); an error other than a refusal reaches Celery."""

    requeue_on_error = False

    def __init__(self, service: JobService, task_id: str, backend: KeyValueStoreBackend,
                 time_limit: float | None = None, share: str | None = None) -> None:
        super().__init__(service, task_id, backend, time_limit, share)
        self._joined: Future | None = None  # the run in progress this delivery joined
        self._handed: tuple[Future | None, str] | None = None  # the engine request `_admit` made

    def run_one(self, job: Job) -> dict[str, Any]:
        """The job's result, for Celery to store; `Ignore` when there is none to store."""
        done: dict[str, dict[str, Any]] = {}
        self.run_jobs([job], done)
        result = self._wait_joined(job) if self._joined is not None else done.get(job.id)
        if result is None or result["status"] == "cancelled":  # stored already, or by this run
            raise Ignore()
        if self._joined is not None and self.service.joined_another(job, result):
            raise Ignore()
        return result

    def joined(self, running: list[tuple[Job, Future]]) -> None:
        if running:  # not a new delivery to count: the run in progress answers it
            log.info("job %s is already running here; waiting for that run", running[0][0].id)
            self._joined = running[0][1]

    def _wait_joined(self, job: Job) -> dict[str, Any] | None:
        """The joined run's result (None: found stored) or its error; requeued once the shutdown grace is over."""
        assert self._joined is not None
        while True:
            try:
                return self._joined.result(timeout=SHUTDOWN_CHECK_INTERVAL)
            except FutureTimeout:
                if self.service.grace_expired.is_set():
                    log.warning("job %s not finished when the shutdown grace ran out; requeueing it", job.id)
                    raise Reject("worker shutting down", requeue=True) from None

    def _admit(self, runs: list[Attempt]) -> list[Decision]:
        (run,) = runs
        decision, self._handed = self.service.admit_one(run, self.backend.get_key_for_task(run.job.id))
        return [decision]

    def _hand_over(self, runs: list[Attempt]) -> list[tuple[Future | None, str]]:
        assert self._handed is not None  # `admit_one` handed every job it admitted to the engine
        return [self._handed]

    def _free_room(self, count: int) -> None:
        """A single job's message holds one prefetch slot until acked: nothing to free early."""

    def _store(self, results: dict[str, dict[str, Any]]) -> None:
        """Only a cancelled result is stored here (REVOKED); Celery stores the rest from `run_one`'s return."""
        cancelled = {self.backend.get_key_for_task(job_id): encode_result(self.backend, result)
                     for job_id, result in results.items() if result["status"] == "cancelled"}
        if cancelled:
            self.service.store_results(cancelled)
