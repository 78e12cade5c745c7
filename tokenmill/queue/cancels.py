"""Cancelling jobs: a durable mark in Redis that every worker honours, and the result a cancelled job ends with.

`cancel` is one script call for any number of jobs. Per job, atomically:

* a job with a final result (succeeded, failed, cancelled, or REVOKED by Celery) is left as it is: "finished";
* otherwise the mark `tokenmill:cancel:<id>` is set for as long as results are kept, so a worker that takes
  the job later (started afterwards, a redelivery after a crash, a group message) never runs it;
* a job no worker has started (it has no delivery count) gets its final result at once, `cancelled`:
  "cancelled";
* a started one is announced on `tokenmill:cancels`; the worker running it stops it in the engine at the
  next step and stores its result, `cancelled` with the text generated so far: "cancelling". (A job whose
  worker died stores it when it is delivered again.)

A worker's check-in reads the result and the mark in the same script call that counts the delivery, so a
cancel is either seen by the check-in or finds the delivery counted, never neither. A cancelled result is
stored under Celery's own state REVOKED: Flower and `celery inspect` show it as revoked, `AsyncResult.get()`
raises `TaskRevokedError`, and `Client` reads the `JobResult` with its partial text from it. Torch-free.
"""

from __future__ import annotations

import base64

import json
from collections.abc import Iterable
from datetime import datetime
from typing import Any, Literal

from tokenmill.queue import fastjson
from tokenmill.queue.names import CANCEL_CHANNEL, CANCEL_KEY, DELIVERIES_KEY, SHARE_LIST, SHARES_KEY
from tokenmill.queue.schemas import JobResult

#: Celery states after which a job never runs again (REVOKED: a cancelled job, ours or Celery's own revoke).
FINAL_STATES = ("SUCCESS", "FAILURE", "REVOKED")
CANCELLED_STATE = "REVOKED"

Outcome = Literal["cancelled", "cancelling", "finished"]
_CHUNK = 1000  # jobs per script call: Redis runs a script alone, so none may take long

# KEYS: per job its result key, cancel key and delivery-count key; ARGV[1]: expiry (s), ARGV[2]: the channel,
# ARGV[2 + i]: job i's id, ARGV[2 + n + i]: job i's encoded cancelled result (stored if it never started).
_CANCEL = """
local n = #KEYS / 3
local outcomes = {}
for i = 1, n do
  local result, mark, deliveries = KEYS[3 * i - 2], KEYS[3 * i - 1], KEYS[3 * i]
  local stored = redis.call('GET', result)
  local final = false
  if stored then
    local ok, meta = pcall(cjson.decode, stored)
    final = ok and type(meta) == 'table' and (FINAL_STATES)
  end
  if final then
    outcomes[i] = 'finished'
  else
    redis.call('SET', mark, '1', 'EX', ARGV[1])
    if redis.call('EXISTS', deliveries) == 0 then
      redis.call('SET', result, ARGV[2 + n + i], 'EX', ARGV[1])
      redis.call('PUBLISH', result, ARGV[2 + n + i])
      outcomes[i] = 'cancelled'
    else
      redis.call('PUBLISH', ARGV[2], ARGV[2 + i])
      outcomes[i] = 'cancelling'
    end
  end
end
return outcomes
"""
# the states `is_final` takes as final, spelled once
_CANCEL = _CANCEL.replace("FINAL_STATES", " or ".join(f"meta.status == '{state}'" for state in FINAL_STATES))


def is_final(stored: bytes | None) -> bool:
    """Whether a stored Celery result (JSON, `result_serializer="json"`) is a final state."""
    return stored is not None and json.loads(stored).get("status") in FINAL_STATES


def revoked_result(wire: dict[str, Any]) -> dict[str, Any]:
    """A cancelled `JobResult` as the result of a REVOKED Celery task: the job's fields, plus the exception
    fields Celery turns back into `TaskRevokedError` for plain Celery callers (`JobResult` ignores them)."""
    return {**wire, "exc_type": "TaskRevokedError", "exc_module": "celery.exceptions",
            "exc_message": [wire.get("error", {}).get("message") or "cancelled"]}


#: The fields of a result's wire form that may hold any JSON value or float (see `fastjson.dumps`).
_FREE_FORM = ("metadata", "logprobs", "parsed", "queued_at", "started_at", "first_token_at", "finished_at")


