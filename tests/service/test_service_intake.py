"""The batched intake path, with real redis-server and worker processes on builtin:tiny: messages taken several
at a time (one take script, one record script), their check-ins, results and acks in shared calls.

A batch of taken messages is built by queueing everything before the worker starts: its first take moves up to
`TAKE_MAX` messages at once, so the malformed item, the finished duplicate and the cancelled job below are all in
one take with ordinary jobs. Each must end as it does alone, and the ordinary jobs beside them must not suffer.
"""

from __future__ import annotations

import time

from service_fixtures import RedisServer, ResultLog, wait_for

from tokenmill.client import Client, JobCancelledError
from tokenmill.queue.names import DEFAULT_QUEUE, DELIVERIES_KEY
from tokenmill.queue.transport import MALFORMED_KEY, TAKE_MAX

SHORT = {"max_tokens": 2, "temperature": 0.0, "ignore_eos": True}
LONGER = {"max_tokens": 32, "temperature": 0.0, "ignore_eos": True}  # 400 of them take seconds: a kill finds some


def test_a_taken_batch_with_a_malformed_message_a_finished_duplicate_and_a_cancelled_job(
        redis_server: RedisServer, start_worker, result_log: ResultLog) -> None:
    client = Client(redis_server.url)
    broker = redis_server.client()
    first = start_worker(redis_server.url, "first").wait_ready()
    finished = client.submit(prompt="finished once already", id="dup-1", **SHORT).result(timeout=60)
    first.terminate()
    wait_for(lambda: result_log.counts.get("dup-1") == 1, 10, "the first result's notification")

    # queued while no worker runs, so the next worker takes them in one batch
    ordinary = [client.submit(prompt=f"ordinary {i}", **SHORT) for i in range(6)]
    client.submit(prompt="finished once already", id="dup-1", **SHORT)  # the same job again: idempotent
    broker.lpush(DEFAULT_QUEUE, b"\x00 not a kombu message")
    cancelled = client.submit(prompt="cancelled after a worker took it once", id="cancelled-1", **SHORT)
    broker.incr(DELIVERIES_KEY.format(job_id="cancelled-1"))  # as if a worker had started it and died
    assert client.cancel("cancelled-1") == {"cancelled-1": "cancelling"}  # marked; no worker is told
    ordinary += [client.submit(prompt=f"ordinary {i}", **SHORT) for i in range(6, 12)]
    assert broker.llen(DEFAULT_QUEUE) == 15 <= TAKE_MAX

    second = start_worker(redis_server.url, "second").wait_ready()
    results = client.results(ordinary, timeout=90)
    assert all(r.ok and r.usage.completion_tokens == 2 for r in results), [r.error for r in results if not r.ok]
    assert {r.worker.split("@")[0] for r in results} == {"second"}
    try:
        cancelled.result(timeout=30)
        raise AssertionError("the cancelled job ran")
    except JobCancelledError as exc:
        assert exc.result.error.code == "cancelled" and not exc.result.token_ids
    again = client.get("dup-1")
    assert again.worker == finished.worker and again.finished_at == finished.finished_at  # not run or stored again
    assert broker.lrange(MALFORMED_KEY, 0, -1) == [b"\x00 not a kombu message"]
    wait_for(lambda: broker.hlen("unacked") == 0 and broker.llen(DEFAULT_QUEUE) == 0, 15, "every message acked")
    wait_for(lambda: all(h.id in result_log.counts for h in ordinary) and "cancelled-1" in result_log.counts, 10,
             "every result notification")
    assert {job_id: result_log.counts[job_id] for job_id in [h.id for h in ordinary] + ["dup-1", "cancelled-1"]} == \
        {job_id: 1 for job_id in [h.id for h in ordinary] + ["dup-1", "cancelled-1"]}
    assert second.process.poll() is None


def test_kill_9_while_a_batched_result_store_is_in_flight_loses_nothing_and_stores_nothing_twice(
        redis_server: RedisServer, start_worker, result_log: ResultLog) -> None:
    """Redis is paused for writes once results are being stored, so the worker's next store (a script for all
    the jobs that finished together) and its acks wait inside Redis; the worker is killed with them in flight.
    The store runs whole or not at all: a survivor skips each job whose result is stored and runs the rest."""
    client = Client(redis_server.url)
    broker = redis_server.client()
    doomed = start_worker(redis_server.url, "doomed").wait_ready()
    handles = client.submit_many([{"prompt": f"job {i}", **LONGER} for i in range(400)])
    wait_for(lambda: len(result_log.counts) >= 20, 90, "the first stored results")
    broker.execute_command("CLIENT", "PAUSE", 30_000, "WRITE")
    try:
        time.sleep(1.0)  # the worker's next stores and acks are sent and held by the pause
        stored_before = len(result_log.counts)
        doomed.kill_with_children()
    finally:
        broker.execute_command("CLIENT", "UNPAUSE")
    assert stored_before < len(handles), "every job had finished before the kill: nothing was in flight"

    start_worker(redis_server.url, "survivor").wait_ready()
    results = client.results(handles, timeout=180)
    assert all(r.ok and r.usage.completion_tokens == 32 for r in results), [r.error for r in results if not r.ok]
    wait_for(lambda: all(h.id in result_log.counts for h in handles), 10, "every result notification")
    assert {h.id: result_log.counts[h.id] for h in handles} == {h.id: 1 for h in handles}
    assert {r.worker.split("@")[0] for r in results} == {"doomed", "survivor"}
    wait_for(lambda: broker.hlen("unacked") == 0 and broker.llen(DEFAULT_QUEUE) == 0, 30, "every message acked")
