"""Which models the workers serve: each worker announces its model and queues in Redis, renewed while it runs.

One hash, `tokenmill:served`: field = the worker's node name, value = JSON `{"model", "queues", "until"}`.
A worker renews its entry every `ttl / 3` seconds and removes it when it stops; a killed worker's entry is
ignored (and dropped) once `until` passes. Readers (`tokenmill serve`: `GET /v1/models`, and the check that a
batch line names a model some worker serves) read the hash: one call, however many jobs Redis holds. Torch-free.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from typing import Any

SERVED_KEY = "tokenmill:served"
DEFAULT_TTL = 15.0

log = logging.getLogger(__name__)


def announce(redis: Any, worker: str, model: str, queues: list[str], ttl: float = DEFAULT_TTL) -> None:
    redis.hset(SERVED_KEY, worker, json.dumps({"model": model, "queues": queues, "until": time.time() + ttl}))


def withdraw(redis: Any, worker: str) -> None:
    redis.hdel(SERVED_KEY, worker)


def served_models(redis: Any, queue: str) -> dict[str, list[str]]:
    """model id -> the live workers serving it on `queue` (stale entries are dropped on the way)."""
    models: dict[str, list[str]] = {}
    stale = []
    for worker, raw in redis.hgetall(SERVED_KEY).items():
        entry = json.loads(raw)
        if entry["until"] < time.time():
            stale.append(worker)
        elif queue in entry["queues"]:
            models.setdefault(entry["model"], []).append(worker.decode())
    if stale:
        redis.hdel(SERVED_KEY, *stale)
    return models


class Announcer(threading.Thread):
    """A worker's announcement, renewed every third of `ttl` until `stop()` withdraws it."""

    def __init__(self, redis: Any, worker: str, model: str, queues: list[str], ttl: float = DEFAULT_TTL) -> None:
        super().__init__(name="served-model-announcer", daemon=True)
        self.args_ = (redis, worker, model, queues, ttl)
        self._stop = threading.Event()

    def run(self) -> None:
        redis, worker, model, queues, ttl = self.args_
        while not self._stop.is_set():
            try:
                announce(redis, worker, model, queues, ttl)
            except Exception:  # a Redis blip: the next round announces again
                log.warning("could not announce the served model; retrying", exc_info=True)
            self._stop.wait(ttl / 3)

    def stop(self) -> None:
        self._stop.set()
        try:
            withdraw(self.args_[0], self.args_[1])
        except Exception:
            log.warning("could not withdraw the served model (it expires on its own)", exc_info=True)
