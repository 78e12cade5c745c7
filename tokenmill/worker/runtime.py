"""The worker process's one `WorkerService`: everything Celery calls (task bodies, the adapter's strategy and steps,
signals) reaches it here, and only here. Nothing else in the worker is kept per process.

`tokenmill worker` builds the service before Celery starts (`start`); under plain `celery worker` the first job builds
it from `TOKENMILL_*` variables (`current`). The process's intake (`intake`) may exist before it.
See docs/internals/worker.md, section "The pipeline".
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from celery.signals import worker_shutting_down

from tokenmill.errors import InvalidRequestError
from tokenmill.queue.names import SHARE_HEADER, message_share
from tokenmill.queue.schemas import Job, JobResult, check_size, is_job_id, job_payload
from tokenmill.worker.batch_task import BatchRun, PoolRun
from tokenmill.worker.engine_process import EngineFailure
from tokenmill.worker.intake import Intake
from tokenmill.worker.service import WorkerService, exit_on_engine_failure
from tokenmill.worker.settings import WorkerSettings

if TYPE_CHECKING:
    from celery.app.task import Task

_service: WorkerService | None = None
_intake: Intake | None = None  # made before the service, for it (`intake`)
_lock = threading.Lock()  # held while the service is built (the model loads meanwhile)
_intake_lock = threading.Lock()


def start(settings: WorkerSettings) -> WorkerService:
    """Build this process's service from `settings` (`tokenmill worker`, before Celery starts)."""
    return _built(settings)


def current() -> WorkerService:
    """The service, built from `TOKENMILL_*` variables by the first caller when none was (plain `celery worker`).
    An engine that fails to start then exits the worker (70, as any engine failure), its jobs left unacked for a
    restarted or another worker: raised, it would fail each job that asked."""
    try:
        return _built(None)
    except EngineFailure as exc:
        exit_on_engine_failure(exc)
        raise  # not reached: the exit


def _built(settings: WorkerSettings | None) -> WorkerService:
    """The process's service, built under `_lock` with the process's intake. With `settings` there must be none yet
    (RuntimeError). A build that raises keeps nothing: the next call builds afresh."""
    global _service
    with _lock:
        if _service is None:
            _service = WorkerService.start(settings if settings is not None else WorkerSettings(), intake())
        elif settings is not None:
            raise RuntimeError("this process has its worker service already")
        return _service


def intake() -> Intake:
    """The service's single-job intake; made here when Celery asks before the service exists (plain `celery
    worker`), and the service is then built with it."""
    global _intake
    service = _service
    if service is not None:
        return service.intake
    with _intake_lock:
        if _intake is None:
            _intake = Intake(start_service=current)
        return _intake


def run_job(task: Task, args: tuple[Any, ...], fields: dict[str, Any]) -> dict[str, Any]:
    """Body of the `tokenmill.generate` task on the pool path: the job as a group of one (`PoolRun`); the result for
    Celery to store, or `Ignore` when there is none. A job that is not one object and/or keyword fields, whose
    encoding exceeds `max_job_bytes` (plain Celery senders skip the client's check) or that is not a valid job ends as
    a failed `JobResult` (`invalid_job`, naming the field), under its own id if that is a valid one (a raw id may hold
    what must not reach logs and results), else the task's."""
    service, task_id = current(), task.request.id
    try:
        raw = {**job_payload(args, fields), **fields}
        check_size(raw, service.settings.max_job_bytes)
    except InvalidRequestError as exc:
        return service.failed(JobResult.failure(task_id, "invalid_job", exc.message, exc.field, started_at=time.time()))
    run = PoolRun(service, task_id, task.backend, _time_limit(task.request.timelimit), _share(task))
    raw.setdefault("id", task_id)
    try:
        job = Job.from_wire(raw)
    except InvalidRequestError as exc:
        job_id = raw["id"] if is_job_id(raw["id"]) else task_id
        return service.failed(JobResult.failure(job_id, "invalid_job", exc.message, exc.field,
                                                started_at=run.started_at))
    refused = service.refuse_output(job, run.started_at)
    return refused if refused is not None else run.run_one(job)


def run_batch(task: Task, batch: dict[str, Any] | None, fields: dict[str, Any]) -> dict[str, Any]:
    """Body of the `tokenmill.generate_batch` task: the group's jobs (`batch["jobs"]` or `jobs=`) on the service."""
    return BatchRun(current(), task.request.id, task.backend, share=_share(task)).run((batch or fields).get("jobs"))


def _share(task: Task) -> str | None:
    """The fair share of the task's message (Celery puts a message's own headers on its request)."""
    return message_share({SHARE_HEADER: getattr(task.request, SHARE_HEADER, None)})


def _time_limit(timelimit: Sequence[float | None] | None) -> float | None:
    """The shorter of `apply_async`'s time_limit and soft_time_limit, or None. The threads pool enforces neither;
    the worker ends the job there itself (`deadline_exceeded`)."""
    limits = [float(limit) for limit in (timelimit or ()) if limit]
    return min(limits) if limits else None


def stop_intake(closing: bool) -> None:
    """Celery's consumer stops (`celery_adapter.IntakeDrain`): at the worker's shutdown (`closing`), wait for the
    intake's jobs, as Celery waits for its pool's; at a consumer restart (a reconnect), they go on."""
    service = _service
    if service is None:
        return
    if closing:  # for good: a remote `shutdown` or `WorkController.stop()` sends no signal, the grace starts here
        service.begin_shutdown()
    if service.shutting_down:
        service.intake.drain()


@worker_shutting_down.connect
def _on_shutting_down(**_: object) -> None:
    """SIGTERM/SIGINT reached Celery: start the shutdown grace period of the running jobs."""
    if _service is not None:
        _service.begin_shutdown()
