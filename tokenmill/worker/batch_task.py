"""The `tokenmill.generate_batch` task: several jobs in one queue message, each with its own id and result.

Why: on short completions a worker spends more time on Celery, kombu and Redis per message than the engine spends per
job (figures: docs/benchmarks/annotate.md); `tokenmill annotate --broker` therefore sends rows in groups. Inside a
group every job keeps the guarantees of a single `tokenmill.generate` job:

* it is admitted as a single job is (`tokenmill.worker.admission`), its delivery counted unless it already runs
  here (as a single job or in another group): a redelivered group runs only the jobs without a result yet;
* it gets exactly one result, under its own Celery result key, so `Client.get`/`as_completed` read it like
  any job's. Results are written with `SET NX` (never overwriting a stored one) and announced on the key's
  pub/sub channel as Celery does, in one script call per group. (After a broker outage a group may
  run on two workers at once, as a single job may; `SET NX` still keeps exactly one result per job);
* ids must match the job-id pattern, and a repeated id in a group runs once;
* any failure of the group requeues it with its unfinished jobs aborted and its finished results stored;
* the message is acknowledged only after all of its results are stored (late ack); at shutdown, past the
  grace period, finished jobs' results are stored and the group is requeued for the rest.

The message body is `[[{"jobs": [job, ...]}], {}, {}]`: each job in `Job`'s wire format. Torch-free (the
worker service is imported when a group arrives).
"""

from __future__ import annotations

import functools
import logging
import queue
import time
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

from celery import states
from celery.exceptions import Reject

from tokenmill.errors import InvalidRequestError
from tokenmill.queue.cancels import encode_result, result_meta
from tokenmill.queue.names import BATCH_TASK_NAME
from tokenmill.worker.admission import Attempt, Run

if TYPE_CHECKING:
    from tokenmill.queue.schemas import Job

log = logging.getLogger("tokenmill.worker")


def register(app: Any) -> None:
    """Add the task to a Celery app (called by `create_app`).

    `ignore_result`: the group's own return value (counts, for the log) is no one's result; each job's is
    stored under the job's id. Storing it cost Celery a GET, a SET and a PUBLISH per message, and a key per
    group kept for `result_expires`. (A message's `ignore_result` header overrides this; `QueueRunner` sets
    it too.)
    """
    app.task(name=BATCH_TASK_NAME, bind=True, acks_late=True, reject_on_worker_lost=True, resultrepr_maxsize=64,
             ignore_result=True)(_generate_batch)


def _generate_batch(self: Any, batch: dict[str, Any] | None = None, **fields: Any) -> dict[str, Any]:
    from tokenmill.worker.runtime import current

    return BatchRun(current(), self.request.id, self.backend).run((batch or fields).get("jobs"))


