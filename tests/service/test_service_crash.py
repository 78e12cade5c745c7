"""Workers that die with `kill -9`: their jobs are delivered again, each ends with exactly one result,
and a job that keeps killing workers is dead-lettered after a bounded number of deliveries."""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest
import redis
from service_fixtures import REPO, TEST_VISIBILITY_TIMEOUT, RedisServer, ResultLog, Worker, engine_pid, wait_for

from tokenmill.client import Client
from tokenmill.queue.names import DELIVERIES_KEY
from tokenmill.sampling_params import SamplingParams
from tokenmill.worker.engine_process import EngineFailure, EngineProcess
from tokenmill.worker.health import engine_problem
from tokenmill.worker.service import FATAL_EXIT_CODE


def test_kill_9_with_jobs_in_flight_loses_nothing(redis_server: RedisServer, start_worker, result_log: ResultLog) -> None:
    """`doomed` holds 20 jobs (its engine frozen, so none can finish first) and `survivor` 20 more when
    `doomed` is killed: the survivor runs all 40, each once more at most, with exactly one result each."""
    client = Client(redis_server.url)
    broker = redis_server.client()
    doomed = start_worker(redis_server.url, "doomed", concurrency=20).wait_ready()
    engine = _freeze_engine(doomed)
    held = client.submit_many(_long_jobs("held by doomed", 20))
    wait_for(lambda: _all_delivered(broker, held), 60, "doomed holding its 20 jobs")
    start_worker(redis_server.url, "survivor").wait_ready()
    own = client.submit_many(_long_jobs("survivor's own", 20))  # doomed is full: only the survivor takes these
    wait_for(lambda: _all_delivered(broker, own), 60, "the survivor running its 20 jobs")

    doomed.kill()
    os.kill(engine, signal.SIGKILL)  # frozen, it would outlive its worker
    killed_at = time.time()
    results = client.results(held + own, timeout=180)

    assert all(r.ok and r.usage.completion_tokens == 300 for r in results), [r.error for r in results if not r.ok]
    assert {r.worker.split("@")[0] for r in results} == {"survivor"}
    assert [r.attempt for r in results] == [2] * len(held) + [1] * len(own)
    recovery = min(r.started_at for r in results[: len(held)]) - killed_at
    print(f"\nkill -9 recovery: {len(held)} jobs restarted on the survivor {recovery:.2f}s after the kill "
          f"(visibility timeout {TEST_VISIBILITY_TIMEOUT}s)")
    # Typically 0.75-1x the timeout plus a sweep interval; kombu's default sweeps would take ~100 s. The bound
    # is loose so that only a lost sweep setting fails it, not a loaded machine.
    assert recovery < 15 * TEST_VISIBILITY_TIMEOUT
    wait_for(lambda: all(h.id in result_log.counts for h in held + own), 10, "every result notification")
    assert {h.id: result_log.counts[h.id] for h in held + own} == {h.id: 1 for h in held + own}
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


def _freeze_engine(worker: Worker) -> int:
    """SIGSTOP the worker's engine process, so that no job it is given can finish, however slow the machine."""
    pid = engine_pid(worker.process.pid)
    os.kill(pid, signal.SIGSTOP)
    return pid


def _long_jobs(prefix: str, count: int) -> list[dict]:
    return [{"prompt": f"{prefix} {i}", "max_tokens": 300, "ignore_eos": True, "temperature": 0.0}
            for i in range(count)]


def _all_delivered(broker: redis.Redis, handles: list) -> bool:
    """Every job counted its delivery (a worker's job thread took it) and the queue is empty."""
    counts = broker.mget([DELIVERIES_KEY.format(job_id=h.id) for h in handles])
    return broker.llen("tokenmill") == 0 and all(c is not None for c in counts)


