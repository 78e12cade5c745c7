"""`Outcomes`, the part of `WorkerService` that turns an admission's decision or the engine's answer into the job's
final wire result (`JobResult.to_wire()`): counted in the metrics, logged, written to S3 or dead-lettered. Every path
through `tokenmill.worker.batch_task.BatchRun` ends here.
See docs/internals/worker.md, section "The pipeline".
"""

from __future__ import annotations

import json
import logging
import threading
import time
from typing import TYPE_CHECKING, Any

from celery.exceptions import Reject

from tokenmill.queue import dead_letters
from tokenmill.queue.names import DEAD_LETTER_KEY
from tokenmill.queue.schemas import Job, JobResult
from tokenmill.worker.admission import Cancelled, Conflict, DeadLetter, Stored, settled_by
from tokenmill.worker.output import result_wire
from tokenmill.worker.sinks import OutputWriteError, WriteAbandoned, output_refusal

if TYPE_CHECKING:
    import redis

    from tokenmill.errors import InvalidRequestError
    from tokenmill.worker.admission import Attempt, Decision
    from tokenmill.worker.metrics import WorkerMetrics
    from tokenmill.worker.output import EngineOutput
    from tokenmill.worker.settings import WorkerSettings
    from tokenmill.worker.sinks import S3Sink

log = logging.getLogger("tokenmill.worker")


class Outcomes:
    """Final results and their bookkeeping; thread-safe (each call touches only its job, the metrics and Redis)."""

    settings: WorkerSettings
    metrics: WorkerMetrics
    sink: S3Sink | None
    redis: redis.Redis
    hostname: str  # Celery's node name: each result's `worker`
    grace_expired: threading.Event  # set once the shutdown grace has run out: an S3 write still retrying is requeued

    def refuse_output(self, job: Job, started_at: float) -> dict[str, Any] | None:
        """The failed result of a job whose S3 destination is outside `output_prefixes` (nothing generated), or None."""
        location = job.s3_location
        problem = None if location is None else output_refusal(location, self.settings.output_prefixes)
        if problem is None:
            return None
        return self.failed(JobResult.failure(job.id, "invalid_request", problem, "output", started_at=started_at,
                                             queued_at=job.submitted_at, metadata=job.metadata, job_hash=job.content_hash()))

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
        """Whether the run `job` joined gave another content's result under this id: a conflict (`skip_stored`)."""
        job_hash = job.content_hash()
        settled = settled_by(result.get("job_hash"), job_hash)
        if isinstance(settled, Conflict):
            self.skip_stored(job, settled, job_hash)
        return isinstance(settled, Conflict)

    def skip_stored(self, job: Job, settled: Stored | Conflict, job_hash: str) -> None:
        """Log (and for a `Conflict`, count) a job not run because a final result is stored under its id."""
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

    def dead_letter(self, job: Job, attempt: int, started_at: float) -> dict[str, Any]:
        message = (
            f"delivered {attempt} times and no earlier delivery finished (its worker died, or its run failed and was "
            f"requeued, each time); not run again, moved to the Redis list {DEAD_LETTER_KEY}"
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
