"""Every part of Celery the worker replaces: each class and function here subclasses, replaces or proxies one and
says which; tokenmill's own logic stays in `guard`, `leases` and `intake`. tests/test_library_contract.py checks the
Celery names they rely on. Torch-free and light: the app imports it, so `runtime` is imported only as Celery calls.
See docs/internals/worker.md, section "Celery and kombu adapters".
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from celery import bootsteps, signals, states
from celery.backends.redis import RedisBackend
from celery.exceptions import BackendStoreError, InvalidTaskError, NotRegistered
from celery.worker import state
from celery.worker.consumer import Consumer
from celery.worker.strategy import default
from kombu.utils.encoding import bytes_to_str

from tokenmill.queue.batching import Coalescer
from tokenmill.queue.cancels import result_meta
from tokenmill.queue.packing import PACKER_OPTIONS
from tokenmill.worker.control import sends_task_events
from tokenmill.worker.guard import (ALLOWED_TASKS, answer_refusal, describe, failure_request, log, protocol_problem,
                                    result_id)
from tokenmill.worker.leases import renew

if TYPE_CHECKING:
    from celery import Celery
    from celery.app.task import Context, Task
    from celery.events.dispatcher import EventDispatcher
    from celery.worker.request import Request
    from kombu.message import Message
    from redis.commands.core import Script

#: The worker app's backends by URL scheme (`celery.app.backends.by_name` aliases).
BACKEND_OVERRIDES = {scheme: f"{__name__}:CoalescingRedisBackend" for scheme in ("redis", "rediss")}

# KEYS: result keys. ARGV: per key its encoded meta and its expiry in seconds (0: none).
# Returns how many were stored (a key holding a SUCCESS is kept, as Celery's `_store_result` does).
_STORE = """
local stored = 0
for i, key in ipairs(KEYS) do
  local current = redis.call('GET', key)
  local ok, meta = false, nil
  if current then ok, meta = pcall(cjson.decode, current) end
  if not (ok and type(meta) == 'table' and meta.status == 'SUCCESS') then
    local value, expires = ARGV[2 * i - 1], tonumber(ARGV[2 * i])
    if expires > 0 then
      redis.call('SET', key, value, 'EX', expires)
    else
      redis.call('SET', key, value)
    end
    redis.call('PUBLISH', key, value)
    stored = stored + 1
  end
end
return stored
"""


class CoalescingRedisBackend(RedisBackend):
    """Replaces Celery's `RedisBackend` in the worker app (`BACKEND_OVERRIDES`): results of jobs finishing together
    are stored in one `_STORE` call (`Coalescer`), with Celery's keys, values, expiry and announcement."""

    #: Results per script call: Redis runs a script alone, so none may take long.
    STORE_LIMIT = 256

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # One instance for all pool threads, so their stores can share a call. Safe: redis-py clients are
        # thread-safe and the worker never waits on results through the (unsafe) pub/sub consumer. Set on the
        # instance: Celery's Backend.__init__ overrides the class attribute.
        self.thread_safe = True
        self.connparams.update(PACKER_OPTIONS)  # its pool's connections pack with hiredis alone
        self._stores: Coalescer[tuple[str, bytes, int], None] = Coalescer(self._store_many, limit=self.STORE_LIMIT)
        self._store_script: Script | None = None
        self._task_key_prefix: bytes = self._get_key_for(self.task_keyprefix, "")

    def get_key_for_task(self, task_id: str | bytes, key: str | bytes = "") -> bytes:
        """Celery's key; a text id is joined to the prefix encoded once."""
        if task_id and key == "" and task_id.__class__ is str:
            return self._task_key_prefix + task_id.encode()
        return super().get_key_for_task(task_id, key)

    def _get_result_meta(self, result: Any, state: str, traceback: str | None, request: Context | None,
                         format_date: bool = True, encode: bool = False) -> dict[str, Any]:
        """Celery's meta; without a request (every job's result: its fields are the job's own), `result_meta`'s."""
        if request is not None or not format_date:
            return super()._get_result_meta(result, state, traceback, request, format_date, encode)
        return {**result_meta(self, state), "result": result, "traceback": traceback}

    def _store_result(self, task_id: str, result: Any, state: str, traceback: str | None = None,
                      request: Context | None = None, **kwargs: Any) -> Any:
        meta = self._get_result_meta(result=result, state=state, traceback=traceback, request=request)
        meta["task_id"] = bytes_to_str(task_id)
        value = self.encode(meta)
        if isinstance(value, str) and len(value) > self._MAX_STR_VALUE_SIZE:
            raise BackendStoreError("value too large for Redis backend", state=state, task_id=task_id)
        expires = self.failure_expires if state == states.FAILURE else self.expires
        item = (self.get_key_for_task(task_id), value, int(expires or 0))
        self.ensure(self._stores.call, (item,))
        return result

    def _store_many(self, items: list[tuple[str, bytes, int]]) -> list[None]:
        if self._store_script is None:
            self._store_script = self.client.register_script(_STORE)
        self._store_script(keys=[key for key, _, _ in items], args=[arg for _, value, expires in items
                                                                     for arg in (value, expires)])
        return [None] * len(items)


