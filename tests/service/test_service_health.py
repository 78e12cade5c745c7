"""`tokenmill health`, the container healthcheck: healthy only while the engine serves.

Against a real worker: healthy once it is ready; a stopped (SIGSTOP) engine process makes it unhealthy
even though the worker process and its metrics endpoint still run; continued, it is healthy again.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from prometheus_client import CollectorRegistry
from service_fixtures import REPO, child_pids, free_port, wait_for

from tokenmill.worker.engine_process import EngineStatus
from tokenmill.worker.health import engine_problem
from tokenmill.worker.metrics import WorkerMetrics


def _health(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    environment = {k: v for k, v in os.environ.items() if not k.startswith("TOKENMILL_")}
    environment.update(env or {}, PYTHONPATH=str(REPO))
    return subprocess.run([sys.executable, "-m", "tokenmill.cli", "health", *args], capture_output=True, text=True,
                          timeout=60, env=environment, cwd=REPO)


def test_health_reads_the_engine_heartbeat_from_the_metrics_endpoint() -> None:
    metrics = WorkerMetrics(CollectorRegistry())
    port = free_port()
    metrics.serve(port, "127.0.0.1")
    url = f"http://127.0.0.1:{port}/metrics"
    assert "no engine status report yet" in (engine_problem(url, max_age=30) or "")
    metrics.on_engine_status(EngineStatus())
    assert engine_problem(url, max_age=30) is None
    assert "not serving" in (engine_problem(url, max_age=30, now=time.time() + 31) or "")
    done = _health(env={"TOKENMILL_METRICS_PORT": str(port)})  # the default URL comes from the worker's setting
    assert done.returncode == 0, done.stderr


def test_health_fails_when_nothing_answers() -> None:
    done = _health("--url", f"http://127.0.0.1:{free_port()}/metrics")
    assert done.returncode == 1 and "does not answer" in done.stderr
    done = _health(env={"TOKENMILL_METRICS_PORT": "0"})
    assert done.returncode == 2 and "metrics endpoint is off" in done.stderr


def test_a_worker_is_unhealthy_while_its_engine_is_stopped(redis_server, start_worker) -> None:
    worker = start_worker(redis_server.url).wait_ready()
    url = f"http://127.0.0.1:{worker.metrics_port}/metrics"
    wait_for(lambda: _health("--url", url).returncode == 0, 60, "the worker to report healthy", interval=0.5)
    # The engine is the worker's multiprocessing "spawn" child (not its resource tracker).
    (engine_pid,) = [pid for pid in child_pids(worker.process.pid) if "spawn_main" in _cmdline(pid)]
    os.kill(engine_pid, signal.SIGSTOP)
    try:
        unhealthy = wait_for(lambda: (d := _health("--url", url, "--max-age", "2")).returncode == 1 and d, 60,
                             "the health check to fail with the engine stopped", interval=0.5)
        assert "not serving" in unhealthy.stderr
        assert worker.process.poll() is None  # the process lives: a "process exists" check would pass
    finally:
        os.kill(engine_pid, signal.SIGCONT)
    wait_for(lambda: _health("--url", url, "--max-age", "2").returncode == 0, 60, "health to return", interval=0.5)


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as handle:
            return handle.read().decode(errors="replace")
    except OSError:
        return ""
