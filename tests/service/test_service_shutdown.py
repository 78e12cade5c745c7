"""SIGTERM: the worker stops taking jobs, finishes (or, past the grace period, requeues) what it holds,
and exits cleanly; nothing is left unacked and nothing is lost."""

from __future__ import annotations

import os
import signal

from service_fixtures import RedisServer, ResultLog, wait_for

from tokenmill.client import Client


def _jobs(count: int, max_tokens: int) -> list[dict]:
    return [{"prompt": f"shutdown {i}", "max_tokens": max_tokens, "ignore_eos": True} for i in range(count)]


def test_sigterm_finishes_in_flight_jobs_then_exits(redis_server: RedisServer, start_worker, result_log: ResultLog) -> None:
    client = Client(redis_server.url)
    broker = redis_server.client()
    worker = start_worker(redis_server.url, concurrency=4).wait_ready()
    handles = client.submit_many(_jobs(12, 300))
    wait_for(lambda: broker.zcard("unacked_index") == 4, 30, "4 jobs in flight")

    assert worker.terminate(timeout=60) == 0

    finished = [h for h in handles if client.get(h.id) is not None]
    assert len(finished) >= 4, "jobs in flight at SIGTERM were not finished"
    assert len(finished) + broker.llen("tokenmill") == len(handles)
    assert broker.hlen("unacked") == 0
    start_worker(redis_server.url, "next").wait_ready()
    assert all(r.ok for r in client.results(handles, timeout=120))
    wait_for(lambda: all(h.id in result_log.counts for h in handles), 10, "every result notification")
    assert set(result_log.counts[h.id] for h in handles) == {1}


def test_sigterm_requeues_jobs_that_outlast_the_grace_period(redis_server: RedisServer, start_worker) -> None:
    client = Client(redis_server.url)
    broker = redis_server.client()
    worker = start_worker(redis_server.url, concurrency=4, shutdown_grace=1).wait_ready()
    handles = client.submit_many(_jobs(4, 3000))
    wait_for(lambda: broker.zcard("unacked_index") == 4, 30, "4 long jobs in flight")

    assert worker.terminate(timeout=30) == 0

    assert all(client.get(h.id) is None for h in handles)
    assert broker.llen("tokenmill") == 4 and broker.hlen("unacked") == 0


def test_sigterm_to_the_whole_process_group_still_finishes_in_flight_jobs(redis_server: RedisServer, start_worker) -> None:
    """As Ctrl-C or `timeout` do: the engine process gets the signal too, and must outlive the jobs."""
    client = Client(redis_server.url)
    broker = redis_server.client()
    worker = start_worker(redis_server.url, concurrency=4, new_session=True).wait_ready()
    handles = client.submit_many(_jobs(4, 300))
    wait_for(lambda: broker.zcard("unacked_index") == 4, 30, "4 jobs in flight")

    os.killpg(worker.process.pid, signal.SIGTERM)

    assert worker.process.wait(timeout=60) == 0
    assert all(client.get(h.id) is not None and client.get(h.id).ok for h in handles)
    assert broker.hlen("unacked") == 0
