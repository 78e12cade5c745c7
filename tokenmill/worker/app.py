"""The worker's Celery app and its tasks, `tokenmill.generate` and `tokenmill.generate_batch`. Torch-free.

A job is an ordinary Celery task, so teams that already run Celery use it as they use any task::

    from tokenmill.worker.app import generate
    generate.delay(prompt="Hello", max_tokens=16).get()          # or app.send_task("tokenmill.generate", ...)

The module-level `app` reads its broker from `TOKENMILL_*` variables (so `celery -A tokenmill.worker.app
worker|inspect ...` and Flower work); `create_app(settings)` builds one for an explicit broker URL. It is the
queue's app (`tokenmill.queue.app`, whose docstring explains the settings both sides share) plus the
worker's own settings, each chosen for "a crash loses nothing, a slow job is not run twice":

* `task_acks_late`: a job is acknowledged only after the task returned, and Celery stores the return
  value (our result) before acking, so a job is acked only once its result is written. A worker that
  dies before that leaves the job unacked in Redis (`unacked` hash + `unacked_index` sorted set).
* `task_reject_on_worker_lost`: only matters for the prefork pool (a killed child); kept on so that
  a job whose executor died is requeued rather than marked failed, whatever pool runs it.
* `worker_prefetch_multiplier=1`: with late acks the prefetch window counts running jobs, so the
  worker holds exactly `concurrency` jobs, all of them running in the engine; none sit in a local
  buffer where they could wait behind long jobs while other workers idle.
* `worker_cancel_long_running_tasks_on_connection_loss=False`: a broker blip does not throw away
  generation in progress. The jobs keep running and ack through the old channel, whose messages
  stay in `unacked` with their leases renewed (tokenmill's transport does not requeue them at the
  reconnect, unlike kombu's), so a reconnect neither reruns a job nor charges it a delivery. If one
  is delivered again anyway (its worker was cut off for longer than the visibility timeout), this
  worker joins the run in progress (same job id) or finds its stored result (jobs are idempotent by
  id); delivery is at-least-once, and Celery never overwrites a stored SUCCESS.
* `worker_consumer`: Celery's consumer plus a check of each message's protocol-2 shape, task name
  (`ALLOWED_TASKS`) and task id (`JOB_ID_PATTERN`) (`tokenmill.worker.guard`), so a malformed or
  foreign message is discarded instead of stopping the worker or running a Celery built-in.
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

#: Celery renders each task's return value with `saferepr` for logs and task events (Flower). Cut at
#: 64 characters it shows the job's id and status but no completion text, and is cheap to compute (the full repr
#: of a result is on the worker's critical path).
RESULT_REPR_MAXSIZE = 64
#: What only a consuming app needs, beside the queue's `celery_config` (see the module docstring).
WORKER_CONFIG: dict[str, Any] = {
    "task_acks_late": True,
    "task_reject_on_worker_lost": True,
    "worker_prefetch_multiplier": 1,
    "worker_disable_rate_limits": True,
    "worker_cancel_long_running_tasks_on_connection_loss": False,
    "task_track_started": False,
    "worker_hijack_root_logger": False,
    "worker_consumer": "tokenmill.worker.celery_adapter:GuardedConsumer",
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
    # tokenmill.generate_batch: several jobs per message (tokenmill annotate --broker). `ignore_result`: the group's own
    # return value (counts, for the log) is no one's result; each job's is stored under the job's id. (A message's
    # `ignore_result` header overrides this; `QueueRunner` sets it too.)
    new.task(name=BATCH_TASK_NAME, bind=True, acks_late=True, reject_on_worker_lost=True,
             resultrepr_maxsize=RESULT_REPR_MAXSIZE, ignore_result=True)(_generate_batch)
    return new


def _generate(self: Task, *args: Any, **fields: Any) -> dict[str, Any] | None:
    """Run one job on this worker's engine; returns the `JobResult` as a JSON-ready dict.

    Accepts the job as one dict (what `Client` sends, positional or `job=`) or as keyword fields
    (`generate.delay(prompt=...)`). The signature takes anything, so a wrong shape (`args=["a prompt"]`,
    `job=[1, 2, 3]`) reaches `run_job` and ends as a failed `JobResult` instead of a bare TypeError.
    """
    return _runtime().run_job(self, args, fields)


def _generate_batch(self: Task, batch: dict[str, Any] | None = None, **fields: Any) -> dict[str, Any]:
    """Run a group of jobs (`tokenmill.worker.batch_task`); returns counts for the log (each job's result is stored
    under its own id)."""
    return _runtime().run_batch(self, batch, fields)


def _runtime() -> ModuleType:
    """`tokenmill.worker.runtime`, the owner of this worker process's service, which the task bodies run on. Imported
    at the first job, not with this module: producers import the app (`generate.delay`) and never load the service."""
    import tokenmill.worker.runtime as runtime

    return runtime


app = create_app()
generate = app.tasks[TASK_NAME]
