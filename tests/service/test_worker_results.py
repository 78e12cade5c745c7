"""The worker's result backend is one instance for every pool thread, so results finishing together share one
script call (real redis-server; Celery's keys and values)."""

from __future__ import annotations

import json
import threading
import uuid
from datetime import datetime, timezone

import pytest
from celery.app.task import Context
from celery.backends.redis import RedisBackend

from service_fixtures import RedisServer

from tokenmill.queue.settings import QueueSettings
from tokenmill.worker.app import create_app


def test_every_thread_gets_the_one_backend_and_concurrent_stores_share_calls(redis_server: RedisServer) -> None:
    app = create_app(QueueSettings(broker_url=redis_server.url))
    assert app.backend.thread_safe  # the worker's main thread makes it first (Celery caches it for all threads)
    seen: list[object] = []
    threads = [threading.Thread(target=lambda: seen.append(app.backend)) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert all(backend is app.backend for backend in seen)  # Celery's default would give each thread its own

    redis = redis_server.client()
    redis.config_resetstat()
    start = threading.Barrier(32)

    def store(i: int) -> None:
        start.wait()
        app.backend.store_result(f"job-{i}", {"id": f"job-{i}"}, "SUCCESS")

    threads = [threading.Thread(target=store, args=(i,)) for i in range(32)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for i in range(32):
        meta = json.loads(redis.get(f"celery-task-meta-job-{i}"))
        assert (meta["status"], meta["result"]) == ("SUCCESS", {"id": f"job-{i}"})
    stats = redis.info("commandstats")
    calls = sum(stats.get(f"cmdstat_{name}", {}).get("calls", 0) for name in ("evalsha", "eval"))
    assert 1 <= calls < 32, stats  # 32 stores, fewer script calls: some were shared


@pytest.mark.parametrize("conf", [{}, {"result_extended": True}, {"timezone": "Asia/Kolkata", "enable_utc": False},
                                  {"timezone": "America/New_York"}])
@pytest.mark.parametrize("state", ["SUCCESS", "REVOKED", "FAILURE", "STARTED", "PENDING"])
@pytest.mark.parametrize("format_date", [True, False])
def test_result_meta_without_a_request_is_celerys(conf: dict, state: str, format_date: bool) -> None:
    """The meta the backend builds itself for a job's result (no request) is Celery's own, field for field,
    the time in the app's time zone; with a request it is Celery's."""
    app = create_app(QueueSettings(broker_url="redis://127.0.0.1:1/0"))  # no connection is made
    app.conf.update(conf)
    backend = app.backend
    before = datetime.now(timezone.utc)
    ours = backend._get_result_meta({"id": "j"}, state, None, None, format_date=format_date)
    celerys = RedisBackend._get_result_meta(backend, {"id": "j"}, state, None, None, format_date=format_date)
    after = datetime.now(timezone.utc)
    ours_done, celerys_done = ours.pop("date_done"), celerys.pop("date_done")
    assert ours == celerys
    assert type(ours_done) is type(celerys_done)
    if celerys_done is not None:
        ours_time, celerys_time = (datetime.fromisoformat(d) if format_date else d for d in (ours_done, celerys_done))
        assert ours_time.utcoffset() == celerys_time.utcoffset()
        assert before <= ours_time <= after
    request = Context(id="j", task="tokenmill.generate", group="g", parent_id="p", args=[], kwargs={},
                      hostname="w", retries=0, delivery_info={"routing_key": "tokenmill"})
    with_request = backend._get_result_meta({"id": "j"}, state, None, request)
    expected = RedisBackend._get_result_meta(backend, {"id": "j"}, state, None, request)
    with_request.pop("date_done"), expected.pop("date_done")
    assert with_request == expected and with_request["group_id"] == "g"


def test_results_and_the_acks_of_their_messages_are_one_script_call(redis_server: RedisServer) -> None:
    """`WorkerService.store_results` with acks: each result stored unless one is (and announced), and every given
    message's unacked records removed, in one call; messages not named stay unacked. Real redis-server."""
    from prometheus_client import CollectorRegistry

    from tokenmill.worker.metrics import WorkerMetrics
    from tokenmill.worker.service import WorkerService
    from tokenmill.worker.settings import WorkerSettings

    service = WorkerService(WorkerSettings(broker_url=redis_server.url, model="builtin:tiny"), engine=None,
                            metrics=WorkerMetrics(CollectorRegistry()), sink=None)  # the engine is never used here
    redis = redis_server.client()
    tags = [f"tag-{i}" for i in range(2500)]  # more than one unpack's worth
    for name in ("unacked", "other_unacked"):
        redis.hset(name, mapping={tag: "[message]" for tag in tags})
        redis.zadd(f"{name}_index", {tag: 1.0 for tag in tags})
    redis.set("celery-task-meta-kept", b'{"status": "SUCCESS", "kept": true}')
    announced = redis.pubsub()
    announced.subscribe("celery-task-meta-new", "celery-task-meta-kept")
    service.store_results({b"celery-task-meta-warm": b"{}"})  # the script is loaded into Redis
    redis.config_resetstat()

    acks = [("unacked", "unacked_index", tag) for tag in tags[:2400]] + [("other_unacked", "other_unacked_index", "tag-7")]
    service.store_results({b"celery-task-meta-new": b'{"status": "SUCCESS"}', b"celery-task-meta-kept": b"{}"}, acks)

    assert redis.get("celery-task-meta-new") == b'{"status": "SUCCESS"}' and redis.ttl("celery-task-meta-new") > 0
    assert redis.get("celery-task-meta-kept") == b'{"status": "SUCCESS", "kept": true}'  # never overwritten
    assert sorted(redis.hkeys("unacked")) == sorted(tag.encode() for tag in tags[2400:])
    assert sorted(redis.zrange("unacked_index", 0, -1)) == sorted(tag.encode() for tag in tags[2400:])
    assert redis.hlen("other_unacked") == redis.zcard("other_unacked_index") == 2499
    assert not redis.hexists("other_unacked", "tag-7")
    stats = redis.info("commandstats")
    assert sum(stats.get(f"cmdstat_{name}", {}).get("calls", 0) for name in ("evalsha", "eval")) == 1
    assert "cmdstat_exec" not in stats  # no separate ack pipeline
    messages = [announced.get_message(timeout=5) for _ in range(3)]
    assert [m["channel"] for m in messages if m and m["type"] == "message"] == [b"celery-task-meta-new"]


@pytest.mark.parametrize("task_id", ["3b82ed58653f4726a20822a2f532681d", "job:é-1", uuid.UUID(int=7), b"bytes-id"])
@pytest.mark.parametrize("key", ["", "extra"])
def test_result_keys_are_celerys(task_id: object, key: str) -> None:
    """The worker's backend joins a text id to the prefix it encoded once; every key is still Celery's own."""
    app = create_app(QueueSettings(broker_url="redis://127.0.0.1:1/0"))
    app.conf.result_backend_transport_options = {"global_keyprefix": "tenant-a"}  # Celery's prefix for shared Redis
    backend = app.backend
    assert backend.get_key_for_task(task_id, key) == RedisBackend.get_key_for_task(backend, task_id, key)
    assert backend.get_key_for_task(task_id, key).startswith(b"tenant-a_celery-task-meta-")
    with pytest.raises(ValueError):
        backend.get_key_for_task("")