def test_engine_process_death_stops_the_worker_and_its_jobs_are_redelivered(redis_server: RedisServer, start_worker) -> None:
    """The engine dies while the worker holds 10 jobs: the worker exits at once (a worker without an engine
    must not hold jobs), none of them ends failed, and a new worker runs each of them, on its second delivery.

    The engine is frozen before the jobs arrive and killed while frozen, so no job can finish on `doomed`
    whatever the machine's load.
    """
    client = Client(redis_server.url)
    broker = redis_server.client()
    doomed = start_worker(redis_server.url, "doomed").wait_ready()
    engine = _freeze_engine(doomed)
    handles = client.submit_many([{"prompt": f"engine dies {i}", "max_tokens": 8, "ignore_eos": True}
                                  for i in range(10)])
    wait_for(lambda: _all_delivered(broker, handles), 60, "doomed holding the 10 jobs")

    os.kill(engine, signal.SIGKILL)

    assert doomed.process.wait(timeout=60) == FATAL_EXIT_CODE  # no half-alive worker holding jobs
    assert all(client.get(h.id) is None for h in handles), "a job ended on the worker whose engine died"
    start_worker(redis_server.url, "next").wait_ready()
    results = client.results(handles, timeout=120)
    assert all(r.ok and r.usage.completion_tokens == 8 for r in results), [r.error for r in results if not r.ok]
    assert [(r.attempt, r.worker.split("@")[0]) for r in results] == [(2, "next")] * len(handles)


def test_engine_loss_reaches_on_fatal_before_any_request_fails() -> None:
    """The order that keeps a dead engine's jobs from ending as failed results: `on_fatal` (which exits the
    worker) runs while every request in flight is still pending; only after it do they fail."""
    seen: list[tuple[BaseException, bool]] = []
    engine = EngineProcess("builtin:tiny", {}, on_fatal=lambda exc: seen.append((exc, future.done())))
    engine.start(timeout=300)
    (process,) = multiprocessing.active_children()
    os.kill(process.pid, signal.SIGSTOP)  # the request below cannot finish
    future = engine.submit_many([("doomed-request", SamplingParams(max_tokens=8), None, None, None)])[0]
    os.kill(process.pid, signal.SIGKILL)

    assert isinstance(future.exception(timeout=60), EngineFailure)
    assert [(type(exc), done) for exc, done in seen] == [(EngineFailure, False)]


def test_on_fatal_runs_with_no_lock_held_and_a_send_meanwhile_waits_for_it() -> None:
    """`on_fatal` may block (the worker's logs): meanwhile the other threads' calls (abort, cancel, `stalled_for`) go
    on, and a send waits for it to return instead of failing before the worker exits."""
    entered, release = threading.Event(), threading.Event()

    def on_fatal(_: BaseException) -> None:
        entered.set()
        release.wait(60)

    engine = EngineProcess("builtin:tiny", {}, on_fatal=on_fatal)
    engine.start(timeout=300)
    (process,) = multiprocessing.active_children()
    os.kill(process.pid, signal.SIGSTOP)
    held = engine.submit_many([("held-request", SamplingParams(max_tokens=8), None, None, None)])[0]
    os.kill(process.pid, signal.SIGKILL)
    try:
        assert entered.wait(60)
        others = threading.Thread(target=lambda: (engine.abort("held-request"), engine.cancel("other", "stop"),
                                                  engine.stalled_for()), daemon=True)
        others.start()
        others.join(timeout=5)
        assert not others.is_alive(), "abort, cancel and stalled_for waited for on_fatal"
        late: list[BaseException] = []

        def send() -> None:
            try:
                engine.submit_many([("late-request", SamplingParams(max_tokens=8), None, None, None)])[0]
            except BaseException as exc:  # noqa: BLE001 - what the send raised is the test's result
                late.append(exc)

        sender = threading.Thread(target=send, daemon=True)
        sender.start()
        sender.join(timeout=1)
        assert sender.is_alive() and not late and not held.done(), "a send failed while on_fatal ran"
    finally:
        release.set()
    sender.join(timeout=10)
    assert [type(exc) for exc in late] == [EngineFailure]