class _SnapshotWeakSet(weakref.WeakSet):
    """A WeakSet iterated over a copy taken in one step (`set.copy()` runs no Python code once it reads), so neither
    a garbage collection nor another thread can change the set under the iterator."""

    def __iter__(self) -> Iterator[Any]:
        for ref in self.data.copy():
            item = ref()
            if item is not None:
                yield item


def snapshot_request_sets() -> None:
    """Make Celery's reserved, active and scheduled request sets (`celery.worker.state`) safe to iterate while other
    threads change them. They keep their identity (Celery holds their bound `add` and `discard`)."""
    for requests in (state.reserved_requests, state.active_requests, state.scheduled_requests):
        requests.__class__ = _SnapshotWeakSet


class GuardedConsumer(Consumer):
    """Replaces Celery's consumer (`worker_consumer`): `protocol_problem` and `ALLOWED_TASKS` checked before a task
    strategy (a body not protocol 2 stops Celery's), refusals answered (`answer_refusal`) and logged without the body
    Celery's handlers quote (prompt text), request sets safe to iterate (`snapshot_request_sets`)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        snapshot_request_sets()
        super().__init__(*args, **kwargs)

    def create_task_handler(self, *args: Any, **kwargs: Any) -> Callable[[Message], None]:
        handle = super().create_task_handler(*args, **kwargs)

        def on_task_received(message: Message) -> None:
            problem = protocol_problem(message)
            if problem is not None:
                return self.on_invalid_task(None, message, InvalidTaskError(problem))
            name = message.headers["task"]
            if name not in ALLOWED_TASKS:
                return self.on_unknown_task(None, message, NotRegistered(name))
            return handle(message)

        return on_task_received

    def on_invalid_task(self, body: Any, message: Message, exc: Exception) -> None:
        log.error("discarded an invalid task message %s: %s", describe(message), exc)
        message.reject_log_error(log, self.connection_errors)
        answer_refusal(self.app, message, str(exc))
        signals.task_rejected.send(sender=self, message=message, exc=exc)

    def on_decode_error(self, message: Message, exc: Exception) -> None:
        log.error("discarded a task message whose body cannot be decoded %s: %s", describe(message), type(exc).__name__)
        message.ack()
        answer_refusal(self.app, message, f"its body cannot be decoded ({type(exc).__name__}, content type "
                                          f"{message.content_type!r}; only JSON is accepted)")

    def on_unknown_message(self, body: Any, message: Message) -> None:
        log.warning("discarded a message that is not a Celery task %s", describe(message))
        message.reject_log_error(log, self.connection_errors)
        answer_refusal(self.app, message, "not a Celery task message")
        signals.task_rejected.send(sender=self, message=message, exc=None)

    def on_unknown_task(self, body: Any, message: Message, exc: Exception) -> None:
        """As Celery does (reject, mark the task failed with NotRegistered), minus the body in the log."""
        headers = message.headers if isinstance(message.headers, dict) else {}
        task_id, name = headers.get("id"), headers.get("task")
        log.error("discarded a message for a task this worker does not run %s", describe(message))
        message.reject_log_error(log, self.connection_errors)
        if result_id(message) is not None and name:
            self.app.backend.mark_as_failure(task_id, NotRegistered(name), request=failure_request(message))
        else:
            answer_refusal(self.app, message, f"task {name!r} is not run by tokenmill workers")
        signals.task_unknown.send(sender=self, message=message, exc=exc, name=name, id=task_id)


class LeaseRenewal(bootsteps.StartStopStep):
    """A step added to Celery's consumer, after its Tasks step: `leases.renew` on the consumer's timer, in the thread
    that owns the broker channel, while the consumer runs."""

    requires = ("celery.worker.consumer.tasks:Tasks",)

    def __init__(self, parent: Consumer, **kwargs: Any) -> None:
        super().__init__(parent, **kwargs)
        self._timer_entry = None

    def start(self, parent: Consumer) -> None:
        options = parent.app.conf.broker_transport_options or {}
        # 1/8: a worker whose loop stalls for up to 7/8 of the timeout keeps its jobs
        interval = max(0.1, float(options.get("visibility_timeout", 3600)) / 8)
        self._timer_entry = parent.timer.call_repeatedly(interval, renew, (parent,), priority=0)

    def stop(self, parent: Consumer) -> None:
        if self._timer_entry is not None:
            self._timer_entry.cancel()
            self._timer_entry = None

    shutdown = stop


class IntakeDrain(bootsteps.StartStopStep):
    """A step added to Celery's consumer, after its Tasks step: as it stops, the intake's jobs are waited for
    (`runtime.stop_intake`) before the broker connection closes, as Celery waits for its pool's."""

    requires = ("celery.worker.consumer.tasks:Tasks",)

    def stop(self, parent: Consumer) -> None:
        from tokenmill.worker import runtime  # the process's service: loaded in a worker only

        runtime.stop_intake(closing=parent.blueprint.state == bootsteps.CLOSE)

    shutdown = stop


