"""The producer-side client: submit jobs, wait for results.

    from tokenmill import Client
    client = Client("redis://localhost:6379/0")
    job = client.submit(prompt="...", max_tokens=64, temperature=0.0)   # returns at once
    job.result(timeout=60)                                             # JobResult, or raises
    handles = client.submit_many(job_dicts)                            # pipelined
    for result in client.as_completed(handles): ...
    vectors = client.embed(["a text", "another"], dimensions=256)     # embedding jobs, waited for
    scores = client.score("The capital of France is", [" Paris", " Rome"])  # log-likelihoods, waited for

Jobs are sent as ordinary Celery task messages (protocol 2, JSON) for `tokenmill.generate`, built by
Celery's own `app.amqp` and kombu's Redis channel (`tokenmill.queue.publisher`); `submit_many` batches their
Redis writes (one pipeline round trip per batch of up to 1000 messages instead of one per message). Every job is
validated here first, so a bad job never reaches the queue: `InvalidRequestError` names the field.

Results are read from Celery's Redis result backend: the client subscribes to the results' pub/sub
channels (Celery publishes each result as it stores it) and also re-reads pending keys every second,
so a missed notification (e.g. across a Redis restart) only delays a result, never loses it.

Torch-free: no engine or worker code is imported.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
import uuid
from collections.abc import Generator, Iterable, Iterator, Mapping
from contextlib import closing
from dataclasses import dataclass, field
from typing import Any

import redis

from tokenmill.errors import InvalidRequestError
from tokenmill.queue import cancels, dead_letters, fastjson
from tokenmill.queue.app import queue_app
from tokenmill.queue.cancels import CANCELLED_STATE, FINAL_STATES, Outcome
from tokenmill.queue.names import CANCEL_KEY, DELIVERIES_KEY, JOB_HASH_HEADER, RUN_JOBS_KEY, TASK_NAME
from tokenmill.queue.publisher import Publisher
from tokenmill.queue.schemas import (ContinuationScore, Job, JobResult, check_size, content_hash, free_form,
                                     message_wire)
from tokenmill.queue.settings import QueueSettings

log = logging.getLogger(__name__)

_PUBLISH_BATCH = 1000
#: Jobs of `submit_many` in its first pipelined write; each later write holds as many as went before, up to
#: `_PUBLISH_BATCH`: workers start on the first jobs while the client still encodes the rest.
_FIRST_PUBLISH = 32
_SWEEP_INTERVAL = 1.0
_LOG_EVERY = 30.0  # seconds between two warnings of a Redis that keeps failing (a wait's, a shared subscription's)
#: Idle pub/sub connections a client keeps for its next waits, and the most channels a wait may have had for its
#: connection to be kept: unsubscribing from more leaves a confirmation per channel for the next wait to read first.
_IDLE_SUBSCRIPTIONS = 4
_REUSED_MAX_CHANNELS = 256


class JobFailedError(RuntimeError):
    """The job finished with an error; `.result` holds the failed `JobResult` (see `.result.error`)."""

    def __init__(self, result: JobResult) -> None:
        error = result.error
        detail = f"{error.code}: {error.message}" if error else "failed"
        if error and error.field:
            detail += f" (field: {error.field})"
        super().__init__(f"job {result.id} failed: {detail}")
        self.result = result


class JobCancelledError(JobFailedError):
    """The job was cancelled; `.result` holds its `JobResult` (`text`: what it generated before it stopped)."""


class JobTimeoutError(TimeoutError):
    """No final result within the timeout; the job may still finish later (`.job_ids` lists the pending ones). The
    message says so when Redis was not answering at the end."""

    def __init__(self, job_ids: list[str], timeout: float, unreachable: BaseException | None = None) -> None:
        shown = ", ".join(job_ids[:5]) + (f" and {len(job_ids) - 5} more" if len(job_ids) > 5 else "")
        cause = "" if unreachable is None else f" (Redis not answering: {type(unreachable).__name__}: {unreachable})"
        super().__init__(f"no result after {timeout:g}s for {len(job_ids)} job(s): {shown}{cause}")
        self.job_ids = job_ids


@dataclass(frozen=True)
class JobHandle:
    """A submitted job. Cheap: an id, the client that can fetch its result, and the job's content hash.

    The hash tells this job's result from that of another job submitted under the same id: such a result
    comes back as a failed `conflict` result (`JobResult.conflict_with`), never as this job's.
    """

    id: str
    client: Client = field(repr=False, compare=False)
    job_hash: str | None = field(default=None, repr=False, compare=False)

    def result(self, timeout: float | None = None) -> JobResult:
        """Wait for the result. Raises `JobFailedError` if the job failed (`JobCancelledError` if it was
        cancelled), `JobTimeoutError` on timeout."""
        result = next(self.client.as_completed([self], timeout=timeout))
        if result.status == "cancelled":
            raise JobCancelledError(result)
        if not result.ok:
            raise JobFailedError(result)
        return result

    def cancel(self) -> Outcome:
        """Cancel this job; see `Client.cancel`."""
        return self.client.cancel(self.id)[self.id]

    def get(self) -> JobResult | None:
        """The result if it is there now (failed or not), else None. Never waits, never raises for failures."""
        result = self.client.get(self.id)
        return None if result is None else result.conflict_with(self.job_hash) or result


class Client:
    """Submits jobs to a tokenmill queue and reads their results."""

    def __init__(
        self,
        broker_url: str | None = None,
        *,
        result_backend: str | None = None,
        queue: str | None = None,
        max_payload_bytes: int | None = None,
        share: str | None = None,
        subscription: SharedSubscription | None = None,
    ) -> None:
        """`max_payload_bytes`: largest encoded job; default `max_job_bytes` of the settings (1 MiB), the
        limit workers apply too. `share`: the fair share this client's jobs wait in (a run, a tenant; 1 to 64 of
        `A-Z a-z 0-9 . _ -`): workers take from each share of the queue in turn, so another share's backlog does
        not hold these jobs behind it (`tokenmill.queue.names.SHARE_HEADER`); None: the queue's own list.
        `subscription`: the result waits' pub/sub connection, shared with other clients (on the same result backend;
        closing this client leaves it open); None: this client's own connections."""
        overrides = {"broker_url": broker_url, "result_backend": result_backend, "queue": queue}
        self.settings = QueueSettings(**{k: v for k, v in overrides.items() if v is not None})
        self.app = queue_app(self.settings)
        self.queue = self.settings.queue
        self.max_payload_bytes = max_payload_bytes or self.settings.max_job_bytes
        self._subscriptions: _Subscriptions | SharedSubscription = subscription or _Subscriptions()
        self._own_subscriptions = subscription is None
        self.publisher = Publisher(self.app, self.queue, share)

    # -- submitting ----------------------------------------------------------------------------

    def submit(self, job: Job | Mapping[str, Any] | None = None, /, **fields: Any) -> JobHandle:
        """Validate and queue one job; returns at once. Fields are `Job` fields plus sampling parameters
        (`logprobs=N`: the result's `logprobs` holds each generated token with its text, see `JobResult.logprobs`)."""
        wire = self.prepare({**_as_dict(job), **fields})
        handle = JobHandle(wire["id"], self, content_hash(wire))
        self.publisher.publish(*self._task(wire, handle.job_hash))
        return handle

    def submit_many(self, jobs: Iterable[Job | Mapping[str, Any]]) -> list[JobHandle]:
        """Validate all jobs, then queue them in pipelined batches; returns handles in input order.

        Validation happens before anything is sent, so one bad job (or an id given twice) means none is queued. The
        batches then grow from `_FIRST_PUBLISH` jobs, doubling up to `_PUBLISH_BATCH`: the first jobs are on the queue,
        and running, while the rest are still being encoded (a worker's engine need not idle while a large batch is
        encoded). If the broker connection fails mid-way, `kombu.exceptions.BatchPublishError` is raised and some
        jobs may have been queued: resubmit the same jobs (same ids); a job whose result exists is not rerun.
        """
        wires = []
        first_of: dict[str, int] = {}
        for index, job in enumerate(jobs):
            try:
                wires.append(self.prepare(_as_dict(job)))
            except InvalidRequestError as exc:
                raise InvalidRequestError(f"jobs[{index}].{exc.field}", exc.message) from None
            first = first_of.setdefault(wires[-1]["id"], index)
            if first != index:
                raise InvalidRequestError(f"jobs[{index}].id", f"{wires[-1]['id']!r} is also the id of jobs[{first}]: "
                                          "give each job of one call its own id")
        handles: list[JobHandle] = []
        with self.publisher.batch(max_size=_PUBLISH_BATCH) as batch:
            flush_at = _FIRST_PUBLISH
            for count, wire in enumerate(wires, 1):
                # hashed here, not before the first write, which all the hashes would hold back
                handle = JobHandle(wire["id"], self, content_hash(wire))
                handles.append(handle)
                batch.publish(*self._task(wire, handle.job_hash))
                if count == flush_at:
                    batch.flush()
                    flush_at += min(count, _PUBLISH_BATCH)
        return handles

    def embed(self, texts: str | list[int] | Iterable[str | list[int]], *, dimensions: int | None = None,
              normalize: bool | None = None, pooling: str | None = None, timeout: float | None = None
              ) -> list[list[float]]:
        """One vector per text (or list of token ids), in input order: each queued as an embedding job (`Job.embed`)
        and waited for, `timeout` seconds for all (None: no limit). A single text or token list counts as one.
        `dimensions`, `normalize`, `pooling`: as `Embed` (None: the checkpoint's). Raises `InvalidRequestError`
        before anything is queued, `JobFailedError` for a failed job, `JobTimeoutError`."""
        one = isinstance(texts, str) or (isinstance(texts, list) and texts and isinstance(texts[0], int))
        options = {"dimensions": dimensions, "normalize": normalize, "pooling": pooling}
        jobs = [embed_job(text, options) for text in ([texts] if one else texts)]  # type: ignore[list-item]
        handles = self.submit_many(jobs)
        results = self.results(handles, timeout=timeout)
        for result in results:
            if not result.ok:
                raise JobFailedError(result)
        return [result.embedding or [] for result in results]

    def score(self, prompt: str | list[int], continuations: list[str | list[int]], *, timeout: float | None = None
              ) -> list[ContinuationScore]:
        """Each continuation's log-likelihood given `prompt` (a text or token ids), in order, as lm-eval-harness's
        `loglikelihood`: one score job (`Job.score`), waited for. A text continuation is tokenized alone (put the
        separating space in it: " Paris"). Raises as `score_many`."""
        return self.score_many([(prompt, continuations)], timeout=timeout)[0]

    def score_many(self, requests: Iterable[tuple[str | list[int], list[str | list[int]]]], *,
                   timeout: float | None = None) -> list[list[ContinuationScore]]:
        """`score` for many (prompt, continuations) pairs, queued together and waited for, `timeout` seconds for all
        (None: no limit); in input order. Raises `InvalidRequestError` before anything is queued, `JobFailedError`
        for a failed job, `JobTimeoutError`."""
        jobs = [{**_prompt_fields(prompt), "score": {"continuations": list(continuations)}}
                for prompt, continuations in requests]
        results = self.results(self.submit_many(jobs), timeout=timeout)
        for result in results:
            if not result.ok:
                raise JobFailedError(result)
        return [result.scores or [] for result in results]

    def prepare(self, fields: Mapping[str, Any]) -> dict[str, Any]:
        """The validated wire form of a job, stamped with its submit time; raises `InvalidRequestError`."""
        job = Job.from_wire(fields)
        if job.submitted_at is None:
            job.submitted_at = time.time()
        wire = job.to_wire()
        # orjson's text of it bounds the stdlib's (`check_size`), at a fraction of the cost of encoding it twice
        check_size(wire, self.max_payload_bytes, fastjson.dumps(wire))
        return wire

    @staticmethod
    def _task(wire: dict[str, Any], job_hash: str | None) -> tuple[Any, ...]:
        """`Publisher.publish`'s arguments for a job. argsrepr/kwargsrepr are what Celery shows in logs, events and
        Flower: never the prompt. The job's hash goes along, so the worker need not hash it again; its free-form parts
        let its body be written by orjson."""
        return (TASK_NAME, wire["id"], [message_wire(wire)], f"[<job {wire['id']}>]",
                {JOB_HASH_HEADER: job_hash} if job_hash else None, free_form(wire))

    # -- results -------------------------------------------------------------------------------

    def get(self, job_id: str) -> JobResult | None:
        """The stored result of `job_id`, or None if there is none yet."""
        backend = self.app.backend
        return _parse_meta(job_id, backend.client.get(backend.get_key_for_task(job_id)), backend)

    def as_completed(self, handles: Iterable[JobHandle | str], timeout: float | None = None,
                     tick: float | None = None) -> Iterator[JobResult | None]:
        """Yield each job's `JobResult` (failed ones too) as soon as it is stored.

        One result per handle given (handles sharing an id each get one); for a handle whose job is not the one the
        stored result belongs to (its id was reused for other content), a failed `conflict` result instead. Raises
        `JobTimeoutError` if `timeout` seconds pass before all are done. With `tick` (and only then), also yields
        None every `tick` seconds, for a caller with work to do while it waits: one subscription serves the whole
        wait (subscribing to thousands of keys again for each short wait cost more than the results).
        """
        handles = list(handles)
        waits = _ResultWatch(self.app.backend, self._subscriptions, list(dict.fromkeys(map(_id_of, handles))),
                             timeout, tick).results()
        return _for_each_handle(handles, waits)

    def results(self, handles: Iterable[JobHandle | str], timeout: float | None = None) -> list[JobResult]:
        """All results, in the order of `handles` (failed ones included, not raised)."""
        handles = list(handles)
        stored = {r.id: r for r in _ResultWatch(self.app.backend, self._subscriptions,
                                                list(dict.fromkeys(map(_id_of, handles))), timeout).results()
                  if r is not None}
        return [_as_seen_by(stored[_id_of(handle)], handle) for handle in handles]

    def cancel(self, jobs: str | JobHandle | Iterable[str | JobHandle]) -> dict[str, Outcome]:
        """Cancel jobs by id, wherever they are; returns the outcome per id:

        * "cancelled": no worker had started it; it never will, and its result (`cancelled`) is stored now;
        * "cancelling": it is running; its worker stops it at the engine's next step (freeing its batch slot
          and KV blocks) and stores its result, `cancelled` with the text generated so far;
        * "finished": it had a final result already, which stays as it was.

        The cancel is kept in Redis as long as results are, so a worker that takes the job later (started
        afterwards, a redelivery, a group message) never runs it. An unknown id is recorded like a queued one
        (its job, if it is sent later with that id, does not run).
        """
        ids = [jobs] if isinstance(jobs, (str, JobHandle)) else list(jobs)
        return cancels.cancel(self.app.backend, [h.id if isinstance(h, JobHandle) else h for h in ids],
                              self.settings.result_expires)

    def ping(self) -> None:
        """Returns once the broker and the result backend answer; raises redis-py's `ConnectionError` or
        `AuthenticationError` naming the first that does not."""
        from tokenmill.queue.app import socket_options
        from tokenmill.queue.tls import redis_client

        broker = redis_client(self.settings.broker_url, **socket_options(self.settings.redis_socket_timeout))
        try:
            broker.ping()
        finally:
            broker.close()
        self.app.backend.client.ping()

    def unknown(self, job_ids: Iterable[str], queues: Iterable[str] | None = None) -> list[str] | None:
        """Of `job_ids`, those no job is known by: no result, never delivered, not on `queues` (default: this
        client's queue). None when a queue is too long to read whole (`cancels.SCAN_LIMIT` messages), so that
        nothing can be told. `tokenmill cancel` asks this first, so that a typo is said, not recorded."""
        from tokenmill.queue.app import socket_options
        from tokenmill.queue.tls import redis_client

        broker = redis_client(self.settings.broker_url, **socket_options(self.settings.redis_socket_timeout))
        try:
            return cancels.unknown(self.app.backend, broker, job_ids, queues or [self.queue])
        finally:
            broker.close()

    def cancel_run(self, run_id: str) -> dict[str, Outcome]:
        """Cancel every job a `tokenmill annotate --broker` / `batch --broker` run queued (see `Client.cancel`)."""
        members = self.app.backend.client.smembers(RUN_JOBS_KEY.format(run_id=run_id))
        return self.cancel(sorted(m.decode() for m in members))

    def dead_letters(self) -> list[dict[str, Any]]:
        """Jobs the workers gave up on (see `max_deliveries`), newest first: `{job, reason, deliveries,
        dead_lettered_at}` each."""
        return [json.loads(letter.raw) for letter in dead_letters.read(self.app.backend.client)]

    def requeue_dead_letters(self, ids: Iterable[str] | None = None) -> tuple[list[JobHandle], list[str]]:
        """Queue dead-lettered jobs again (all for None), with their delivery count reset; refused messages that
        are no job (`DeadLetter.requeueable`) stay, with a warning.

        The job's stored `dead_letter` result is deleted first (otherwise a worker would take the job as
        done), then the job is published again under the same id and its entry removed. Returns the
        handles and the ids that had no dead letter.
        """
        store = self.app.backend.client
        chosen, missing = dead_letters.select(dead_letters.read(store), None if ids is None else list(ids))
        handles = []
        for letter in chosen:
            if not letter.requeueable:
                log.warning("dead letter %s is a message the worker refused, not a job: not requeued (purge it)",
                            json.dumps(letter.summary()))
                continue
            job = {k: v for k, v in letter.job.items() if k != "submitted_at"}  # restamped: queued again now
            wire = self.prepare(job)
            handle = JobHandle(letter.id, self, content_hash(wire))
            store.delete(self.app.backend.get_key_for_task(letter.id), DELIVERIES_KEY.format(job_id=letter.id),
                         CANCEL_KEY.format(job_id=letter.id))
            self.publisher.publish(*self._task(wire, handle.job_hash))
            dead_letters.remove(store, letter)
            handles.append(handle)
        return handles, missing

    def purge_dead_letters(self, ids: Iterable[str] | None = None) -> tuple[int, list[str]]:
        """Drop dead letters (all for None) without running them; returns how many, and the ids not found."""
        store = self.app.backend.client
        chosen, missing = dead_letters.select(dead_letters.read(store), None if ids is None else list(ids))
        for letter in chosen:
            dead_letters.remove(store, letter)
        return len(chosen), missing

    def close(self) -> None:
        if self._own_subscriptions:
            self._subscriptions.close()
        self.publisher.close()
        self.app.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _Subscriptions:
    """A client's idle pub/sub connections, each kept for the next wait once its channels are unsubscribed.

    Why: a wait that opened its own connection paid a connect, redis-py's handshake (`CLIENT SETINFO` twice) and
    a close for each `JobHandle.result()`, on the client's CPU while the worker runs that very job, maybe on the same
    cores (figures: docs/benchmarks/queue.md). Any thread may take one; a taken one is
    that wait's alone.
    """

    def __init__(self) -> None:
        self._idle: list[Any] = []
        self._lock = threading.Lock()

    def take(self, client: redis.Redis) -> Any:
        """An idle connection of `client`'s pool, unsubscribed from the last wait's channels, or a new one (connected
        at its first subscribe)."""
        with self._lock:
            kept = next((index for index, pubsub in enumerate(self._idle)
                         if pubsub.connection_pool is client.connection_pool), None)
            pubsub = None if kept is None else self._idle.pop(kept)
        if pubsub is not None:
            try:
                pubsub.unsubscribe()  # its confirmations are read, and dropped, by this wait's first reads
                return pubsub
            except (redis.RedisError, OSError):  # dropped while idle (a Redis restart)
                _close(pubsub)
        return client.pubsub(ignore_subscribe_messages=True)

    def give_back(self, pubsub: Any, broken: bool = False) -> None:
        """Keep `pubsub` for the next wait, which unsubscribes it from its channels first, or close it (`broken`, too
        many channels to unsubscribe cheaply, enough kept already). Not unsubscribed here, which would hold up a lone
        job's `result()`: a finished wait's channels get no more messages (a result is announced once, when it is
        stored)."""
        channels = len(pubsub.channels) + len(pubsub.pending_unsubscribe_channels)
        if not broken and pubsub.connection is not None and channels <= _REUSED_MAX_CHANNELS:
            with self._lock:
                if len(self._idle) < _IDLE_SUBSCRIPTIONS:
                    self._idle.append(pubsub)
                    return
        _close(pubsub)

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for pubsub in idle:
            _close(pubsub)


