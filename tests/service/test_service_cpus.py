"""`--engine-cpus`: the engine process on CPUs of its own, the worker's threads on the others (a real worker)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from service_fixtures import RedisServer, engine_pid

from tokenmill.client import Client
from tokenmill.engine.cpu_threads import SPIN_COUNT, WAIT_VARIABLES
from tokenmill.worker.cpus import parse_cpu_list

AVAILABLE = sorted(os.sched_getaffinity(0))


def _cpus_by_thread(pid: int) -> dict[int, set[int]]:
    """Each thread's allowed CPUs (/proc's `Cpus_allowed_list`); a thread that ends while this reads is left out."""
    cpus = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            line = next(line for line in (task / "status").read_text().splitlines() if line.startswith("Cpus_allowed_list:"))
        except (OSError, StopIteration):
            continue
        cpus[int(task.name)] = parse_cpu_list(line.split(":", 1)[1])
    return cpus


@pytest.mark.skipif(len(AVAILABLE) < 2, reason="needs two CPUs")
def test_the_engine_process_runs_on_its_cpus_and_the_worker_on_the_others(redis_server: RedisServer,
                                                                          start_worker) -> None:
    engine_cpu = AVAILABLE[0]  # not "auto"'s choice (the last), so that the test tells a chosen CPU from the default
    worker = start_worker(redis_server.url, "pinned", engine_cpus=str(engine_cpu)).wait_ready()
    client = Client(redis_server.url)
    handles = client.submit_many([{"prompt": f"pinned {i}", "max_tokens": 4} for i in range(20)])
    assert all(result.ok for result in client.results(handles, timeout=120))  # the pool and group threads exist now
    engine_threads, worker_threads = _cpus_by_thread(engine_pid(worker.process.pid)), _cpus_by_thread(worker.process.pid)
    assert engine_threads and all(cpus == {engine_cpu} for cpus in engine_threads.values()), engine_threads
    rest = set(AVAILABLE) - {engine_cpu}
    assert len(worker_threads) >= 4 and all(cpus == rest for cpus in worker_threads.values()), worker_threads
    assert f"engine process on CPU {engine_cpu}, the worker on CPU " in worker.log_text()


def test_a_worker_left_as_it_is_runs_anywhere(redis_server: RedisServer, start_worker) -> None:
    worker = start_worker(redis_server.url, "free").wait_ready()
    engine_threads = _cpus_by_thread(engine_pid(worker.process.pid))
    assert all(cpus == set(AVAILABLE) for cpus in [*engine_threads.values(), *_cpus_by_thread(worker.process.pid).values()])
    assert "engine process on CPU" not in worker.log_text()


def test_engine_cpus_that_cannot_be_had_stop_the_worker_with_the_reason(redis_server: RedisServer, start_worker) -> None:
    absent = max(AVAILABLE) + 1
    for value, reason in ((str(absent), f"CPU {absent} is not available to this process"), ("2-", "is not a CPU list"),
                          (f"{AVAILABLE[0]}-{AVAILABLE[-1]}", "leaves no CPU for the worker itself")):
        worker = start_worker(redis_server.url, "refused", engine_cpus=value)
        assert worker.process.wait(timeout=60) != 0
        assert "engine-cpus" in worker.log_text() and reason in worker.log_text(), worker.log_text()[-2000:]


def test_the_engine_process_starts_with_idle_openmp_threads_spinning_briefly(redis_server: RedisServer, start_worker,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """The worker imports tokenmill.engine, never torch: the engine process it starts inherits `GOMP_SPINCOUNT`
    (tokenmill/engine/cpu_threads.py), which libgomp reads when the engine imports torch; the engine process's
    start-up lines (this one, the model implementation, the KV cache) are in the worker's log."""
    for name in WAIT_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    worker = start_worker(redis_server.url, "spin").wait_ready()
    environ = Path(f"/proc/{engine_pid(worker.process.pid)}/environ").read_bytes().split(b"\0")
    assert f"GOMP_SPINCOUNT={SPIN_COUNT}".encode() in environ
    log = worker.log_text()
    for line in (f"idle OpenMP threads spin: GOMP_SPINCOUNT={SPIN_COUNT}", "KV cache: ", "native implementation"):
        assert "INFO tokenmill.engine." in log and line in log, log[-3000:]
