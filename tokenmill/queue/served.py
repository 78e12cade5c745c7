"""Which models the workers serve: each worker announces its model and queues in Redis, renewed while it runs.

One hash, `tokenmill:served`: field = the worker's node name, value = JSON `{"model", "queues", "until"}`.
A worker renews its entry every `ttl / 3` seconds and removes it when it stops; a killed worker's entry is
ignored (and dropped) once `until` passes. `until` is Redis's own clock (`TIME`, inside the scripts), never a
host's: a worker whose clock runs behind the API's must not look dead. Readers (`tokenmill serve`: `GET
/v1/models`, and the check that a batch line names a model some worker serves) make one script call, however
many jobs Redis holds, and drop stale entries in the same script, so a renewal landing between a read and a
delete is never lost. Torch-free.
"""

from __future__ import annotations

import json
import logging
import threading
from typing import Any

SERVED_KEY = "tokenmill:served"
DEFAULT_TTL = 15.0

log = logging.getLogger(__name__)

_NOW = "local t = redis.call('TIME') local now = tonumber(t[1]) + tonumber(t[2]) / 1e6 "
_ANNOUNCE = _NOW + """
local entry = cjson.decode(ARGV[2])
entry['until'] = now + tonumber(ARGV[3])
redis.call('HSET', KEYS[1], ARGV[1], cjson.encode(entry))
"""
_LIVE = _NOW + """
local all, live = redis.call('HGETALL', KEYS[1]), {}
for i = 1, #all, 2 do
  if cjson.decode(all[i + 1])['until'] < now then redis.call('HDEL', KEYS[1], all[i])
  else live[#live + 1] = all[i]; live[#live + 1] = all[i + 1] end
end
return live
"""


def announce(redis: Any, worker: str, model: str, queues: list[str], ttl: float = DEFAULT_TTL) -> None:
    redis.eval(_ANNOUNCE, 1, SERVED_KEY, worker, json.dumps({"model": model, "queues": queues}), ttl)


def withdraw(redis: Any, worker: str) -> None:
    redis.hdel(SERVED_KEY, worker)


def served_models(redis: Any, queue: str) -> dict[str, list[str]]:
    """model id -> the live workers serving it on `queue` (stale entries are dropped on the way)."""
    flat = redis.eval(_LIVE, 1, SERVED_KEY)
    models: dict[str, list[str]] = {}
    for worker, raw in zip(flat[::2], flat[1::2]):
        entry = json.loads(raw)
        if queue in entry["queues"]:
            models.setdefault(entry["model"], []).append(worker.decode())
    return models


class Announcer(threading.Thread):
    """A worker's announcement, renewed every third of `ttl` until `stop()`; withdrawn by this thread as it ends,
    so no renewal can land after the withdrawal."""

    def __init__(self, redis: Any, worker: str, model: str, queues: list[str], ttl: float = DEFAULT_TTL) -> None:
        super().__init__(name="served-model-announcer", daemon=True)
        self.redis, self.worker, self.model, self.queues, self.ttl = redis, worker, model, queues, ttl
        self._stopping = threading.Event()

    def run(self) -> None:
        while not self._stopping.is_set():
            try:
                announce(self.redis, self.worker, self.model, self.queues, self.ttl)
            except Exception:  # a Redis blip: the next round announces again
                log.warning("could not announce the served model; retrying", exc_info=True)
            self._stopping.wait(self.ttl / 3)
        try:
            withdraw(self.redis, self.worker)
        except Exception:
            log.warning("could not withdraw the served model (it expires on its own)", exc_info=True)

    def stop(self, timeout: float = 5.0) -> None:
        """Withdraw; waits at most `timeout` (with Redis down the withdrawal goes on retrying in the background,
        and the entry expires on its own)."""
        self._stopping.set()
        if self.is_alive():
            self.join(timeout)


def not_served(model: str, served: dict[str, list[str]], queue: str) -> str | None:
    """Why no job of `model` should be queued on `queue` (None: it may be): live workers announce other models only.
    With none live at all, a job waits for one, as any job does."""
    if not served or model in served:
        return None
    return f"the model {model!r} is not served by any worker on queue {queue!r} (served: {', '.join(sorted(served))})"
