"""The engine loop: the one thread that drives the (not thread-safe) engine.

Celery task threads hand requests in through a queue and wait on a future; between two engine steps
the loop admits every request that arrived, so new jobs join the running batch instead of waiting for
it to drain (continuous batching across queue jobs). A request that finishes in a step resolves its
future in that same iteration, so its task can write the result at once.

Torch-free: the engine object is passed in.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Protocol

from tokenmill.engine.sampling_params import SamplingParams

log = logging.getLogger(__name__)


class Engine(Protocol):
    """The subset of `LLMEngine` the loop uses."""

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams) -> None: ...
    def apply_chat_template(self, messages: list[dict[str, str]]) -> list[int]: ...
    def step(self) -> list[Any]: ...
    def has_unfinished(self) -> bool: ...
    def abort_request(self, request_id: str) -> None: ...
    def stats(self) -> Any: ...


@dataclass
class _Submit:
    request_id: str
    prompt: str | list[int] | None
    messages: list[dict[str, str]] | None
    params: SamplingParams
    future: Future = field(default_factory=Future)


@dataclass
class _Abort:
    request_id: str


@dataclass
class LoopStats:
    """What the loop last read from the engine, for the metrics endpoint."""

    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    generated_tokens_per_s: float = 0.0


class EngineLoop:
    """Runs `engine.step()` while there is work; resolves one future per request when it finishes.

    `on_fatal` is called (from the loop thread) if the engine raises anything but a per-request error:
    the engine's state is then unknown, so the worker must not go on using it (the service exits and
    the broker redelivers the unacked jobs to a healthy worker).
    """

    def __init__(
        self,
        engine: Engine,
        on_fatal: Callable[[BaseException], None] | None = None,
        on_stats: Callable[[LoopStats], None] | None = None,
        stats_interval: float = 0.5,
    ) -> None:
        self._engine = engine
        self._on_fatal = on_fatal
        self._on_stats = on_stats
        self._stats_interval = stats_interval
        self._inbox: queue.SimpleQueue[_Submit | _Abort | None] = queue.SimpleQueue()
        self._pending: dict[str, Future] = {}
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tokenmill-engine", daemon=True)
        self._last_stats = (time.monotonic(), 0)

    def start(self) -> None:
        self._thread.start()

    def submit(
        self,
        request_id: str,
        params: SamplingParams,
        prompt: str | list[int] | None = None,
        messages: list[dict[str, str]] | None = None,
    ) -> Future:
        """Queue a request; the future resolves to its `RequestOutput` or to the engine's error for it."""
        if self._stopping.is_set():
            raise RuntimeError("engine loop is stopped")
        item = _Submit(request_id, prompt, messages, params)
        self._inbox.put(item)
        return item.future

    def abort(self, request_id: str) -> None:
        """Drop a request (its future is cancelled), e.g. when its job is requeued at shutdown."""
        self._inbox.put(_Abort(request_id))

    def stop(self, timeout: float | None = None) -> None:
        self._stopping.set()
        self._inbox.put(None)
        self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def _run(self) -> None:
        try:
            while not self._stopping.is_set():
                busy = self._engine.has_unfinished()
                self._admit(block=not busy)
                if self._engine.has_unfinished():
                    self._step()
                self._maybe_report_stats()
        except BaseException as exc:  # the engine is in an unknown state: fail everything, then report
            log.critical("engine loop failed: %r", exc, exc_info=True)
            for future in self._pending.values():
                _set_exception(future, exc)
            self._pending.clear()
            if self._on_fatal is not None:
                self._on_fatal(exc)

    def _admit(self, block: bool) -> None:
        """Take every queued command; wait for one only when the engine has nothing to do."""
        try:
            item = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while item is not None:
            self._handle(item)
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _handle(self, item: _Submit | _Abort) -> None:
        if isinstance(item, _Abort):
            future = self._pending.pop(item.request_id, None)
            if future is not None:
                self._engine.abort_request(item.request_id)
                future.cancel()
            return
        if not item.future.set_running_or_notify_cancel():
            return
        try:
            prompt = item.prompt if item.messages is None else self._engine.apply_chat_template(item.messages)
            self._engine.add_request(item.request_id, prompt, item.params)
        except Exception as exc:  # refused for this request only (InvalidRequestError, template error, ...)
            item.future.set_exception(exc)
            return
        self._pending[item.request_id] = item.future

    def _step(self) -> None:
        for output in self._engine.step():
            future = self._pending.pop(output.request_id, None)
            if future is not None:
                future.set_result(output)

    def _maybe_report_stats(self) -> None:
        now = time.monotonic()
        since, tokens_before = self._last_stats
        if self._on_stats is None or now - since < self._stats_interval:
            return
        stats = self._engine.stats()
        tokens = stats.num_generated_tokens
        self._last_stats = (now, tokens)
        self._on_stats(
            LoopStats(
                num_running=stats.num_running,
                num_waiting=stats.num_waiting,
                kv_cache_usage=stats.kv_cache_usage,
                generated_tokens_per_s=(tokens - tokens_before) / (now - since),
            )
        )


def _set_exception(future: Future, exc: BaseException) -> None:
    if not future.done():
        future.set_exception(exc)
