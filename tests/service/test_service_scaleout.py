"""Two worker processes on one Redis share the load, with no coordination beyond the broker."""

from __future__ import annotations

from collections import Counter

from service_fixtures import RedisServer, ResultLog, wait_for

from tokenmill.client import Client


def test_two_workers_share_one_queue(redis_server: RedisServer, start_worker, result_log: ResultLog) -> None:
    client = Client(redis_server.url)
    start_worker(redis_server.url, "left").wait_ready()
    start_worker(redis_server.url, "right").wait_ready()
    handles = client.submit_many([{"prompt": f"share {i}", "max_tokens": 48, "ignore_eos": True} for i in range(300)])
    results = client.results(handles, timeout=180)
    assert all(r.ok for r in results)
    by_worker = Counter(r.worker.split("@")[0] for r in results)
    assert set(by_worker) == {"left", "right"} and min(by_worker.values()) >= 30, by_worker
    wait_for(lambda: all(h.id in result_log.counts for h in handles), 10, "every result notification")
    assert set(result_log.counts[h.id] for h in handles) == {1}