class SharedSubscription:
    """One pub/sub connection for the result waits of every client given it (`Client(subscription=...)`), where each
    wait otherwise holds one of its own: a process with many waits at once (`tokenmill serve`'s batch drivers and
    request threads) holds one connection for all of them.

    The first wait starts one reader thread, which takes the connection from `redis`'s pool and holds it until `close`,
    and hands each announcement of a result to the waits subscribed to its key. A wait's `subscribe` returns once Redis
    has confirmed it (a PING sent after it is answered), so a sweep of its keys after that misses no announcement.
    On each (re)connect every key some wait still waits for is subscribed again; what was announced while the
    connection was down, the waits' sweeps read. The reader takes and connects the connection outside the lock (a
    pool with none free, or a connect, may block for its timeout): meanwhile writes are skipped and a subscribe fails
    at once, as while the connection is down. Only the reader gives the connection back, as it exits, so the pool
    never hands out a connection it still reads; a reader that died is replaced at the next take.
    Thread-safe; RESP3 (redis-py's default) or RESP2.
    """

    #: Subscribed for as long as the connection lives, so that with RESP2 it stays in pub/sub mode (a PING's answer
    #: always `[pong, token]` there).
    ANCHOR = b"tokenmill:results-subscription"
    _LOG_EVERY = _LOG_EVERY

    def __init__(self, redis_client: redis.Redis, confirm_timeout: float = 10.0) -> None:
        self.redis = redis_client
        self.confirm_timeout = confirm_timeout
        self._lock = threading.RLock()  # the routes, the confirmations and every write, in one order
        self._routes: dict[bytes, set[_SharedFeed]] = {}  # key -> the waits for it
        self._confirms: dict[bytes, threading.Event] = {}  # PING token -> its wait's subscribe, until answered
        self._connection: Any = None
        self._connecting = False  # the reader is connecting, or taking `_connection` from the pool, outside the lock
        self._held: Any = None  # the pool's connection until given back (`_give_back`): `_connection` or a closed one's
        self._reader: threading.Thread | None = None
        self._first_try = threading.Event()  # the reader's first connect has succeeded or failed
        self._closed = threading.Event()

    def take(self, _client: Any = None) -> _SharedFeed:
        """A wait's feed (`_Subscriptions.take`'s counterpart): subscribe it to keys, read their announcements. The
        first take starts the reader, which takes the connection from the pool; takes wait for its first try (at
        most `confirm_timeout`), outside the lock."""
        with self._lock:
            if self._closed.is_set():
                raise redis.ConnectionError("the shared results subscription is closed")
            if self._reader is None or not self._reader.is_alive():  # the first take, or the reader died
                self._connecting = True
                self._reader = threading.Thread(target=self._read, name="results-subscription", daemon=True)
                self._reader.start()
        self._first_try.wait(self.confirm_timeout)
        return _SharedFeed(self)

    def give_back(self, feed: _SharedFeed, broken: bool = False) -> None:
        """The wait is over: its keys are unsubscribed unless another wait still waits for them."""
        with self._lock:
            gone = []
            for key in feed.keys:
                waits = self._routes.get(key)
                if waits is not None:
                    waits.discard(feed)
                    if not waits:
                        del self._routes[key]
                        gone.append(key)
            feed.keys.clear()
            try:
                self._send("UNSUBSCRIBE", gone)
            except (redis.RedisError, OSError):
                pass  # the reader connects again, subscribing only the keys still waited for

    def close(self) -> None:
        """Stop the reader, which gives the connection back to the pool as it exits (within a second: the reader alone
        uses it, so it is never back in the pool while read); with no reader left, give it back here."""
        self._closed.set()
        self._first_try.set()
        with self._lock:
            self._connection = None
            for confirmed in self._confirms.values():
                confirmed.set()
            reader = self._reader
        if reader is None or not reader.is_alive():
            self._give_back()

    def _give_back(self) -> None:
        """Give the held connection back to the pool, disconnected (it was in pub/sub mode); once, whoever calls."""
        with self._lock:
            connection, self._held = self._held, None
            if self._connection is connection:
                self._connection = None
        if connection is not None:
            connection.deregister_connect_callback(self._on_connect)
            connection.disconnect()
            self.redis.connection_pool.release(connection)

    @property
    def keys(self) -> int:
        """How many keys are subscribed for waits now."""
        return len(self._routes)

    def _subscribe(self, feed: _SharedFeed, keys: Iterable[bytes | str]) -> None:
        """Route `keys`' announcements to `feed`, subscribe those no other wait has, and wait for Redis's confirmation
        (`redis.TimeoutError` after `confirm_timeout`; `redis.ConnectionError` while the connection is down)."""
        token, confirmed = uuid.uuid4().hex.encode(), threading.Event()
        with self._lock:
            fresh = []
            for key in keys:
                key = key.encode() if isinstance(key, str) else key
                feed.keys.add(key)
                if key not in self._routes:
                    self._routes[key] = set()
                    fresh.append(key)
                self._routes[key].add(feed)
            if not self._writable():
                raise redis.ConnectionError("the shared results subscription is reconnecting")
            self._confirms[token] = confirmed
            try:
                self._send("SUBSCRIBE", fresh)
                self._connection.send_command("PING", token, check_health=False)
            except BaseException:
                del self._confirms[token]
                raise
        if not confirmed.wait(self.confirm_timeout):
            with self._lock:
                self._confirms.pop(token, None)
            raise redis.TimeoutError(f"Redis did not confirm a subscription within {self.confirm_timeout:g}s")

    def _writable(self) -> bool:
        """Whether the connection takes writes now (under the lock): connected, and not being connected again."""
        return self._connection is not None and not self._connecting and self._connection.is_connected

    def _send(self, command: str, keys: list[bytes]) -> None:
        """`command` for `keys` on the connection if it is writable (under the lock)."""
        if self._writable():
            _write(self._connection, command, keys)

    def _on_connect(self, connection: Any) -> None:
        """On every connect: the anchor and every key waited for subscribed again, waits' confirmations asked again."""
        with self._lock:
            connection.send_command("SUBSCRIBE", self.ANCHOR, check_health=False)
            _write(connection, "SUBSCRIBE", list(self._routes))
            for token in self._confirms:
                connection.send_command("PING", token, check_health=False)

    def _read(self) -> None:
        """The reader thread: reads until `close`, then gives the connection back (also if it dies of a bug: the next
        take starts another reader)."""
        try:
            self._read_until_closed()
        except Exception:
            log.exception("the shared results subscription's reader failed; the next wait starts another")
        finally:
            self._first_try.set()
            self._give_back()

    def _read_until_closed(self) -> None:
        """Each reply dispatched; a failed connection connected again, at most twice a second, logged at its first
        failure and then once every `_LOG_EVERY` seconds while it keeps failing."""
        failures, logged_at = 0, float("-inf")
        while not self._closed.is_set():
            try:
                with self._lock:
                    if self._closed.is_set():
                        return
                    connection = self._connection
                    connecting = self._connecting = connection is None or not connection.is_connected
                if connecting:
                    if not self._connect(connection):  # `_on_connect` subscribes again
                        return  # closed meanwhile
                    failures = 0
                    continue
                if connection.can_read(timeout=1.0):
                    self._dispatch(connection.read_response(disable_decoding=True, push_request=True))
            except (redis.RedisError, OSError) as exc:
                self._first_try.set()
                if self._closed.is_set():
                    return
                failures += 1
                if time.monotonic() - logged_at >= self._LOG_EVERY:
                    logged_at = time.monotonic()
                    log.warning("the shared results subscription failed (%r, %d time(s) in a row); connecting again",
                                exc, failures)
                with self._lock:
                    if self._connection is not None:
                        self._connection.disconnect()
                self._closed.wait(0.5)

    def _connect(self, connection: Any) -> bool:
        """Connect outside the lock: the pool's connection the first time (then subscribed by `_on_connect`, as on
        every connect after), else `connection` again. False: closed meanwhile (the reader then gives it back)."""
        try:
            if connection is None:
                connection = self.redis.connection_pool.get_connection()
                with self._lock:
                    self._held = connection
                    connection.register_connect_callback(self._on_connect)
                    if not self._closed.is_set():
                        self._connection = connection
                        self._on_connect(connection)  # the pool connected it before the callback was registered
            else:
                connection.connect()
        finally:
            with self._lock:
                self._connecting = False
        self._first_try.set()
        return not self._closed.is_set()

    def _dispatch(self, reply: Any) -> None:
        """A result's announcement to the waits for its key; a PING's answer (its token: RESP3, `[pong, token]`:
        RESP2) to the subscribe waiting for it; (un)subscribe confirmations dropped."""
        if isinstance(reply, list) and len(reply) == 3 and reply[0] == b"message":
            with self._lock:
                waits = list(self._routes.get(reply[1], ()))
            for feed in waits:
                feed.inbox.put({"type": "message", "channel": reply[1], "data": reply[2]})
            return
        token = reply[1] if isinstance(reply, list) and len(reply) == 2 and reply[0] == b"pong" else reply
        if isinstance(token, bytes):
            with self._lock:
                confirmed = self._confirms.pop(token, None)
            if confirmed is not None:
                confirmed.set()


