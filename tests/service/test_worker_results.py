"""The worker's result backend is one instance for every pool thread, so results finishing together share one
script call (real redis-server; Celery's keys and values)."""

from __future__ import annotations

import json
import threading

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