def result_meta(backend: Any, state: str) -> dict[str, Any]:
    """Celery's meta for a result in `state` stored without a task request, as every job's is (`result` still None):
    what `Backend._get_result_meta` gives then, built here because Celery's looks the `result_extended` setting up
    and converts the time twice, once per finished job or group of jobs finished together."""
    date_done = datetime.now(backend.app.timezone).isoformat() if state in backend.READY_STATES else None  # app.now()
    return {"status": state, "result": None, "traceback": None, "children": backend.current_task_children(None),
            "date_done": date_done}


def encode_result(backend: Any, wire: dict[str, Any], meta: dict[str, Any] | None = None) -> bytes:
    """A job's final result as Celery's result backend stores it: SUCCESS, or REVOKED for a cancelled job.
    `meta`: Celery's meta fields for the state (built once for many results; looked up when None). Celery's JSON,
    written by orjson where that writes the same (`fastjson`)."""
    cancelled = wire.get("status") == "cancelled"
    state = CANCELLED_STATE if cancelled else "SUCCESS"
    meta = meta or result_meta(backend, state)
    result = revoked_result(wire) if cancelled else wire
    meta = {**meta, "status": state, "result": result, "task_id": wire["id"]}
    if backend.serializer != "json":
        return backend.encode(meta)
    return fastjson.dumps(meta, *map(result.get, _FREE_FORM))


def cancel(backend: Any, job_ids: Iterable[str], expires: int) -> dict[str, Outcome]:
    """Cancel these jobs (see the module docstring); the outcome per job id. `backend`: a Celery Redis backend."""
    ids = list(dict.fromkeys(job_ids))
    script = backend.client.register_script(_CANCEL)
    found: dict[str, Outcome] = {}
    for start in range(0, len(ids), _CHUNK):  # a whole run's jobs in bounded script calls
        chunk = ids[start : start + _CHUNK]
        keys = []
        for job_id in chunk:
            keys += [backend.get_key_for_task(job_id), CANCEL_KEY.format(job_id=job_id),
                     DELIVERIES_KEY.format(job_id=job_id)]
        unstarted = [encode_result(backend, JobResult.cancelled(job_id, "cancelled before it started").to_wire())
                     for job_id in chunk]
        outcomes = script(keys=keys, args=[int(expires), CANCEL_CHANNEL, *chunk, *unstarted])
        found.update((job_id, outcome.decode()) for job_id, outcome in zip(chunk, outcomes))
    return found


#: Messages of each queue `unknown` reads at most: past it, it cannot tell a queued job from no job.
SCAN_LIMIT = 200_000


def unknown(backend: Any, broker: Any, job_ids: Iterable[str], queues: Iterable[str],
            scan_limit: int = SCAN_LIMIT) -> list[str] | None:
    """Of `job_ids`, those no job is known by: no result, never delivered, and on none of `queues` nor their fair
    shares' lists (a single job's message names it in its headers, a group's in its body). None when a list holds
    more than `scan_limit` messages, so its tail was not read. A job taken by a worker this instant and not yet
    recorded counts as unknown: the window is one Redis round trip. `backend`: a Celery Redis backend; `broker`: the
    broker's client."""
    ids = list(dict.fromkeys(job_ids))
    with backend.client.pipeline(transaction=False) as pipe:
        for job_id in ids:
            pipe.exists(backend.get_key_for_task(job_id), DELIVERIES_KEY.format(job_id=job_id))
        candidates = [job_id for job_id, known in zip(ids, pipe.execute()) if not known]
    queues = list(queues)
    shares = [(queue, share) for queue in queues for share in broker.smembers(SHARES_KEY.format(queue=queue))]
    lists = queues + [SHARE_LIST.format(queue=queue, share=share.decode() if isinstance(share, bytes) else share)
                      for queue, share in shares]
    for listed in lists:
        if not candidates:
            break
        if broker.llen(listed) > scan_limit:
            return None
        for start in range(0, scan_limit, _CHUNK):
            items = broker.lrange(listed, start, start + _CHUNK - 1)
            texts = [_searchable(item) for item in items]
            candidates = [job_id for job_id in candidates if not any(f'"{job_id}"'.encode() in t for t in texts)]
            if len(items) < _CHUNK or not candidates:
                break
    return candidates


def _searchable(item: bytes) -> bytes:
    """A queued kombu envelope with its body decoded: a single job's id is in its headers, a group's jobs' ids in its
    body (job ids are plain ASCII, so a quoted id found here is that id)."""
    try:
        envelope = json.loads(item)
        body = envelope["body"]
        decoded = base64.b64decode(body) if envelope["properties"]["body_encoding"] == "base64" else body.encode()
    except (ValueError, KeyError, TypeError, AttributeError):
        return item
    return item + b"\n" + decoded
