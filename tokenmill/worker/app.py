"""The Celery app and the `tokenmill.generate` task. Torch-free: producers import this module.

A job is an ordinary Celery task, so teams that already run Celery use it as they use any task::

    from tokenmill.worker.app import generate
    generate.delay(prompt="Hello", max_tokens=16).get()          # or app.send_task("tokenmill.generate", ...)

The module-level `app` reads its broker from `TOKENMILL_*` variables (so `celery -A tokenmill.worker.app
inspect ...` and Flower work); `create_app(settings)` builds one for an explicit broker URL.

Every setting below is chosen for "a crash loses nothing, a slow job is not run twice":

* JSON only (`accept_content`, `result_accept_content`): a pickle or YAML message is refused by the
  worker before anything in it is decoded, so a message on the queue can never execute code.
* `broker_transport`: tokenmill's Redis transport (`tokenmill.queue.transport`): a message moves from
  the queue to a per-consumer processing list in one command (BLMOVE) and from there into kombu's
  unacked records in one Lua script, so it is never on no list; a consumer that died between the
  two has its processing list requeued once its heartbeat (`consumer_ttl` = visibility timeout)
  expired. Malformed raw items are set aside instead of stopping the consumer.
* `task_acks_late`: a job is acknowledged only after the task returned, and Celery stores the return
  value (our result) before acking, so a job is acked only once its result is written. A worker that
  dies before that leaves the job unacked in Redis (`unacked` hash + `unacked_index` sorted set).
* `task_reject_on_worker_lost`: only matters for the prefork pool (a killed child); kept on so that
  a job whose executor died is requeued rather than marked failed, whatever pool runs it.
* `broker_transport_options.visibility_timeout`: kombu's Redis transport redelivers an unacked
  message once it has been unacked for longer than this. Kombu measures it from the delivery, not
  from the last sign of life, so on its own a short timeout would rerun slow jobs while they still
  run; the worker therefore renews the delivery time of every message it holds
  (`tokenmill.worker.leases`) every `visibility_timeout / 8` seconds. The timeout then only bounds
  how long a *crashed* worker's jobs wait, and can be short (`TOKENMILL_VISIBILITY_TIMEOUT`).
* `unacked_restore_interval` = visibility_timeout / 8 (at most 5 s) and `unacked_restore_throttle`
  = 1: how often each worker sweeps for expired messages and dead consumers' processing lists (a
  worker also sweeps once when it starts). Kombu's defaults (every 10 s, but scanning only every
  10th time) add up to 100 s to a recovery: measured with a 3 s visibility timeout, a kill -9'd
  worker's jobs restarted elsewhere after 99.5 s with kombu's defaults and after 3.1 s with a
  timeout / 4 sweep. Since the last lease renewal happened at most visibility_timeout / 8 before a
  crash, the jobs of a crashed worker run again between 0.875 x and 1 x visibility_timeout + one
  sweep interval after it died (52-65 s for the default 60 s; measured in README).
* `unacked_mutex_expire`: the lock a sweep holds; a worker killed during a sweep would block all
  sweeps for kombu's default 300 s, so it is bounded by the visibility timeout (at least 5 s).
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
* `result_backend_always_retry`: a result write during a Redis outage waits (backoff capped at 1 s)
  until Redis is back instead of failing the job.
* `broker_connection_max_retries=None`: a worker keeps reconnecting to a restarted Redis forever.
* `worker_consumer`: Celery's consumer plus a check of each message's protocol-2 shape, task name
  (`ALLOWED_TASKS`) and task id (`JOB_ID_PATTERN`) (`tokenmill.worker.guard`), so a malformed or
  foreign message is discarded instead of stopping the worker or running a Celery built-in.
"""

from __future__ import annotations

from typing import Any

from celery import Celery

from tokenmill.worker.batch_task import BATCH_TASK_NAME
from tokenmill.worker.batch_task import register as register_batch_task
from tokenmill.worker.leases import LeaseRenewal
from tokenmill.worker.settings import DEFAULT_QUEUE, QueueSettings