def strategy(task: Task, app: Celery, consumer: Consumer, **options: Any) -> Callable[..., None]:
    """The `Strategy` of `tokenmill.generate`: Celery's default one, with its requests handed to the process's
    intake (`Intake.offer`) instead of the pool."""
    from tokenmill.worker import runtime  # the process's service: loaded in a worker only

    intake = runtime.intake()
    intake.attach(consumer.on_task_request, getattr(consumer, "hub", None))
    # fixed once the app's `timezone` (a cached property) is read; Celery's handler asks it per message
    uses_utc = app.uses_utc_timezone()
    app.uses_utc_timezone = lambda: uses_utc
    # no dispatcher while task events are off, so no event is built to be dropped; `enable_events` and
    # `disable_events` rebuild the strategies (`tokenmill.worker.control`)
    dispatcher = consumer.event_dispatcher
    return default(task, app, _Routed(consumer, intake.offer, dispatcher if sends_task_events(dispatcher) else None),
                   **options)


class _Routed:
    """A proxy of Celery's consumer for Celery's default strategy, replacing the two attributes it reads there: where
    a request goes (the intake) and the event dispatcher it sends to (none while task events are off)."""

    def __init__(self, consumer: Consumer, on_task_request: Callable[[Request], None],
                 event_dispatcher: EventDispatcher | None) -> None:
        self._consumer = consumer
        self.on_task_request = on_task_request
        self.event_dispatcher = event_dispatcher

    def __getattr__(self, name: str) -> Any:
        return getattr(self._consumer, name)
