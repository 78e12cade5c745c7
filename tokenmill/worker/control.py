"""Celery's remote-control commands on a tokenmill worker: what works, and an error for what does not.

`revoke` and `terminate` cancel jobs in Redis as `Client.cancel` does; `rate_limit` and `time_limit` answer an error;
`STATE_CHANGING` commands are refused unless `remote_control_writes` is on; `enable_events` and `disable_events` also
rebuild the task strategies. Torch-free.
See docs/internals/worker.md, section "Cancels, leases and control".
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from celery.signals import worker_init
from celery.utils.functional import maybe_list
from celery.worker.control import Panel, control_command, nok, ok

from tokenmill.queue import cancels

if TYPE_CHECKING:
    from celery import Celery
    from celery.events.dispatcher import EventDispatcher
    from celery.worker.consumer import Consumer

log = logging.getLogger("tokenmill.worker")

#: Celery's commands that turn task events on and off; they also rebuild the strategies (`_switching_events`).
EVENT_SWITCHES = ("enable_events", "disable_events")
_celery_switches = {name: Panel.data[name] for name in EVENT_SWITCHES}
#: Commands that change the worker and are refused unless `remote_control_writes` is on.
STATE_CHANGING = ("shutdown", "pool_grow", "pool_shrink", "pool_restart", "autoscale", "add_consumer", "cancel_consumer")
_celery_handlers = {name: Panel.data[name] for name in STATE_CHANGING}


class ControlState(Protocol):
    """What a command reads of the state Celery hands each remote-control command (its pidbox's)."""

    app: Celery
    consumer: Consumer


#: What a command answers (`ok` or `nok`).
Reply = dict[str, str]
#: A remote-control command's handler, as Celery's `Panel` registers it.
Command = Callable[..., Reply]


def _cancel(state: ControlState, task_ids: str | list[str] | None) -> Reply:
    app = state.app
    outcomes = cancels.cancel(app.backend, [str(i) for i in maybe_list(task_ids) or []], int(app.conf.result_expires))
    log.info("remote cancel of %d jobs: %s", len(outcomes), outcomes)
    return ok(", ".join(f"{job_id}: {outcome}" for job_id, outcome in outcomes.items()) or "no task id given")


@control_command(variadic="task_id", signature="[id1 [id2 [... [idN]]]]")
def revoke(state: ControlState, task_id: str | list[str] | None, terminate: bool = False, signal: str | None = None,
           **kwargs: Any) -> Reply:
    """Cancel jobs by id (terminate or not: a running job always stops, keeping its partial text)."""
    return _cancel(state, task_id)


@control_command(args=[("signal", str), ("task_id", str)], signature="<signal> <task_id>")
def terminate(state: ControlState, signal: str | None, task_id: str | list[str] | None, **kwargs: Any) -> Reply:
    """Cancel a running job (the signal is not used: the engine stops the job, not a process)."""
    return _cancel(state, task_id)


@control_command(args=[("task_name", str), ("rate_limit", str)], signature="<task_name> <rate_limit (e.g., 5/s)>")
def rate_limit(state: ControlState, task_name: str, rate_limit: str, **kwargs: Any) -> Reply:
    """Refused: tokenmill workers take jobs as fast as the engine has room (rate limits are off)."""
    return nok("rate limits are not supported by tokenmill workers (they take jobs as the engine has room); "
               "limit what producers submit instead")


@control_command(args=[("task_name", str), ("soft", float), ("hard", float)],
                 signature="<task_name> <soft_secs> [hard_secs]")
def time_limit(state: ControlState, task_name: str | None = None, hard: float | None = None, soft: float | None = None,
               **kwargs: Any) -> Reply:
    """Refused: per-task time limits cannot be changed remotely; each job carries its own."""
    return nok("time limits cannot be set remotely on tokenmill workers: give each job deadline_s "
               "(or apply_async(time_limit=...)); it then ends deadline_exceeded with its partial text")


def _refused(name: str) -> Command:
    def refuse(state: ControlState, *args: Any, **kwargs: Any) -> Reply:
        return nok(f"'{name}' is disabled on this tokenmill worker: commands that change a worker's state are off "
                   "unless it runs with --remote-control-writes (TOKENMILL_REMOTE_CONTROL_WRITES=true)")
    return refuse


def sends_task_events(dispatcher: EventDispatcher | None) -> bool:
    """Whether Celery's event dispatcher sends task events: with `-E`, or once `enable_events` has turned them on. A
    worker's dispatcher is on for its heartbeats even without, but then drops task events."""
    return bool(dispatcher is not None and dispatcher.enabled and (not dispatcher.groups or "task" in dispatcher.groups))


def _switching_events(name: str) -> Command:
    """Celery's `name` command, then the consumer's task strategies rebuilt if task events went on or off: a strategy
    reads the dispatcher's state once, when it is built."""
    switch = _celery_switches[name]

    def command(state: ControlState, **kwargs: Any) -> Reply:
        consumer = state.consumer
        was_on = sends_task_events(consumer.event_dispatcher)
        reply = switch(state, **kwargs)
        if sends_task_events(consumer.event_dispatcher) != was_on:
            consumer.update_strategies()
        return reply

    return command


def allow_state_changes(allowed: bool, explicit: bool = True) -> None:
    """Turn Celery's state-changing commands on or off for this process (Celery's command table is per process).
    An `explicit` call (`tokenmill worker`, before Celery starts) wins over later implicit ones."""
    global _explicit
    if _explicit and not explicit:
        return
    _explicit = _explicit or explicit
    for name in STATE_CHANGING:
        Panel.data[name] = _celery_handlers[name] if allowed else _refused(name)


@worker_init.connect
def _from_environment(**_: object) -> None:
    """Under plain `celery worker`: the setting from TOKENMILL_REMOTE_CONTROL_WRITES (settings imported here, in a
    worker only: producers import the app)."""
    from tokenmill.worker.settings import WorkerSettings

    allow_state_changes(WorkerSettings().remote_control_writes, explicit=False)


_explicit = False
allow_state_changes(False, explicit=False)
for _name in EVENT_SWITCHES:
    Panel.data[_name] = _switching_events(_name)
