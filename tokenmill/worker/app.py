"""The worker's Celery app and its tasks, `tokenmill.generate` and `tokenmill.generate_batch`. Torch-free.

A job is an ordinary Celery task: `generate.delay(prompt="Hello", max_tokens=16).get()`. The module-level `app` reads
its broker from `TOKENMILL_*` variables (`celery -A tokenmill.worker.app`, Flower); `create_app(settings)` builds one
for an explicit broker. `WORKER_CONFIG` is chosen so that a crash loses nothing and a slow job is not run twice.
See docs/internals/worker.md, section "Shutdown and failures".
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

from celery import Celery, Task

from tokenmill.queue.app import celery_config, queue_app
from tokenmill.queue.names import BATCH_TASK_NAME, TASK_NAME
from tokenmill.queue.names import TASK_ROUTES as TASK_ROUTES  # public here too: `from tokenmill.worker.app import ...`
from tokenmill.queue.settings import QueueSettings
from tokenmill.worker import control  # noqa: F401  (tokenmill's revoke, refusals of what cannot work)
from tokenmill.worker.celery_adapter import BACKEND_OVERRIDES, IntakeDrain, LeaseRenewal

#: Length of a result's `saferepr` in logs and task events: the job's id and status, no completion text (cheap on
#: the worker's critical path).
RESULT_REPR_MAXSIZE = 64
#: What only a consuming app needs, beside the queue's `celery_config`.
WORKER_CONFIG: dict[str, Any] = {
    "task_acks_late": True,  # acked only once its result is stored: a dead worker's jobs stay unacked
    "task_reject_on_worker_lost": True,  # a job whose executor died is requeued, not failed
    "worker_prefetch_multiplier": 1,  # with late acks: holds only jobs running in the engine
    "worker_disable_rate_limits": True,
    "worker_cancel_long_running_tasks_on_connection_loss": False,  # a broker blip keeps jobs running
    "task_track_started": False,
    "worker_hijack_root_logger": False,
    "worker_consumer": "tokenmill.worker.celery_adapter:GuardedConsumer",  # refusals: `tokenmill.worker.guard`
}


def configure(app: Celery, settings: QueueSettings) -> Celery:
    """Apply `settings` to an existing app (the worker does this with its CLI settings)."""
    app.conf.update({**celery_config(settings), **WORKER_CONFIG})
    return app


def create_app(settings: QueueSettings | None = None) -> Celery:
    """A new worker app for `settings` with the `tokenmill.generate` and `tokenmill.generate_batch` tasks."""
    new = queue_app(settings)
    new.conf.update(WORKER_CONFIG)
    new.loader.override_backends = {**new.loader.override_backends, **BACKEND_OVERRIDES}  # results in batches
    new.steps["consumer"].add(LeaseRenewal)
    new.steps["consumer"].add(IntakeDrain)
    new.task(
        name=TASK_NAME, bind=True, acks_late=True, reject_on_worker_lost=True, resultrepr_maxsize=RESULT_REPR_MAXSIZE,
        Strategy="tokenmill.worker.celery_adapter:strategy",  # single jobs in groups (`tokenmill.worker.intake`)
    )(_generate)
    # tokenmill.generate_batch: several jobs per message. `ignore_result`: its return value (counts) is only for the
    # log; each job's result is stored under the job's id (a message's `ignore_result` header overrides this).
    new.task(name=BATCH_TASK_NAME, bind=True, acks_late=True, reject_on_worker_lost=True,
             resultrepr_maxsize=RESULT_REPR_MAXSIZE, ignore_result=True)(_generate_batch)
    return new


def _generate(self: Task, *args: Any, **fields: Any) -> dict[str, Any] | None:
    """Run one job; returns its `JobResult` as a JSON-ready dict. The job is one dict (positional or `job=`) or
    keyword fields; the catch-all signature lets a wrong shape end as a failed `JobResult` (`run_job`), not a
    TypeError."""
    return _runtime().run_job(self, args, fields)


def _generate_batch(self: Task, batch: dict[str, Any] | None = None, **fields: Any) -> dict[str, Any]:
    """Run a group of jobs (`tokenmill.worker.batch_task`); returns counts for the log (each job's result is stored
    under its own id)."""
    return _runtime().run_batch(self, batch, fields)


def _runtime() -> ModuleType:
    """`tokenmill.worker.runtime`, imported at the first job, not with this module: producers import the app and
    must never load the service."""
    import tokenmill.worker.runtime as runtime

    return runtime


app = create_app()
generate = app.tasks[TASK_NAME]