TASK_NAME = "tokenmill.generate"
#: For a team's own Celery app: `app.conf.task_routes = TASK_ROUTES` (or merge it into theirs) sends
#: `app.send_task("tokenmill.generate", ...)` to the queue tokenmill workers consume. Without it Celery
#: publishes to its default queue `celery`, which no tokenmill worker reads, and the job waits forever.
TASK_ROUTES = {TASK_NAME: {"queue": DEFAULT_QUEUE}}
#: The only tasks a tokenmill worker executes. A message for any other task (Celery's built-ins such as
#: `celery.chord_unlock` included) is refused by the consumer (`tokenmill.worker.guard`) and marked
#: failed. To add a task, register it in `create_app` and name it here.
ALLOWED_TASKS: frozenset[str] = frozenset({TASK_NAME, BATCH_TASK_NAME})
#: kombu transport of every tokenmill app: kombu's Redis transport with an atomic take-and-record of
#: each message (`tokenmill.queue.transport`). Producers publish exactly as with plain `redis://`.
BROKER_TRANSPORT = "tokenmill.queue.transport:Transport"
#: tokenmill's own Redis keys, beside Celery's: the delivery count of each job, and the list of jobs
#: given up on after `max_deliveries` (newest first).
DELIVERIES_KEY = "tokenmill:deliveries:{job_id}"
DEAD_LETTER_KEY = "tokenmill:dead_letter"
#: Celery renders each task's return value with `saferepr` for logs and task events (Flower). Cut at
#: 64 characters it shows the job's id and status but no completion text, and is cheap to compute
#: (the full repr of a result costs ~0.13 ms per job, on the worker's critical path).
RESULT_REPR_MAXSIZE = 64


def transport_options(visibility_timeout: float) -> dict[str, Any]:
    """kombu Redis transport options for a given visibility timeout (see the module docstring)."""
    return {
        "visibility_timeout": visibility_timeout,
        "consumer_ttl": max(1.0, visibility_timeout),
        "unacked_restore_interval": min(5.0, max(0.25, visibility_timeout / 8)),
        "unacked_restore_throttle": 1,
        "unacked_mutex_expire": int(max(5, min(300, visibility_timeout))),
    }


def celery_config(settings: QueueSettings) -> dict[str, Any]:
    """The Celery configuration for these settings; every value is explained in the module docstring."""
    return {
        "broker_url": settings.broker_url,
        "broker_transport": BROKER_TRANSPORT,
        "result_backend": settings.backend_url,
        "task_serializer": "json",
        "result_serializer": "json",
        "accept_content": ["json"],
        "result_accept_content": ["json"],
        "task_acks_late": True,
        "task_reject_on_worker_lost": True,
        "worker_prefetch_multiplier": 1,
        "worker_disable_rate_limits": True,
        "worker_cancel_long_running_tasks_on_connection_loss": False,
        "task_default_queue": settings.queue,
        "task_track_started": False,
        "result_expires": settings.result_expires,
        "result_backend_always_retry": True,
        "result_backend_max_sleep_between_retries_ms": 1000,
        "broker_transport_options": transport_options(settings.visibility_timeout),
        "broker_connection_retry_on_startup": True,
        "broker_connection_max_retries": None,
        "worker_hijack_root_logger": False,
        "worker_consumer": "tokenmill.worker.guard:GuardedConsumer",
    }


def configure(app: Celery, settings: QueueSettings) -> Celery:
    """Apply `settings` to an existing app (the worker does this with its CLI settings)."""
    app.conf.update(celery_config(settings))
    return app


def create_app(settings: QueueSettings | None = None) -> Celery:
    """A new Celery app for `settings` with the `tokenmill.generate` task registered."""
    new = Celery("tokenmill", set_as_current=False)
    configure(new, settings or QueueSettings())
    new.steps["consumer"].add(LeaseRenewal)
    new.task(
        name=TASK_NAME, bind=True, acks_late=True, reject_on_worker_lost=True, resultrepr_maxsize=RESULT_REPR_MAXSIZE
    )(_generate)
    register_batch_task(new)  # tokenmill.generate_batch: several jobs per message (tokenmill annotate --broker)
    return new


def _generate(self: Any, *args: Any, **fields: Any) -> dict[str, Any] | None:
    """Run one job on this worker's engine; returns the `JobResult` as a JSON-ready dict.

    Accepts the job as one dict (what `Client` sends, positional or `job=`) or as keyword fields
    (`generate.delay(prompt=...)`). The signature takes anything, so a wrong shape (`args=["a prompt"]`,
    `job=[1, 2, 3]`) reaches `run_job` and ends as a failed `JobResult` instead of a bare TypeError.
    The heavy service is imported here, not at module level, so producers never load it.
    """
    from tokenmill.worker.runtime import run_job

    return run_job(self, args, fields)


app = create_app()
generate = app.tasks[TASK_NAME]
