"""Group commit: many threads' single calls answered by one call for all of them. Torch-free.

A worker runs each job in its own Celery pool thread, and each thread needs Redis (its check-in, its
result, its ack) and the engine process (its request) once per job: several round trips per job, each a cost of
its own (figures: docs/benchmarks/queue.md). With
`Coalescer`, a thread that finds no call in progress makes one for every item waiting (its own included);
threads arriving meanwhile queue their items for the next call and wait. Under load one call serves
dozens of jobs; alone, a thread calls at once, so a single job waits for nobody (no timer, no added
latency). This is the group path's (`tokenmill.generate_batch`) one-call-per-group, for jobs that came
one message each.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any, Generic, TypeVar

import redis
from redis.exceptions import NoScriptError

Item = TypeVar("Item")
Answer = TypeVar("Answer")


class _Slot:
    __slots__ = ("item", "answer", "error", "done", "lead", "wake")

    def __init__(self, item: Any) -> None:
        self.item, self.answer, self.error = item, None, None
        self.done = self.lead = False
        self.wake = threading.Event()


class Coalescer(Generic[Item, Answer]):
    """`call(item)` from any thread; `many(items)` (one answer per item, in order) runs one thread at a time.

    An exception from `many` is raised in every thread whose item was in that call. The thread that makes a
    call makes only that one: it then hands the lead to the oldest waiting thread, so no job's thread is kept
    serving the others while its own job waits.
    """

    def __init__(self, many: Callable[[list[Item]], Sequence[Answer]], limit: int = 1000) -> None:
        self._many = many
        self._limit = limit  # items per call: Redis runs a script alone, so none may take long
        self._waiting: list[_Slot] = []
        self._lock = threading.Lock()
        self._calling = False

    def call(self, item: Item) -> Answer:
        slot = _Slot(item)
        with self._lock:
            self._waiting.append(slot)
            if not self._calling:  # nothing in progress, so nothing was waiting: this thread calls
                self._calling = slot.lead = True
        if not slot.lead:
            slot.wake.wait()
        if not slot.done:  # handed the lead: this slot is the oldest waiting one, so in the next call
            self._call_once()
        if slot.error is not None:
            raise slot.error
        return slot.answer  # type: ignore[return-value]

    def _call_once(self) -> None:
        with self._lock:
            batch, self._waiting = self._waiting[: self._limit], self._waiting[self._limit :]
        try:
            answers = list(self._many([slot.item for slot in batch]))
            if len(answers) != len(batch):
                raise RuntimeError(f"{len(answers)} answers for {len(batch)} items")
        except BaseException as exc:  # noqa: BLE001: each waiting thread gets it
            for slot in batch:
                slot.error = exc
        else:
            for slot, answer in zip(batch, answers):
                slot.answer = answer
        with self._lock:
            for slot in batch:
                slot.done = True
                slot.wake.set()
            if self._waiting:
                following = self._waiting[0]
                following.lead = True
                following.wake.set()
            else:
                self._calling = False


class HeldScript:
    """A Lua script sent on a connection held for it, not taken from the client's pool for each call; a call that finds
    the connection in use by another thread takes redis-py's own path instead.

    Why: through redis-py's client each call takes a connection from the pool (with a readiness poll, a system call),
    records its timing for redis-py's observability hooks, dispatches a release event and returns the connection,
    all under the GIL the finisher's other work waits for (figures: docs/benchmarks/queue.md).

    The connection's retry policy applies as on redis-py's path (`Retry.call_with_retry`, the connection dropped after
    each failed try), and any call that raises drops it too; a Redis that has lost its scripts (restarted) gets this
    one again by EVAL.
    """

    def __init__(self, client: redis.Redis, script: str) -> None:
        self._client = client
        self._pooled = client.register_script(script)  # redis-py's `Script`: its text and SHA1 serve the held calls too
        self._connection: Any = None  # taken from the client's pool at the first call, and kept
        self._lock = threading.Lock()

    def __call__(self, keys: Sequence[Any], args: Sequence[Any]) -> Any:
        if not self._lock.acquire(blocking=False):  # another thread's call is in progress on the connection
            return self._pooled(keys=keys, args=args)
        try:
            return self._call_held(keys, args)
        finally:
            self._lock.release()

    def _call_held(self, keys: Sequence[Any], args: Sequence[Any]) -> Any:
        if self._connection is None:
            self._connection = self._client.connection_pool.get_connection()
        connection = self._connection
        operands = (len(keys), *keys, *args)

        def call() -> Any:
            connection.send_command("EVALSHA", self._pooled.sha, *operands)
            try:
                return connection.read_response()
            except NoScriptError:
                connection.send_command("EVAL", self._pooled.script, *operands)
                return connection.read_response()

        try:
            return connection.retry.call_with_retry(call, lambda _: connection.disconnect())
        except BaseException:  # a reply may be left unread (redis-py's pool checks for one at each checkout; here none
            connection.disconnect()  # is made): the next call starts on a new connection
            raise
