"""File and batch records in Redis: what a restarted server (or a second one) needs to go on.

Keys (the API's own, beside the queue's):

* `tokenmill:api:file:<id>`: a file's `FileObject` JSON plus its tenant (and an upload's `usage`: its jobs and
  prompt bytes, `quotas.input_usage`); `tokenmill:api:files:<tenant>`: a sorted set of the tenant's file ids, scored
  by creation order (cursor pagination); `tokenmill:api:stored:<tenant>`: a hash, the tenant's stored `files` and
  `bytes`, changed with the file records (`add_file`, `delete_file`);
* `tokenmill:api:batch:<id>`: a hash: `object` (the `Batch` JSON), `tenant`, `published` (jobs queued so
  far), `cancel` (`cancel` or `expire` once asked), `jobs` and `prompt_bytes` (its input file's `usage`);
  `tokenmill:api:batches:<tenant>`: the tenant's batches;
* `tokenmill:api:active`: the batches not final yet, which some server process must drive;
* `tokenmill:api:lease:<id>`: which server process drives that batch (a token, expiring unless renewed);
* `tokenmill:api:refused:<id>`: jobs of the batch the client refused to queue, with the reason;
* `tokenmill:api:expiring`: every file, and every batch once final, scored by when it expires (`due`): the
  supervisors delete it then, with its index entry and a file's stored bytes, so that nothing stays for ever;
* `tokenmill:api:webhooks`: the webhook outbox, event ids scored by when they are due; `tokenmill:api:webhook-events`
  their bodies, `tokenmill:api:webhook-attempts` their failed deliveries (`webhooks`).

Every change of a batch object goes through `update` (WATCH/MULTI), so the driver's counts and a cancel
from another process never overwrite each other.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

import redis
from redis.backoff import ExponentialBackoff
from redis.retry import Retry

from tokenmill.queue.app import socket_options
from tokenmill.queue.tls import redis_client

PREFIX = "tokenmill:api:"
SEQUENCE = PREFIX + "seq"
ACTIVE = PREFIX + "active"
FINAL = ("completed", "failed", "cancelled", "expired")
EXPIRING = PREFIX + "expiring"
#: The batch hash's field of `output_expires_after.seconds`, when the batch was created with one.
OUTPUT_EXPIRES_FIELD = "output_expires"
OUTBOX = PREFIX + "webhooks"
EVENTS = PREFIX + "webhook-events"
ATTEMPTS = PREFIX + "webhook-attempts"

_RENEW = "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('PEXPIRE', KEYS[1], ARGV[2]) end return 0"
_RELEASE = "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end return 0"


def file_key(file_id: str) -> str:
    return f"{PREFIX}file:{file_id}"


def batch_key(batch_id: str) -> str:
    return f"{PREFIX}batch:{batch_id}"


def lease_key(batch_id: str) -> str:
    return f"{PREFIX}lease:{batch_id}"


def refused_key(batch_id: str) -> str:
    return f"{PREFIX}refused:{batch_id}"


def stored_key(tenant: str) -> str:
    return f"{PREFIX}stored:{tenant}"


def _index(kind: str, tenant: str) -> str:
    return f"{PREFIX}{kind}:{tenant}"


class Records:
    """The API's records on one Redis (the queue's result backend)."""

    def __init__(self, url: str, webhooks: bool = False, batch_expires: int = 30 * 86400,
                 socket_timeout: float = 30.0, max_connections: int | None = None) -> None:
        # TLS verified as on every tokenmill connection (`tokenmill.queue.tls`). Every call has a bound
        # (`socket_timeout`, the settings' `redis_socket_timeout`): a call on a connection whose peer went silent is
        # retried once on a new connection and then raises, so no request thread, supervisor, driver or webhook thread
        # waits on it for good. With `max_connections` (the server's: `resources`), at most that many connections, a
        # call finding all taken waiting for one (`socket_timeout` at most) instead of failing.
        self.redis = redis_client(
            url, max_connections=max_connections, pool_timeout=socket_timeout,
            retry=Retry(ExponentialBackoff(cap=1.0, base=0.05), retries=1),
            retry_on_error=[redis.ConnectionError, redis.TimeoutError],
            **socket_options(socket_timeout),
        )
        self.webhooks = webhooks  # write a webhook event when a batch becomes final
        self.batch_expires = batch_expires  # seconds a final batch's record is kept
        self._renew = self.redis.register_script(_RENEW)
        self._release = self.redis.register_script(_RELEASE)

    # -- files ----------------------------------------------------------------------------------

    def add_file(self, tenant: str, file: dict[str, Any], usage: dict[str, int] | None = None) -> None:
        """The file's record (with an upload's `usage`), counted in its tenant's stored files and bytes once, however
        often it is added."""
        order, key = self.redis.incr(SEQUENCE), file_key(file["id"])
        record = json.dumps({"tenant": tenant, "object": file, "counted": True, **({"usage": usage} if usage else {})})

        def attempt(pipe: Any) -> None:
            new = not pipe.exists(key)
            pipe.multi()
            pipe.set(key, record).zadd(_index("files", tenant), {file["id"]: order}).zadd(
                EXPIRING, {_expiring("file", file["id"], tenant): file["expires_at"]})
            if new:
                pipe.hincrby(stored_key(tenant), "files", 1).hincrby(stored_key(tenant), "bytes", file["bytes"])

        self.redis.transaction(attempt, key)

    def file(self, tenant: str, file_id: str) -> dict[str, Any] | None:
        """The tenant's file; None for an unknown id or another tenant's."""
        raw = self.redis.get(file_key(file_id))
        record = json.loads(raw) if raw else None
        return record["object"] if record and record["tenant"] == tenant else None

    def delete_file(self, tenant: str, file_id: str) -> None:
        """The file's record gone, and off its tenant's stored files and bytes (once, whoever else deletes it)."""
        key = file_key(file_id)

        def attempt(pipe: Any) -> None:
            raw = pipe.get(key)
            record = json.loads(raw) if raw else {}
            pipe.multi()
            pipe.delete(key).zrem(_index("files", tenant), file_id).zrem(EXPIRING, _expiring("file", file_id, tenant))
            if record.get("counted"):  # a record written before the totals were kept was never counted
                pipe.hincrby(stored_key(tenant), "files", -1).hincrby(stored_key(tenant), "bytes",
                                                                      -record["object"]["bytes"])

        self.redis.transaction(attempt, key)

    def stored(self, tenant: str) -> dict[str, int]:
        """The tenant's stored `files` and `bytes`."""
        files, size = self.redis.hmget(stored_key(tenant), ["files", "bytes"])
        return {"files": int(files or 0), "bytes": int(size or 0)}

    def input_usage(self, file_id: str) -> dict[str, int]:
        """An uploaded file's `jobs` and `prompt_bytes` (none for a file uploaded before they were counted)."""
        raw = self.redis.get(file_key(file_id))
        return (json.loads(raw) if raw else {}).get("usage") or {"jobs": 0, "prompt_bytes": 0}

    def files(self, tenant: str, after: str | None, limit: int, newest_first: bool = True,
              purpose: str | None = None) -> tuple[list[dict], bool]:
        """Up to `limit` of the tenant's files after the cursor, of `purpose` if given, and whether more follow.
        The filter comes before paging: the index is read on, a slice at a time, until the page is full."""
        index, found, cursor = _index("files", tenant), [], after
        while len(found) <= limit:
            ids, more = self._page(index, cursor, max(limit + 1 - len(found), 100 if purpose else 1), newest_first)
            if not ids:
                break
            objects = [json.loads(raw)["object"] for raw in self.redis.mget([file_key(i) for i in ids]) if raw]
            found += [f for f in objects if purpose is None or f["purpose"] == purpose]
            if not more:
                break
            cursor = ids[-1]
        return found[:limit], len(found) > limit

    # -- batches --------------------------------------------------------------------------------

    def add_batch(self, tenant: str, batch: dict[str, Any], usage: dict[str, int] | None = None) -> None:
        """The batch's record, with its input file's `usage` (`queued` adds it up)."""
        order = self.redis.incr(SEQUENCE)
        self.redis.pipeline().hset(batch_key(batch["id"]), mapping={
            "object": json.dumps(batch), "tenant": tenant, "published": 0, **(usage or {})}).zadd(
            _index("batches", tenant), {batch["id"]: order}).sadd(ACTIVE, batch["id"]).execute()

    def batch(self, batch_id: str, tenant: str | None = None) -> dict[str, Any] | None:
        """The batch object (None if unknown, or not `tenant`'s when one is given)."""
        raw, owner = self.redis.hmget(batch_key(batch_id), ["object", "tenant"])
        if raw is None or (tenant is not None and owner.decode() != tenant):
            return None
        return json.loads(raw)

    def batch_count(self, tenant: str) -> int:
        """The tenant's batch records kept, final ones included (until `forget_batch`)."""
        return int(self.redis.zcard(_index("batches", tenant)))

    def tenant_of(self, batch_id: str) -> str:
        return self.redis.hget(batch_key(batch_id), "tenant").decode()

    def batches(self, tenant: str, after: str | None, limit: int) -> tuple[list[dict], bool]:
        ids, more = self._page(_index("batches", tenant), after, limit, True)
        pipe = self.redis.pipeline()
        for batch_id in ids:
            pipe.hget(batch_key(batch_id), "object")
        return [json.loads(raw) for raw in pipe.execute() if raw], more

    def update(self, batch_id: str, change: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
        """Apply `change` to the batch object atomically (retried if another process changed it meanwhile);
        a batch that became final is removed from the active set. Returns the new object."""
        key = batch_key(batch_id)

        def attempt(pipe: Any) -> dict[str, Any]:
            batch = json.loads(pipe.hget(key, "object"))
            tenant = pipe.hget(key, "tenant").decode()
            was_final = batch["status"] in FINAL
            change(batch)
            pipe.multi()
            pipe.hset(key, "object", json.dumps(batch))
            if batch["status"] in FINAL:
                pipe.srem(ACTIVE, batch_id)
                if not was_final:
                    pipe.zadd(EXPIRING, {_expiring("batch", batch_id, tenant): now() + self.batch_expires})
                if self.webhooks and not was_final:
                    enqueue_event(pipe, batch)
            return batch

        return self.redis.transaction(attempt, key, value_from_callable=True)

    def field(self, batch_id: str, name: str) -> str | None:
        value = self.redis.hget(batch_key(batch_id), name)
        return value.decode() if value is not None else None

    def set_field(self, batch_id: str, name: str, value: Any) -> None:
        self.redis.hset(batch_key(batch_id), name, value)

    def due(self, at: float, limit: int = 100) -> list[tuple[str, str, str]]:
        """Up to `limit` (kind, id, tenant) whose time has come, each claimed for this caller alone (ZREM): two servers
        never both delete one."""
        found = []
        for member in self.redis.zrangebyscore(EXPIRING, "-inf", at, start=0, num=limit):
            if self.redis.zrem(EXPIRING, member):
                entry = json.loads(member)
                found.append((entry["kind"], entry["id"], entry["tenant"]))
        return found

    def expire_later(self, kind: str, id: str, tenant: str, seconds: float) -> None:
        self.redis.zadd(EXPIRING, {_expiring(kind, id, tenant): time.time() + seconds})

    def active_inputs(self) -> set[str]:
        """The input files of the batches not final yet."""
        pipe = self.redis.pipeline(transaction=False)
        for batch_id in self.active():
            pipe.hget(batch_key(batch_id), "object")
        return {json.loads(raw)["input_file_id"] for raw in pipe.execute() if raw}

    def forget_batch(self, tenant: str, batch_id: str) -> None:
        """A final batch's record, index entry and refusals, gone (its files expire on their own)."""
        self.redis.pipeline().delete(batch_key(batch_id), refused_key(batch_id)).zrem(
            _index("batches", tenant), batch_id).execute()

    def queued(self, batch_ids: list[str]) -> dict[str, int]:
        """The `jobs` and `prompt_bytes` of these batches added up."""
        pipe = self.redis.pipeline(transaction=False)
        for batch_id in batch_ids:
            pipe.hmget(batch_key(batch_id), ["jobs", "prompt_bytes"])
        rows = pipe.execute()
        return {"jobs": sum(int(jobs or 0) for jobs, _ in rows), "prompt_bytes": sum(int(b or 0) for _, b in rows)}

    def active(self) -> list[str]:
        return sorted(member.decode() for member in self.redis.smembers(ACTIVE))

    def active_by_tenant(self) -> dict[str, list[str]]:
        """The active batches of each tenant, oldest first (by their place in the tenant's index)."""
        ids = self.active()
        pipe = self.redis.pipeline(transaction=False)
        for batch_id in ids:
            pipe.hget(batch_key(batch_id), "tenant")
        owned = [(batch_id, tenant.decode()) for batch_id, tenant in zip(ids, pipe.execute()) if tenant is not None]
        for batch_id, tenant in owned:
            pipe.zscore(_index("batches", tenant), batch_id)
        found: dict[str, list[tuple[float, str]]] = {}
        for (batch_id, tenant), order in zip(owned, pipe.execute()):
            found.setdefault(tenant, []).append((order or 0.0, batch_id))
        return {tenant: [batch_id for _, batch_id in sorted(batches)] for tenant, batches in found.items()}

    # -- leases ---------------------------------------------------------------------------------

    def take_lease(self, batch_id: str, token: str, seconds: float) -> bool:
        return bool(self.redis.set(lease_key(batch_id), token, nx=True, px=int(seconds * 1000)))

    def renew_lease(self, batch_id: str, token: str, seconds: float) -> bool:
        return bool(self._renew(keys=[lease_key(batch_id)], args=[token, int(seconds * 1000)]))

    def release_lease(self, batch_id: str, token: str) -> None:
        self._release(keys=[lease_key(batch_id)], args=[token])

    # -- pagination -----------------------------------------------------------------------------

    def _page(self, index: str, after: str | None, limit: int, newest_first: bool) -> tuple[list[str], bool]:
        """Up to `limit` ids after the cursor `after` (an id of this index), and whether more follow."""
        if after is None:
            bound = "+inf" if newest_first else "-inf"
        else:
            score = self.redis.zscore(index, after)
            if score is None:
                return [], False
            bound = f"({score}"
        if newest_first:
            ids = self.redis.zrevrangebyscore(index, bound, "-inf", start=0, num=limit + 1)
        else:
            ids = self.redis.zrangebyscore(index, bound, "+inf", start=0, num=limit + 1)
        return [i.decode() for i in ids[:limit]], len(ids) > limit


def _expiring(kind: str, id: str, tenant: str) -> str:
    return json.dumps({"kind": kind, "id": id, "tenant": tenant}, sort_keys=True)


def enqueue_event(pipe: Any, batch: dict[str, Any]) -> None:
    """Put the `batch.<status>` event of a batch that just became final into the webhook outbox, due now (in the
    caller's MULTI, so the event exists exactly when the final status does). Its body is OpenAI's: the batch id
    in `data`."""
    event_id = f"evt_{batch['id'].removeprefix('batch_')}_{batch['status']}"
    body = {"object": "event", "id": event_id, "type": f"batch.{batch['status']}", "created_at": now(),
            "data": {"id": batch["id"]}}
    pipe.hset(EVENTS, event_id, json.dumps(body))
    pipe.zadd(OUTBOX, {event_id: time.time()})


def now() -> int:
    return int(time.time())
