"""The `tokenmill.generate_batch` task: several jobs in one queue message, each with its own id and result.

Why: on short completions a worker spends more time on Celery, kombu and Redis per message than the engine
spends per job (measured: ~2 ms of worker CPU per message, so 1000 8-token jobs reached 0.64x the in-process
throughput). `tokenmill annotate --broker` therefore sends rows in groups. Inside a group every job keeps the
guarantees of a single `tokenmill.generate` job:

* its id is its idempotency key: a job whose final result is already stored is not run again (a redelivered
  group runs only the jobs that have no result yet);
* it gets exactly one result, under its own Celery result key, so `Client.get`/`as_completed` read it like
  any job's. Results are written with `SET NX` (never overwriting a stored one) and announced on the key's
  pub/sub channel as Celery does, in one pipelined round trip per group. (After a broker outage a group may
  run on two workers at once, as a single job may; `SET NX` still keeps exactly one result per job);
* a group's deliveries are counted like a job's; a group that has killed `max_deliveries` workers
  dead-letters the jobs in it that have no result;
* the message is acknowledged only after all of its results are stored (late ack); at shutdown, past the
  grace period, finished jobs' results are stored and the group is requeued for the rest.

The message body is `[[{"jobs": [job, ...]}], {}, {}]`: each job in `Job`'s wire format. Torch-free (the
worker service is imported when a group arrives).
"""

from __future__ import annotations

import logging
import time
import uuid
from concurrent.futures import FIRST_COMPLETED, Future, wait
from typing import TYPE_CHECKING, Any

from celery import states
from celery.exceptions import Reject

from tokenmill.errors import InvalidRequestError

if TYPE_CHECKING:
    from tokenmill.jobs.schemas import Job

BATCH_TASK_NAME = "tokenmill.generate_batch"
_WAIT_INTERVAL = 2.0  # seconds between shutdown checks while a group runs

log = logging.getLogger("tokenmill.worker")


def register(app: Any) -> None:
    """Add the task to a Celery app (called by `create_app`)."""
    app.task(name=BATCH_TASK_NAME, bind=True, acks_late=True, reject_on_worker_lost=True, resultrepr_maxsize=64)(
        _generate_batch
    )


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

    def run(self, raw_jobs: Any) -> dict[str, Any]:
        if not isinstance(raw_jobs, list) or not all(isinstance(j, dict) for j in raw_jobs):
            log.error("group %s discarded: 'jobs' must be a list of job objects", self.task_id)
            return {"jobs": 0, "ran": 0, "error": "'jobs' must be a list of job objects"}
        from tokenmill.worker.service import _is_final

        jobs, done = self._parse(raw_jobs)
        stored, attempt = self._check_in([job.id for job in jobs])
        todo = [job for job, final in zip(jobs, stored) if not _is_final(final)]
        if attempt > self.service.settings.max_deliveries:
            for job in todo:
                done[job.id] = self.service._dead_letter(job, attempt, self.started_at)
        elif todo:
            done.update(self._generate(todo, attempt))
        self._store(done)
        return {"jobs": len(raw_jobs), "ran": len(todo), "skipped": len(jobs) - len(todo)}

    def _parse(self, raw_jobs: list[dict[str, Any]]) -> tuple[list[Job], dict[str, dict[str, Any]]]:
        from tokenmill.jobs.schemas import Job, JobResult, check_size

        jobs, failed = [], {}
        for raw in raw_jobs:
            try:
                check_size(raw, self.service.settings.max_job_bytes)  # per job, as for a single job
                jobs.append(Job.from_wire(raw))
            except InvalidRequestError as exc:
                job_id = raw.get("id")
                if isinstance(job_id, str) and job_id:
                    failed[job_id] = self.service._failed(
                        JobResult.failure(job_id, "invalid_job", exc.message, exc.field, started_at=self.started_at))
                else:
                    log.error("group %s: a job without a usable id was discarded: %s", self.task_id, exc)
        return jobs, failed

    def _check_in(self, job_ids: list[str]) -> tuple[list[bytes | None], int]:
        """One round trip: each job's stored result and this group delivery's number."""
        from tokenmill.worker.app import DELIVERIES_KEY

        key = DELIVERIES_KEY.format(job_id=self.task_id)
        with self.service.redis.pipeline(transaction=False) as pipe:
            pipe.mget([self.backend.get_key_for_task(i) for i in job_ids]) if job_ids else pipe.echo("")
            pipe.incr(key).expire(key, self.service.settings.result_expires)
            stored, attempt, _ = pipe.execute()
        return (stored if job_ids else []), int(attempt)

    def _generate(self, jobs: list[Job], attempt: int) -> dict[str, dict[str, Any]]:
        """Submit every job to the engine at once (they join its running batch), then wait for all."""
        from tokenmill.worker.service import _Attempt

        futures: dict[Future, tuple[Job, str]] = {}
        done: dict[str, dict[str, Any]] = {}
        for job in jobs:
            request_id = f"{job.id}#{uuid.uuid4().hex[:8]}"
            messages = [m.model_dump() for m in job.messages] if job.messages else None
            future = self.service.engine.submit(request_id, job.sampling, prompt=job.prompt or job.prompt_token_ids,
                                                messages=messages)
            futures[future] = (job, request_id)
        self.service.metrics.jobs_in_flight.inc(len(jobs))
        try:
            pending = set(futures)
            while pending:
                finished, pending = wait(pending, timeout=_WAIT_INTERVAL, return_when=FIRST_COMPLETED)
                for future in finished:
                    job = futures[future][0]
                    done[job.id] = self._finish(job, future, _Attempt(job, self.started_at, attempt))
                if pending and self.service._abandon.is_set():
                    for future in pending:
                        self.service.engine.abort(futures[future][1])
                    self._store(done)
                    log.warning("group %s: %d jobs not finished when the shutdown grace ran out; requeueing it",
                                self.task_id, len(pending))
                    raise Reject("worker shutting down", requeue=True)
        finally:
            self.service.metrics.jobs_in_flight.dec(len(jobs))
        return done

    def _finish(self, job: Job, future: Future, run: Any) -> dict[str, Any]:
        from tokenmill.jobs.schemas import JobResult
        from tokenmill.worker.service import _result_from_output, _times

        try:
            output = future.result()
        except InvalidRequestError as exc:
            return self.service._failed(JobResult.failure(job.id, "invalid_request", exc.message, exc.field, **_times(job, run)))
        result = _result_from_output(job, run, output, self.service.hostname)
        if job.output:
            return self.service._write_output(job, result)
        return self.service._succeeded(result)

    def _store(self, results: dict[str, dict[str, Any]]) -> None:
        """Each job's result under its own Celery key, unless one is stored already; then announce the new ones."""
        if not results:
            return
        encoded = {}
        for job_id, wire in results.items():
            meta = self.backend._get_result_meta(result=wire, state=states.SUCCESS, traceback=None, request=None)
            meta["task_id"] = job_id
            encoded[self.backend.get_key_for_task(job_id)] = self.backend.encode(meta)
        expires = int(self.service.settings.result_expires)
        redis = self.service.redis
        with redis.pipeline(transaction=False) as pipe:
            for key, value in encoded.items():
                pipe.set(key, value, ex=expires, nx=True)
            written = pipe.execute()
        with redis.pipeline(transaction=False) as pipe:
            for (key, value), new in zip(encoded.items(), written):
                if new:
                    pipe.publish(key, value)
            pipe.execute()