def _write(connection: Any, command: str, keys: list[bytes]) -> None:
    """`command` for `keys` on `connection`, in writes of at most `_PUBLISH_BATCH` keys."""
    for start in range(0, len(keys), _PUBLISH_BATCH):
        connection.send_command(command, *keys[start : start + _PUBLISH_BATCH], check_health=False)


class _SharedFeed:
    """One wait's part of a `SharedSubscription`, used as that wait's pub/sub connection (`_ResultWatch`)."""

    def __init__(self, shared: SharedSubscription) -> None:
        self.shared = shared
        self.keys: set[bytes] = set()
        self.inbox: queue.SimpleQueue[dict[str, Any]] = queue.SimpleQueue()

    def subscribe(self, *keys: bytes | str) -> None:
        self.shared._subscribe(self, keys)

    def get_message(self, timeout: float = 0.0) -> dict[str, Any] | None:
        """The next announcement for this wait's keys, waiting `timeout` seconds at most; None if none came."""
        try:
            return self.inbox.get(timeout=max(0.0, timeout))
        except queue.Empty:
            return None


def _close(pubsub: Any) -> None:
    try:
        pubsub.close()
    except redis.RedisError:
        pass


class _ResultWatch:
    """Waits for many results: pub/sub notifications, plus a periodic MGET sweep as a safety net."""

    def __init__(self, backend: Any, subscriptions: _Subscriptions | SharedSubscription, ids: list[str],
                 timeout: float | None,
                 tick: float | None = None) -> None:
        self.backend = backend
        self.subscriptions = subscriptions
        self.pending = {backend.get_key_for_task(job_id): job_id for job_id in ids}
        self.timeout = timeout
        self.deadline = None if timeout is None else time.monotonic() + timeout
        self.tick = tick
        self.pubsub: Any = None
        self.unreachable: BaseException | None = None  # the last Redis error, until Redis answers again
        self.said_down, self.said_at = False, float("-inf")  # this wait's last "does not answer" line, and when

    def results(self) -> Iterator[JobResult | None]:
        """The results as they come; None every `tick` seconds too, if one is set. A Redis that does not answer
        is tried again until the timeout (a call that hangs, at most `redis_socket_timeout` past it), logged once
        while it lasts; the timeout's error says so."""
        try:
            self._resubscribe_quietly()  # Redis may be down right now: the sweeps retry
            if self.unreachable is not None:
                self._remaining()  # a subscribe that hung to its socket timeout used the wait's time: not a sweep too
            yield from self._sweep()
            last_sweep = last_tick = time.monotonic()
            while self.pending:
                wait = min(self._remaining(), _SWEEP_INTERVAL, self.tick or _SWEEP_INTERVAL)
                yield from self._listen(wait)
                if time.monotonic() - last_sweep >= _SWEEP_INTERVAL:
                    yield from self._sweep()
                    last_sweep = time.monotonic()
                if self.tick is not None and time.monotonic() - last_tick >= self.tick:
                    last_tick = time.monotonic()
                    yield None
        finally:
            self._unsubscribe()

    def _remaining(self) -> float:
        if self.deadline is None:
            return _SWEEP_INTERVAL
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise JobTimeoutError(list(self.pending.values()), self.timeout or 0.0, self.unreachable)
        return left

    def _failed(self, error: BaseException) -> None:
        """A Redis call failed: logged when Redis had answered, at most once a `_LOG_EVERY` (a Redis that comes and
        goes, or a subscribe that fails while reads work, is not a log line a second)."""
        if self.unreachable is None and not self.said_down and time.monotonic() - self.said_at >= _LOG_EVERY:
            log.warning("waiting for %d result(s): Redis does not answer (%s: %s); trying again until it does",
                        len(self.pending), type(error).__name__, error)
            self.said_down, self.said_at = True, time.monotonic()
        self.unreachable = error

    def _answered(self) -> None:
        if self.unreachable is not None:
            if self.said_down:
                log.warning("waiting for %d result(s): Redis answers again", len(self.pending))
                self.said_down = False
            self.unreachable = None

    def _subscribe(self) -> None:
        self.pubsub = self.subscriptions.take(self.backend.client)
        keys = list(self.pending)
        for start in range(0, len(keys), _PUBLISH_BATCH):
            self.pubsub.subscribe(*keys[start : start + _PUBLISH_BATCH])

    def _unsubscribe(self, broken: bool = False) -> None:
        """Done with the pub/sub connection: kept for the next wait unless it failed (`broken`)."""
        pubsub, self.pubsub = self.pubsub, None
        if pubsub is not None:
            self.subscriptions.give_back(pubsub, broken)

    def _listen(self, wait: float) -> Iterator[JobResult]:
        """Results announced on pub/sub within `wait` seconds; reconnects if Redis went away."""
        end = time.monotonic() + wait
        while self.pending and (left := end - time.monotonic()) > 0:
            if self.pubsub is None:  # Redis was down at the last attempt; the sweep will retry
                time.sleep(left)
                return
            try:
                message = self.pubsub.get_message(timeout=left)
            except (redis.ConnectionError, redis.TimeoutError, OSError) as error:
                self._failed(error)
                self._unsubscribe(broken=True)
                time.sleep(min(0.5, max(0.0, end - time.monotonic())))
                self._remaining()  # a read that hung to its socket timeout may have used the wait's time
                self._resubscribe_quietly()
                return
            if message is None or message.get("type") != "message":
                continue
            result = self._take(message["channel"], message["data"])
            if result is not None:
                yield result

    def _resubscribe_quietly(self) -> None:
        try:
            self._subscribe()
        except redis.RedisError as error:
            self._failed(error)
            self._unsubscribe(broken=True)  # Redis still down: the next sweep fails too and we retry after it

    def _sweep(self) -> Iterator[JobResult]:
        """Read every pending key directly (catches results stored before subscribing, or missed)."""
        if self.unreachable is not None:
            self._remaining()  # the last call may have hung to its socket timeout: not another one past the deadline
        keys = list(self.pending)
        for start in range(0, len(keys), _PUBLISH_BATCH):
            chunk = keys[start : start + _PUBLISH_BATCH]
            try:
                values = self.backend.client.mget(chunk)
            except (redis.ConnectionError, redis.TimeoutError) as error:
                self._failed(error)
                return
            self._answered()
            for key, value in zip(chunk, values):
                result = self._take(key, value)
                if result is not None:
                    yield result
        if self.pubsub is None:
            self._resubscribe_quietly()

    def _take(self, key: bytes | str, value: bytes | None) -> JobResult | None:
        key = key.encode() if isinstance(key, str) else key
        job_id = self.pending.get(key)
        if job_id is None or value is None:
            return None
        result = _parse_meta(job_id, value, self.backend)
        if result is not None:
            del self.pending[key]
        return result


