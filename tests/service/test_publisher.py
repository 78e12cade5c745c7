"""The publisher: the very messages Celery's own `send_task_message` queues, its signals, one channel per thread."""

from __future__ import annotations

import base64
import json
import threading
import time
from datetime import datetime, timezone
from typing import Any

import pytest
from celery.signals import after_task_publish, before_task_publish
from service_fixtures import RedisServer

from tokenmill.client import Client
from tokenmill.queue.names import BATCH_TASK_NAME, JOB_HASH_HEADER, TASK_NAME


def _taken(server: RedisServer, count: int) -> list[dict[str, Any]]:
    """The `count` oldest messages on the queue, oldest first, taken off it."""
    store = server.client()
    return [json.loads(store.rpop("tokenmill")) for _ in range(count)]


def _as_celery_sends(client: Client, name: str, task_id: str, args: list[Any], argsrepr: str,
                     headers: dict[str, Any] | None = None, **options: Any) -> None:
    """The same task message through Celery's `send_task_message` and a pooled kombu producer."""
    amqp = client.app.amqp
    message = amqp.as_task_v2(task_id, name, args=args, kwargs={}, argsrepr=argsrepr, kwargsrepr="{}", **options)
    message.headers.update(headers or {})
    with client.app.producer_or_acquire() as producer:
        amqp.send_task_message(producer, name, message, queue=client.queue, retry=True)


def _without_tag(message: dict[str, Any]) -> dict[str, Any]:
    tag = message["properties"].pop("delivery_tag")
    assert isinstance(tag, str) and len(tag) == 36, tag  # a fresh uuid4 per message, as kombu's
    return message


def _body(message: dict[str, Any]) -> Any:
    """The message's decoded body (taken out of the message)."""
    return json.loads(base64.b64decode(message.pop("body")))


def test_jobs_and_groups_are_queued_as_celery_queues_them(redis_server: RedisServer) -> None:
    """`submit`, `submit_many`, `Client.publisher.publish` of any task and an annotate group's message are, but for
    the delivery tag and how their bodies' JSON is spaced, what Celery's `send_task_message` queues for the same task:
    the same envelope, the same body once decoded: any Celery worker takes them. A job's body is written by orjson
    (compact, UTF-8) unless a free-form part holds what orjson writes otherwise (an integer past 64 bits here); any
    other task's by kombu, byte for byte Celery's."""
    client = Client(redis_server.url)
    single = client.submit(prompt="one job, ünïcode 中文", max_tokens=3, temperature=0.0)
    many = client.submit_many([{"prompt": f"job {i}", "seed": i, "metadata": {"big": 2**70 if i else 1}} for i in range(3)])
    group = [client.prepare({"prompt": "in a group", "json_schema": {"type": "object"}})]
    client.publisher.publish(BATCH_TASK_NAME, "a" * 32, [{"jobs": group}], "[<1 jobs>]", ignore_result=True)
    client.publisher.publish("other.task", "b" * 32, [{"x": 1.5}], "[<other>]")
    ours = [_without_tag(message) for message in _taken(redis_server, 6)]
    raw_bodies = [base64.b64decode(message["body"]) for message in ours]
    our_bodies = [_body(message) for message in ours[:-1]]

    for handle, body, message in zip([single, *many], our_bodies, ours):
        wire = body[0][0]
        assert wire["id"] == handle.id and message["headers"][JOB_HASH_HEADER] == handle.job_hash
        _as_celery_sends(client, TASK_NAME, handle.id, [wire], f"[<job {handle.id}>]", {JOB_HASH_HEADER: handle.job_hash})
    _as_celery_sends(client, BATCH_TASK_NAME, "a" * 32, [{"jobs": group}], "[<1 jobs>]", ignore_result=True)
    _as_celery_sends(client, "other.task", "b" * 32, [{"x": 1.5}], "[<other>]")
    celerys = [_without_tag(message) for message in _taken(redis_server, 6)]
    assert our_bodies == [_body(message) for message in celerys[:-1]]
    assert ours == celerys  # the envelopes; the other task's body byte for byte
    assert raw_bodies[0].find("中文".encode()) >= 0 and raw_bodies[0].find(b'", "') < 0  # orjson's: UTF-8, no spaces
    assert raw_bodies[2].find(b'"big": 1180591620717411303424') >= 0  # the stdlib's, where orjson refuses
    assert ours[-2]["headers"]["ignore_result"] is True and ours[0]["headers"]["ignore_result"] is False
    assert redis_server.client().llen("tokenmill") == 0


