"""redis-server restarted (AOF on) while jobs are queued and in flight: no job is lost."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from service_fixtures import RedisServer, wait_for

from tokenmill.client import Client


def test_redis_restart_with_jobs_queued_and_in_flight_loses_none(redis_server: RedisServer, start_worker) -> None:
    client = Client(redis_server.url)
    worker = start_worker(redis_server.url, concurrency=8).wait_ready()
    jobs = [{"prompt": f"restart {i}", "max_tokens": 200, "ignore_eos": True, "temperature": 0.0} for i in range(40)]
    handles = client.submit_many(jobs)
    broker = redis_server.client()
    wait_for(lambda: broker.zcard("unacked_index") == 8, 30, "8 jobs in flight")
    queued = broker.llen("tokenmill")
    assert queued > 0, "no job was left queued: the test would not cover queued jobs"

    with ThreadPoolExecutor(1) as pool:  # a client already waiting for results must ride out the restart too
        waiting = pool.submit(client.results, handles, 180)
        redis_server.restart()  # SIGTERM (AOF written, fsync always), then the same port and data directory
        results = waiting.result(timeout=200)
    assert [r.id for r in results] == [h.id for h in handles]
    assert all(r.ok and r.usage.completion_tokens == 200 for r in results), [r.error for r in results if not r.ok]
    assert worker.process.poll() is None
    wait_for(lambda: broker.hlen("unacked") == 0 and broker.llen("tokenmill") == 0, 30, "queue drained and acked")