_EXIT_SCRIPT = """
import logging, os, sys, threading, time
from tokenmill.worker import service

mode = sys.argv[1]
service.EXIT_WATCHDOG_SECONDS = 1.0 if mode == "blocks" else 600.0
if mode == "blocks":  # the log's pipe is full and nobody reads it: the first record written waits for good
    read, write = os.pipe()
    os.set_blocking(write, False)
    try:
        while True:
            os.write(write, b"x" * 4096)
    except BlockingIOError:
        pass
    os.set_blocking(write, True)
    handler = logging.StreamHandler(os.fdopen(write, "w"))
else:  # a handler that raises out of the logging call
    class Raising(logging.Handler):
        def handle(self, record):
            raise RuntimeError("the log handler failed")
    handler = Raising()
logging.getLogger().addHandler(handler)
threading.Thread(target=service._exit_on_engine_stall, args=("stalled",), daemon=True).start()  # as the watchdog does
time.sleep(120)
"""


@pytest.mark.parametrize("mode", ["blocks", "raises"])
def test_the_stall_exit_happens_even_if_its_logging_blocks_or_raises(mode: str) -> None:
    process = subprocess.Popen([sys.executable, "-c", _EXIT_SCRIPT, mode], cwd=REPO,
                               env={**os.environ, "PYTHONPATH": str(REPO)}, stderr=subprocess.DEVNULL)
    try:
        assert process.wait(timeout=15) == FATAL_EXIT_CODE
    finally:
        process.kill()
        process.wait()


STALL_TIMEOUT = 10.0  # long enough that a loaded machine delivers the jobs and reads the metrics before it


def test_a_worker_whose_engine_stalls_hands_its_jobs_back_and_exits(redis_server: RedisServer, start_worker) -> None:
    """The engine frozen (SIGSTOP) while the worker holds 10 jobs: the metrics and `tokenmill health` report the
    stall, then after --engine-stall-timeout the worker logs why, puts the 10 messages back on the queue and exits
    with the code a supervisor restarts. Another worker runs each job once, on its second delivery, long before the
    visibility timeout (10 minutes here) would have requeued them."""
    client = Client(redis_server.url)
    broker = redis_server.client()
    stuck = start_worker(redis_server.url, "stuck", engine_stall_timeout=STALL_TIMEOUT, visibility_timeout=600).wait_ready()
    engine = _freeze_engine(stuck)
    handles = client.submit_many([{"prompt": f"engine stalls {i}", "max_tokens": 8, "ignore_eos": True}
                                  for i in range(10)])
    wait_for(lambda: _all_delivered(broker, handles), 60, "stuck holding the 10 jobs")
    # before the watchdog's bound, the reports say why
    wait_for(lambda: stuck.metrics()["tokenmill_engine_stalled_seconds"] > 1.0, STALL_TIMEOUT - 2, "the stall's metric")
    assert engine_problem(f"http://127.0.0.1:{stuck.metrics_port}/metrics", max_age=1.0) is not None

    assert stuck.process.wait(timeout=STALL_TIMEOUT + 30) == FATAL_EXIT_CODE
    log = stuck.log_text()
    assert "sent nothing for" in log and "handed back" in log, log[-2000:]
    assert broker.llen("tokenmill") == 10, "the held messages are back on the queue, not waiting for their leases"
    assert all(client.get(h.id) is None for h in handles), "a job ended on the stalled worker"
    start_worker(redis_server.url, "next").wait_ready()
    results = client.results(handles, timeout=120)
    assert all(r.ok and r.usage.completion_tokens == 8 for r in results), [r.error for r in results if not r.ok]
    assert [(r.attempt, r.worker.split("@")[0]) for r in results] == [(2, "next")] * len(handles)
    wait_for(lambda: _gone(engine), 10, "the frozen engine process to be gone with its worker")


def _gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True

