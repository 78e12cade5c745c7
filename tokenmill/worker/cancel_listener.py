"""Hears cancels of the jobs this worker runs and stops them in the engine.

Listens on `CANCEL_CHANNEL`, and every `SWEEP_INTERVAL` reads the cancel marks of the jobs running here, so a cancel
announced while unsubscribed still stops its job, at most that much later. Torch-free.
See docs/internals/worker.md, section "Cancels, leases and control".
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import redis

from tokenmill.queue.names import CANCEL_CHANNEL, CANCEL_KEY

log = logging.getLogger("tokenmill.worker")

SWEEP_INTERVAL = 1.0  # seconds
_RECONNECT_DELAY = 0.5


class CancelListener:
    """Calls `on_cancel(job_id)` for every cancel of a job in `running()`, from its own daemon thread."""

    def __init__(self, client: redis.Redis, running: Callable[[], list[str]], on_cancel: Callable[[str], None]) -> None:
        self.client = client
        self.running = running
        self.on_cancel = on_cancel
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tokenmill-cancels", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._listen()
            except (redis.RedisError, OSError) as exc:
                log.warning("cancel listener lost Redis (%s); reconnecting", type(exc).__name__)
                self._stop.wait(_RECONNECT_DELAY)

    def _listen(self) -> None:
        pubsub = self.client.pubsub(ignore_subscribe_messages=True)
        try:
            pubsub.subscribe(CANCEL_CHANNEL)
            next_sweep = 0.0
            while not self._stop.is_set():
                if time.monotonic() >= next_sweep:
                    self._sweep()
                    next_sweep = time.monotonic() + SWEEP_INTERVAL
                message = pubsub.get_message(timeout=max(0.0, next_sweep - time.monotonic()))
                if message is not None and message.get("type") == "message":
                    self.on_cancel(message["data"].decode(errors="replace"))
        finally:
            pubsub.close()

    def _sweep(self) -> None:
        """The marks of the jobs running here: catches what pub/sub did not deliver."""
        job_ids = self.running()
        if not job_ids:
            return
        marks = self.client.mget([CANCEL_KEY.format(job_id=job_id) for job_id in job_ids])
        for job_id, mark in zip(job_ids, marks):
            if mark is not None:
                self.on_cancel(job_id)
