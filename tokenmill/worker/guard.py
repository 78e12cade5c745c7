"""The worker's refusal of malformed or foreign task messages: what its consumer (`celery_adapter.GuardedConsumer`)
checks before a task strategy, and how it answers a refusal.

A refused message is rejected (never redelivered), answered so its sender does not wait forever (a FAILURE result
under its id, else a dead letter) and logged without its body (`describe`). Torch-free.
See docs/internals/worker.md, section "Celery and kombu adapters".
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from celery.exceptions import InvalidTaskError
from celery.utils.objects import Bunch

from tokenmill.queue import dead_letters
from tokenmill.queue.names import BATCH_TASK_NAME, TASK_NAME
from tokenmill.queue.schemas import JOB_ID_PATTERN, is_job_id

if TYPE_CHECKING:
    from celery import Celery
    from kombu.message import Message

log = logging.getLogger(__name__)

#: The only tasks a tokenmill worker runs; any other (Celery's built-ins included) is refused and marked failed.
#: To add a task, register it in `tokenmill.worker.app.create_app` and name it here.
ALLOWED_TASKS: frozenset[str] = frozenset({TASK_NAME, BATCH_TASK_NAME})
#: Longest task id a refusal is stored under; a longer one is set aside in the dead-letter list instead.
MAX_RESULT_ID_CHARS = 1024


def result_id(message: Message) -> str | None:
    """The id a refusal of `message` can be stored under, or None: a non-empty string of sane length."""
    headers = message.headers if isinstance(message.headers, dict) else {}
    task_id = headers.get("id")
    return task_id if isinstance(task_id, str) and 0 < len(task_id) <= MAX_RESULT_ID_CHARS else None


#: The `timelimit` header of a task sent without time limits, as JSON decodes it.
_NO_TIME_LIMITS = [None, None]


def protocol_problem(message: Message) -> str | None:
    """Why `message` is not a usable Celery protocol-2 task message, or None if it is. Undecodable bodies (pickle,
    non-JSON) are left to Celery, which refuses them with its own reason."""
    headers = message.headers
    if not isinstance(headers, dict) or not isinstance(headers.get("task"), str):
        return "not a Celery protocol 2 task message (no 'task' header)"
    if not isinstance(headers.get("id"), str) or not headers["id"]:
        return "the 'id' header is missing or not a string"
    if not is_job_id(headers["id"]):
        return f"the task id does not match {JOB_ID_PATTERN}"
    if not _time_limits_ok(headers.get("timelimit")):  # Celery unpacks it when the job starts, outside any guard
        return "the 'timelimit' header is not [hard or null, soft or null]"
    try:
        body = message.decode()
    except Exception:  # refused by content type or undecodable: Celery reports it
        return None
    if not (isinstance(body, list | tuple) and len(body) == 3):
        return "the body is not [args, kwargs, embed]"
    args, kwargs, embed = body
    if not isinstance(args, list | tuple) or not isinstance(kwargs, dict) or not isinstance(embed, dict | None):
        return "the body is not [list of args, dict of kwargs, dict or null embed]"
    return None


def _time_limits_ok(value: Any) -> bool:
    if value is None or value == _NO_TIME_LIMITS:  # what Celery's `send_task` writes without limits: no generator
        return True
    return isinstance(value, list | tuple) and len(value) == 2 and all(
        v is None or (isinstance(v, int | float) and not isinstance(v, bool)) for v in value)


def answer_refusal(app: Celery, message: Message, reason: str) -> None:
    """Store a FAILURE naming the id and `reason` under the message's id, or set the message aside when its
    id cannot name a result. Best effort: Redis being down must not stop the consumer (the message is gone
    either way)."""
    task_id = result_id(message)
    try:
        if task_id is not None:
            error = InvalidTaskError(f"task {task_id!r} refused by the tokenmill worker: {reason}")
            app.backend.mark_as_failure(task_id, error, request=failure_request(message))
        else:
            _set_aside(message, reason)
    except Exception as exc:  # noqa: BLE001: whatever the store raises, the consumer goes on
        log.error("could not record the refusal of %s: %s", describe(message), type(exc).__name__)


def failure_request(message: Message) -> Bunch:
    """What Celery's backend reads of a request when it stores a failure (no chord, no errbacks)."""
    headers = message.headers if isinstance(message.headers, dict) else {}
    properties = message.properties if isinstance(message.properties, dict) else {}
    name = headers.get("task") if isinstance(headers.get("task"), str) else None
    return Bunch(name=name, chord=None, root_id=headers.get("root_id"), errbacks=None,
                 correlation_id=properties.get("correlation_id"), reply_to=properties.get("reply_to"))


def _set_aside(message: Message, reason: str) -> None:
    """A refused message whose id cannot name a result, in the dead-letter list: its envelope, never its body (with
    the worker's service's Redis client and dead-letter limits)."""
    from tokenmill.worker import runtime  # the process's service: loaded in a worker only

    headers = message.headers if isinstance(message.headers, dict) else {}
    refused = {"task": headers.get("task"), "id": repr(headers.get("id"))[:200], "content_type": message.content_type,
               "bytes": len(message.body or b"")}
    service = runtime.current()
    dead_letters.push(service.redis, {dead_letters.REFUSED_FIELD: refused}, f"refused by the worker without a usable "
                      f"task id: {reason}", 1, service.settings.dead_letter_max_len, service.settings.dead_letter_expires)


def describe(message: Message) -> str:
    """Identify a message for the log by id, task name, type and size: never by its content."""
    headers = message.headers if isinstance(message.headers, dict) else {}
    return (
        f"(id={headers.get('id')!r} task={headers.get('task')!r} "
        f"content-type={message.content_type!r} {len(message.body or b'')} bytes)"
    )
