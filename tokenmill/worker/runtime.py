"""The worker process's one `WorkerService`, found by the Celery task at run time.

`tokenmill worker` installs the service it built from its flags before Celery starts. Under a plain
`celery -A tokenmill.worker.app worker --pool threads`, the first job builds one from `TOKENMILL_*`
variables instead (loading the model then), so the task works with Celery's own command line too.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from celery.signals import worker_shutting_down

from tokenmill.errors import InvalidRequestError
from tokenmill.queue.schemas import JobResult, check_size, job_payload
from tokenmill.worker.service import WorkerService
from tokenmill.worker.settings import WorkerSettings

_service: WorkerService | None = None
_lock = threading.Lock()


def install(service: WorkerService) -> None:
    global _service
    _service = service


def installed() -> WorkerService | None:
    """The service, if one was installed or built already (never builds one)."""
    return _service


def current() -> WorkerService:
    global _service
    with _lock:
        if _service is None:
            _service = WorkerService.start(WorkerSettings())
        return _service


def run_job(task: Any, args: tuple[Any, ...], fields: dict[str, Any]) -> dict[str, Any]:
    """Entry point of the `tokenmill.generate` task body.

    Before the service parses anything: the job must be one object (positional or `job=`) and/or keyword
    fields, and its encoding must fit `max_job_bytes`, the client's limit (a job sent with plain Celery
    never met the client). Either failure is a failed `JobResult` (`invalid_job`, naming the field).
    """
    service = current()
    task_id = task.request.id
    try:
        payload = job_payload(args, fields)
        check_size({**payload, **fields}, service.settings.max_job_bytes)
    except InvalidRequestError as exc:
        return service.failed(JobResult.failure(task_id, "invalid_job", exc.message, exc.field, started_at=time.time()))
    return service.run_job(task_id, payload, fields, task.backend, time_limit=_time_limit(task.request.timelimit))


def _time_limit(timelimit: Any) -> float | None:
    """The shorter of Celery's (time_limit, soft_time_limit) of `apply_async`, if either is set. (The threads
    pool enforces neither: the worker ends the job at that point itself, as `deadline_exceeded`.)"""
    limits = [float(limit) for limit in (timelimit or ()) if limit]
    return min(limits) if limits else None


@worker_shutting_down.connect
def _on_shutting_down(**_: Any) -> None:
    """SIGTERM/SIGINT reached Celery: start the shutdown grace period of the running jobs."""
    if _service is not None:
        _service.begin_shutdown()