def test_celery_publish_signals_are_sent_and_their_headers_queued(redis_server: RedisServer) -> None:
    """Tracing integrations add headers in `before_task_publish`: they reach the queued message, for `submit` and
    `submit_many` alike; `after_task_publish` follows each."""
    before: list[str] = []
    after: list[tuple[str, str]] = []

    def add_trace(sender: str, headers: dict[str, Any], **_: Any) -> None:
        before.append(sender)
        headers["traceparent"] = f"trace-{headers['id']}"

    def note(sender: str, body: Any, routing_key: str, **_: Any) -> None:
        after.append((body[0][0]["id"], routing_key))

    before_task_publish.connect(add_trace, weak=False)
    after_task_publish.connect(note, weak=False)
    try:
        client = Client(redis_server.url)
        handles = [client.submit(prompt="traced"), *client.submit_many([{"prompt": "a"}, {"prompt": "b"}])]
    finally:
        before_task_publish.disconnect(add_trace)
        after_task_publish.disconnect(note)
    assert before == [TASK_NAME] * 3
    assert after == [(handle.id, "tokenmill") for handle in handles]
    assert [message["headers"]["traceparent"] for message in _taken(redis_server, 3)] == [f"trace-{h.id}" for h in handles]


def test_threads_publish_on_channels_of_their_own_kept_open_and_closed_by_close(redis_server: RedisServer) -> None:
    """A kombu channel is not thread-safe: each publish has one to itself. Channels stay open for the next publishes
    (a thread started per job reuses the last one instead of leaving a connection behind), and `close` closes them."""
    client = Client(redis_server.url)
    errors: list[BaseException] = []
    both = threading.Barrier(4)

    def submit(index: int) -> None:
        try:
            both.wait(timeout=10)
            for i in range(50):
                client.submit(prompt=f"thread {index} job {i}")
        except BaseException as exc:  # noqa: BLE001: reported below
            errors.append(exc)

    threads = [threading.Thread(target=submit, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors
    prompts = sorted(json.loads(base64.b64decode(m["body"]))[0][0]["prompt"] for m in _taken(redis_server, 200))
    assert prompts == sorted(f"thread {t} job {i}" for t in range(4) for i in range(50))
    assert 1 <= len(client.publisher._idle) <= 4

    for i in range(20):  # one short-lived thread per job, one after another
        thread = threading.Thread(target=client.submit, kwargs={"prompt": f"own thread {i}"})
        thread.start()
        thread.join()
    assert redis_server.client().llen("tokenmill") == 20
    connections = [channel.connection.client for channel in client.publisher._idle]
    assert 1 <= len(connections) <= 4 and all(connection.connected for connection in connections)
    client.close()
    assert client.publisher._idle == [] and not any(connection.connected for connection in connections)


def test_a_failed_batch_queues_nothing_unwritten(redis_server: RedisServer) -> None:
    """An error while a batch is being built drops the messages not written yet; the next publish works."""
    client = Client(redis_server.url)
    with pytest.raises(RuntimeError, match="stop here"):
        with client.publisher.batch(max_size=1000) as batch:
            batch.publish(*client._task(client.prepare({"prompt": "never queued"}), None))
            raise RuntimeError("stop here")
    assert redis_server.client().llen("tokenmill") == 0
    client.submit(prompt="queued")
    assert redis_server.client().llen("tokenmill") == 1


def test_with_redis_down_submit_fails_as_celerys_publish_does_and_works_once_it_is_back(redis_server: RedisServer) -> None:
    """A broken connection is opened anew once, with Celery's publish retry policy (three tries, 0.2 s apart): an
    `OperationalError` within seconds, as `send_task_message` gave, not a wait on the worker's endless reconnects;
    no connection is kept for the failed tries."""
    from kombu.exceptions import OperationalError

    client = Client(redis_server.url)
    client.submit(prompt="before")
    redis_server.stop()
    started = time.monotonic()
    for _ in range(3):
        with pytest.raises(OperationalError):
            client.submit(prompt="while down")
    assert time.monotonic() - started < 10
    assert client.publisher._idle == []  # the broken channel closed, none kept of the failed tries
    redis_server.start()
    client.submit(prompt="after")
    queued = [json.loads(base64.b64decode(m["body"]))[0][0]["prompt"] for m in _taken(redis_server, 2)]
    assert queued == ["before", "after"] and len(client.publisher._idle) == 1


def test_a_body_a_publish_signal_handler_changed_is_written_by_kombu(redis_server: RedisServer) -> None:
    """A `before_task_publish` handler may put in the body what kombu's encoder writes its own way (a datetime): with
    handlers connected, a job's body is checked whole, and such a body is written by kombu, which the worker reads
    back as a datetime."""
    from kombu.utils.json import loads as kombu_loads

    def add_when(sender: str, body: Any, **_: Any) -> None:
        body[1]["when"] = datetime(2026, 12, 4, 16, 0, tzinfo=timezone.utc)

    client = Client(redis_server.url)
    before_task_publish.connect(add_when, weak=False)
    try:
        handle = client.submit(prompt="changed by a signal handler")
    finally:
        before_task_publish.disconnect(add_when)
    plain = client.submit(prompt="not changed")
    changed, unchanged = (base64.b64decode(m["body"]) for m in _taken(redis_server, 2))
    args, kwargs, _ = kombu_loads(changed)
    assert args[0]["id"] == handle.id and kwargs == {"when": datetime(2026, 12, 4, 16, 0, tzinfo=timezone.utc)}
    assert changed.find(b'", "') >= 0 and unchanged.find(b'", "') < 0  # kombu's spacing; orjson's again
    assert json.loads(unchanged)[0][0]["id"] == plain.id
