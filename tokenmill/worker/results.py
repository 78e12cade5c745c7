"""The worker's Celery result backend: Celery's Redis backend, with results of jobs finishing together stored in
one script call. Torch-free.

Celery stores each task's return value with a GET (a stored SUCCESS is never overwritten) and then a
MULTI/SETEX/PUBLISH/EXEC: two round trips per job. Here the same meta, encoded by Celery,
goes to a `Coalescer`: a job finishing while another's store is in flight is stored with the next call, one
script for all of them that does what Celery does per key (keep a stored SUCCESS, else SET with the expiry and
PUBLISH on the key's channel). Keys, values, expiry and the announcement are Celery's, so `AsyncResult`,
`Client`, Flower and `celery inspect` see the same; only the number of round trips changes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from celery import states
from celery.backends.redis import RedisBackend
from celery.exceptions import BackendStoreError
from kombu.utils.encoding import bytes_to_str

from tokenmill.queue.batching import Coalescer
from tokenmill.queue.cancels import result_meta
from tokenmill.queue.packing import PACKER_OPTIONS

if TYPE_CHECKING:
    from celery.app.task import Context
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
    """Celery's `RedisBackend` whose `_store_result` is one shared script call for concurrent stores."""

    #: Results per script call: Redis runs a script alone, so none may take long.
    STORE_LIMIT = 256
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # One instance for all pool threads (else Celery builds one per thread, each with its own connection pool,
        # and no two threads' stores could share a call). redis-py clients are thread-safe; the worker never
        # waits on results through this backend's pub/sub consumer, the one part that is not. Set on the
        # instance: Celery's Backend.__init__ sets it from `result_backend_thread_safe` (False), over the class's.
        self.thread_safe = True
        self.connparams.update(PACKER_OPTIONS)  # its pool's connections pack with hiredis alone
        self._stores: Coalescer[tuple[str, bytes, int], None] = Coalescer(self._store_many, limit=self.STORE_LIMIT)
        self._store_script: Script | None = None
        self._task_key_prefix: bytes = self._get_key_for(self.task_keyprefix, "")

    def get_key_for_task(self, task_id: str | bytes, key: str | bytes = "") -> bytes:
        """Celery's key; a text id is joined to the prefix encoded once (Celery encodes each part anew)."""
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