class BatchRun:
    """One delivery of one group on one worker."""

    def __init__(self, service: Any, task_id: str, backend: Any) -> None:
        self.service = service
        self.task_id = task_id
        self.backend = backend
        self.started_at = time.time()
        self._stored: set[str] = set()
        self._mine: dict[str, Job] = {}  # claimed by this run (`WorkerService.claim`) until stored or released

    def settled(self, job_ids: list[str], results: dict[str, dict[str, Any]]) -> None:
        """Hook: these jobs' final results are in Redis (stored now, with `results`, or found stored)."""

    def submitted(self) -> None:
        """Hook: the jobs to run are in the engine (or none was left to run)."""

    def source(self, job_id: str) -> bytes | None:
        """Hook: the JSON text job `job_id` was decoded from, if known (a bound that spares `check_size` its work)."""
        return None

    def sent_hash(self, job_id: str) -> str:
        """Hook: the content hash the job's sender put in its message (`JOB_HASH_HEADER`), if any; "" to hash it here."""
        return ""

    def joined(self, running: list[tuple[Job, Future]]) -> None:
        """Hook: these jobs are already running in this process, with that run's future; that run finishes and
        stores them. A job of other content under the running one's id is a conflict, as on the pool path."""
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
        jobs, done = self._parse(raw_jobs)
        # A job already running here (as a single job or in another group) is that run's to finish and store.
        mine, running = self.service.claim(jobs)
        self._mine = {job.id: job for job in mine}  # until stored (`_store` releases them)
        self.joined(running)
        try:
            ran = self._run_mine(mine, done)
        except BaseException as exc:
            self._release_mine(done, exc)
            raise
        self._release_mine(done)
        return {"jobs": len(raw_jobs), "ran": ran, "skipped": len(jobs) - ran}

    def _release_mine(self, done: dict[str, dict[str, Any]], error: BaseException | None = None) -> None:
        """The run's jobs still registered as running here end: a delivery of one waiting on this run gets its result
        in `done` (None: found stored) or `error`, and the jobs are released."""
        self.service.release(list(self._mine.values()), done, error)
        self._mine = {}

    def _run_mine(self, jobs: list[Job], done: dict[str, dict[str, Any]]) -> int:
        """Check in, dead-letter or run, store; returns how many ran."""
        todo = self._check_in(jobs, done)
        try:
            self._generate(todo, done)
        finally:
            self._store(done)  # whatever finished, also when the rest is requeued
        return len(todo)

    def _check_in(self, jobs: list[Job], done: dict[str, dict[str, Any]]) -> list[Attempt]:
        """Count a delivery of each job; returns the `Attempt`s to run. Jobs found stored are settled; cancelled and
        dead-lettered ones get their results in `done`."""
        runs = [Attempt(job, self.started_at, 0, job_hash=self.sent_hash(job.id)) for job in jobs]
        decisions = self.service.admit(runs, [self.backend.get_key_for_task(job.id) for job in jobs])
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

    def _parse(self, raw_jobs: list[dict[str, Any]]) -> tuple[list[Job], dict[str, dict[str, Any]]]:
        """The group's jobs, each checked as a single job is; a bad one gets its failed result, if its id is usable."""
        from tokenmill.queue.schemas import Job, JobResult, check_size, is_job_id

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
        """Submit every job to the engine at once (they join its running batch), then wait for all.

        On any error, or when the shutdown grace runs out, the unfinished requests are aborted and the group
        is requeued (finished results are stored by the caller; a redelivered group runs only the rest). A job
        past its deadline is stopped in the engine and ends `deadline_exceeded`; the others go on.
        """
        from tokenmill.worker.service import SHUTDOWN_CHECK_INTERVAL

        futures = self._submit(runs)
        deadlines = {future: run.deadline for future, (run, _) in futures.items() if run.deadline is not None}
        pending = set(futures)
        finishing: queue.SimpleQueue[Future] = queue.SimpleQueue()  # each future once, as it resolves
        for future in futures:
            future.add_done_callback(finishing.put)
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
        except Reject:
            raise
        except Exception as exc:
            log.exception("group %r failed (%s); requeueing it for its %d unfinished jobs", self.task_id,
                          type(exc).__name__, len(pending))
            raise Reject(f"group failed: {type(exc).__name__}", requeue=True) from exc
        finally:
            for future in pending:
                self.service.engine.abort(futures[future][1])
            self.service.metrics.jobs_in_flight.dec(len(runs))

    def _submit(self, runs: list[Attempt]) -> dict[Future, tuple[Attempt, str]]:
        """Hand `runs` to the engine in one message; returns each one's engine future -> (its `Attempt`, its engine
        request id). The caller owes `jobs_in_flight` a decrement per run."""
        futures = {future: (run, request_id) for run, (future, request_id) in zip(runs, self.service.submit_many(runs))}
        self.submitted()
        self.service.metrics.jobs_in_flight.inc(len(runs))
        return futures

    def _complete(self, run: Attempt, answer: Any) -> dict[str, Any]:
        """The final result of a job from the engine's answer (`engine_process.Answer`: an output, or an exception,
        raised here unless it is a refusal)."""
        try:
            if isinstance(answer, BaseException):
                raise answer
            return self.service.complete(run, output=answer)
        except InvalidRequestError as exc:
            return self.service.complete(run, error=exc)

    def _finished(self, finishing: queue.SimpleQueue[Future], pending: int, timeout: float) -> set[Future]:
        """The futures resolved since the last call: all `pending` ones, or those resolved within `timeout` (from a
        queue each future's callback feeds, so a call's work does not grow with the group)."""
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
        encoded = self.encode_new(results)
        if encoded:
            self.service.store_results(encoded)
            self.stored(results)

    def unstored(self, results: dict[str, dict[str, Any]]) -> list[str]:
        """The ids of the results not stored yet (by this run)."""
        if len(results) <= len(self._stored):
            return []
        return [job_id for job_id in results if job_id not in self._stored]

    def encode_new(self, results: dict[str, dict[str, Any]]) -> dict[bytes, bytes]:
        """The results not stored yet, encoded as Celery's meta under their keys (for `stored` once in Redis)."""
        return self.encode(results, self.unstored(results))

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
        """The results `encode_new` gave are in Redis: a later store does not repeat them, and their jobs are no
        longer running here (a delivery from now on is a new one: counted, it finds the result stored)."""
        new = self.unstored(results)
        self._stored.update(new)
        self.service.release([self._mine.pop(job_id) for job_id in new if job_id in self._mine], results)
        self.settled(new, results)
