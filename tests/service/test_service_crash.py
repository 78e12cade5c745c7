"""Workers that die with `kill -9`: their jobs are delivered again, each ends with exactly one result,
and a job that keeps killing workers is dead-lettered after a bounded number of deliveries."""

from __future__ import annotations

import os
import signal
import time
import uuid
from pathlib import Path

from service_fixtures import TEST_VISIBILITY_TIMEOUT, RedisServer, ResultLog, child_pids, wait_for

from tokenmill.jobs.client import Client
from tokenmill.worker.app import DELIVERIES_KEY
from tokenmill.worker.service import FATAL_EXIT_CODE


def test_kill_9_with_jobs_in_flight_loses_nothing(redis_server: RedisServer, start_worker, result_log: ResultLog) -> None:
    client = Client(redis_server.url)
    doomed = start_worker(redis_server.url, "doomed").wait_ready()
    survivor = start_worker(redis_server.url, "survivor").wait_ready()
    jobs = [{"prompt": f"crash test {i}", "max_tokens": 300, "ignore_eos": True, "temperature": 0.0} for i in range(40)]
    handles = client.submit_many(jobs)
    broker = redis_server.client()
    wait_for(lambda: broker.llen("tokenmill") == 0 and broker.zcard("unacked_index") == len(jobs), 30, "all jobs in flight")

    doomed.kill()
    killed_at = time.time()
    results = client.results(handles, timeout=180)

    assert all(r.ok for r in results), [r.error for r in results if not r.ok]
    assert all(r.usage.completion_tokens == 300 for r in results)
    rerun = [r for r in results if r.attempt == 2]
    assert rerun, "the killed worker held no job: the test did not exercise recovery"
    assert {r.worker.split("@")[0] for r in rerun} == {"survivor"}
    recovery = min(r.started_at for r in rerun) - killed_at
    print(f"\nkill -9 recovery: {len(rerun)} jobs restarted on the survivor {recovery:.2f}s after the kill "
          f"(visibility timeout {TEST_VISIBILITY_TIMEOUT}s)")
    assert recovery < 2 * TEST_VISIBILITY_TIMEOUT + 2
    wait_for(lambda: all(h.id in result_log.counts for h in handles), 10, "every result notification")
    assert {h.id: result_log.counts[h.id] for h in handles} == {h.id: 1 for h in handles}
    wait_for(lambda: broker.hlen("unacked") == 0, 10, "every message acked")


def test_job_that_keeps_killing_workers_is_dead_lettered(redis_server: RedisServer, start_worker) -> None:
    client = Client(redis_server.url)
    broker = redis_server.client()
    poison = client.submit(id=f"poison-{uuid.uuid4().hex}", prompt="poison", max_tokens=3000, ignore_eos=True)
    deliveries = DELIVERIES_KEY.format(job_id=poison.id)
    limit = 2
    for attempt in range(1, limit + 1):  # each worker that takes the job dies while running it
        worker = start_worker(redis_server.url, f"victim{attempt}", max_deliveries=limit).wait_ready()
        wait_for(lambda: int(broker.get(deliveries) or 0) == attempt, 60, f"delivery {attempt} of the poison job")
        worker.kill()

    start_worker(redis_server.url, "last", max_deliveries=limit).wait_ready()
    result = client.results([poison], timeout=60)[0]
    assert (result.status, result.error.code) == ("failed", "dead_letter")
    assert result.attempt == limit + 1 and result.usage is None
    dead = client.dead_letters()
    assert [entry["job"]["id"] for entry in dead] == [poison.id] and dead[0]["deliveries"] == limit + 1
    assert client.submit(prompt="the next job runs", max_tokens=2).result(timeout=60).ok


def _engine_pid(worker_pid: int) -> int:
    """The worker's engine process (a multiprocessing "spawn" child, beside multiprocessing's resource tracker)."""
    pids = [pid for pid in child_pids(worker_pid) if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes()]
    assert len(pids) == 1, f"expected one engine process under {worker_pid}, found {pids}"
    return pids[0]


def test_engine_process_death_stops_the_worker_and_its_jobs_are_redelivered(redis_server: RedisServer, start_worker) -> None:
    client = Client(redis_server.url)
    broker = redis_server.client()
    doomed = start_worker(redis_server.url, "doomed").wait_ready()
    handles = client.submit_many([{"prompt": f"engine dies {i}", "max_tokens": 400, "ignore_eos": True} for i in range(10)])
    wait_for(lambda: broker.zcard("unacked_index") == 10, 30, "jobs in flight")

    os.kill(_engine_pid(doomed.process.pid), signal.SIGKILL)

    assert doomed.process.wait(timeout=30) == FATAL_EXIT_CODE  # no half-alive worker holding jobs
    start_worker(redis_server.url, "next").wait_ready()
    results = client.results(handles, timeout=120)
    assert all(r.ok and r.attempt == 2 and r.worker.startswith("next@") for r in results)
