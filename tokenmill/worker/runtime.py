"""The worker process's one `WorkerService`, found by the Celery task at run time.

`tokenmill worker` installs the service it built from its flags before Celery starts. Under a plain
`celery -A tokenmill.worker.app worker --pool threads`, the first job builds one from `TOKENMILL_*`
variables instead (loading the model then), so the task works with Celery's own command line too.
"""

from __future__ import annotations

import threading
from typing import Any

from celery.signals import worker_shutting_down

from tokenmill.worker.service import WorkerService
from tokenmill.worker.settings import WorkerSettings

_service: WorkerService | None = None
_lock = threading.Lock()


def install(service: WorkerService) -> None:
    global _service
    _service = service


def current() -> WorkerService:
    global _service
    with _lock:
        if _service is None:
            _service = WorkerService.start(WorkerSettings())
        return _service


def run_job(task: Any, payload: dict[str, Any] | None, fields: dict[str, Any]) -> dict[str, Any]:
    """Entry point of the `tokenmill.generate` task body."""
    task_id = task.request.id
    return current().run_job(task_id, payload, fields, task.backend.get_key_for_task(task_id))


@worker_shutting_down.connect
def _on_shutting_down(**_: Any) -> None:
    """SIGTERM/SIGINT reached Celery: start the shutdown grace period of the running jobs."""
    if _service is not None:
        _service.begin_shutdown()