def _id_of(handle: JobHandle | str) -> str:
    return handle.id if isinstance(handle, JobHandle) else handle


def _as_seen_by(result: JobResult, handle: JobHandle | str) -> JobResult:
    """The stored `result` as `handle`'s answer: a failed `conflict` when it belongs to other content under the id."""
    return result.conflict_with(handle.job_hash if isinstance(handle, JobHandle) else None) or result


def _for_each_handle(handles: list[JobHandle | str], stored: Generator[JobResult | None, None, None]
                     ) -> Iterator[JobResult | None]:
    """Each stored result once per handle of its id (handles may share an id, each with its own content); the
    ticks' Nones as they come."""
    by_id: dict[str, list[JobHandle | str]] = {}
    for handle in handles:
        by_id.setdefault(_id_of(handle), []).append(handle)
    with closing(stored):  # a caller that stops early ends the wait's subscription now, not at garbage collection
        for result in stored:
            if result is None:
                yield None
                continue
            for handle in by_id[result.id]:
                yield _as_seen_by(result, handle)


def _parse_meta(job_id: str, value: bytes | None, backend: Any) -> JobResult | None:
    """A stored Celery result as a `JobResult`; None if the task is not finished."""
    if value is None:
        return None
    meta = backend.decode_result(value)
    status = meta.get("status")
    if status not in FINAL_STATES:
        return None
    if status == CANCELLED_STATE:  # decoded raw: Celery turned the result into a TaskRevokedError above
        result = json.loads(value).get("result")
        if isinstance(result, dict) and result.get("status") == "cancelled":
            return JobResult.model_validate(result)
        reason = result.get("exc_message") if isinstance(result, dict) else None  # Celery's own: revoked, expired
        return JobResult.cancelled(job_id, f"revoked by Celery: {' '.join(map(str, reason or ['revoked']))}")
    if status == "SUCCESS":
        try:
            return JobResult.model_validate(meta.get("result"))
        except ValueError as exc:
            return JobResult.failure(job_id, "task_failure", f"the task returned something that is not a JobResult: {exc}")
    error = meta.get("result")  # Celery turns a stored exception back into an exception object
    detail = f"{type(error).__name__}: {error}" if isinstance(error, BaseException) else repr(error)
    return JobResult.failure(job_id, "task_failure", f"the task ended in state {status}: {detail}")


def embed_job(text: str | list[int], options: Mapping[str, Any]) -> dict[str, Any]:
    """The job fields embedding `text` (a prompt, or token ids) with `options` (`Embed`'s fields; None ones left
    to the checkpoint)."""
    return {**_prompt_fields(text), "embed": {key: value for key, value in options.items() if value is not None}}


def _prompt_fields(text: str | list[int]) -> dict[str, Any]:
    """A prompt's job field: `prompt` for a text, `prompt_token_ids` for token ids."""
    return {"prompt": text} if isinstance(text, str) else {"prompt_token_ids": text}


def _as_dict(job: Job | Mapping[str, Any] | None) -> dict[str, Any]:
    if job is None:
        return {}
    if isinstance(job, Job):
        return job.model_dump(exclude_none=True)
    if isinstance(job, Mapping):
        return dict(job)
    raise InvalidRequestError("job", f"must be a Job or a mapping of job fields, got {type(job).__name__}")
