"""`WorkerService.start` through `tokenmill.worker.runtime`, as plain `celery worker` builds it at the first job: a start
that fails leaves the process's intake unserved and nothing running, and the next build serves it. Real redis-server
and engine process (builtin:tiny); only the failure itself is forced."""

from __future__ import annotations

from typing import Any

import pytest
from service_fixtures import RedisServer

from tokenmill.worker import runtime
from tokenmill.worker.cancel_listener import CancelListener
from tokenmill.worker.service import WorkerService


def test_a_start_that_fails_leaves_the_intake_to_the_next_service(redis_server: RedisServer,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """The cancel listener fails to start once, after the engine is up: that service stops what it started and never
    serves the intake (its first job then takes the pool path); the pool path's build is a fresh service, which
    serves the same intake, and is the process's service from then on."""
    monkeypatch.setenv("TOKENMILL_BROKER_URL", redis_server.url)
    monkeypatch.setenv("TOKENMILL_MODEL", "builtin:tiny")
    monkeypatch.setenv("TOKENMILL_METRICS_PORT", "0")
    monkeypatch.setattr(runtime, "_service", None)
    monkeypatch.setattr(runtime, "_intake", None)
    built: list[WorkerService] = []
    build = WorkerService.__init__

    def recorded(self: WorkerService, *args: Any, **kwargs: Any) -> None:
        build(self, *args, **kwargs)
        built.append(self)

    failures = [RuntimeError("can't start new thread")]
    listen = CancelListener.start

    def start_once(self: CancelListener) -> None:
        if failures:
            raise failures.pop()
        listen(self)

    monkeypatch.setattr(WorkerService, "__init__", recorded)
    monkeypatch.setattr(CancelListener, "start", start_once)

    intake = runtime.intake()
    assert intake._worker_service() is None  # the first job's build failed: it takes the pool path
    assert intake.enabled is False and intake._service is None  # not left to the failed service
    assert runtime._service is None and len(built) == 1
    failed = built[0]
    assert not failed.engine._process.is_alive() and not failed.announcer.is_alive()  # nothing left running

    service = runtime.current()  # the pool path's job builds it again
    try:
        assert service is built[1] and service.intake is intake
        assert intake._worker_service() is service and intake.enabled is True
        assert runtime.current() is service and runtime.intake() is intake and len(built) == 2
        assert service.announcer.is_alive() and service.engine._process.is_alive()
    finally:
        service.close()
        service.metrics.close()  # the default registry, for the next test's worker


def test_an_engine_that_is_not_ready_in_time_is_stopped_with_the_failed_start(redis_server: RedisServer,
                                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine process is started but not ready within its start's bound (forced here to 10 ms: the model still
    loads): the start raises, and that process does not stay behind to hold the memory the next build needs."""
    from tokenmill.worker.engine_process import EngineFailure, EngineProcess
    from tokenmill.worker.settings import WorkerSettings

    started: list[EngineProcess] = []  # this test's engine: other tests of this process may have children of their own
    start = EngineProcess.start

    def start_briefly(self: EngineProcess, timeout: float = 600) -> None:
        started.append(self)
        start(self, timeout=0.01)

    monkeypatch.setattr(EngineProcess, "start", start_briefly)
    settings = WorkerSettings(broker_url=redis_server.url, model="builtin:tiny", metrics_port=0)
    with pytest.raises(EngineFailure):
        WorkerService.start(settings)
    assert len(started) == 1
    # The engine's reader thread may be reaping the process this moment (its exit message reads the exit code): a
    # process gone is reaped within the bound, one left behind is not.
    started[0]._process.join(5)
    assert started[0]._process.exitcode is not None


def test_stopping_an_engine_process_never_started_ends_its_writer_thread() -> None:
    """A start that failed before the process existed (`WorkerService.start` stops it all the same): nothing to join,
    and the pipe's writer thread, started with the handle, ends."""
    from tokenmill.worker.engine_process import EngineProcess

    engine = EngineProcess("builtin:tiny", {})
    engine.stop(timeout=1)
    engine._outbox._thread.join(5)
    assert not engine._outbox._thread.is_alive()


def test_an_engine_that_cannot_load_its_model_leaves_no_thread_or_process() -> None:
    """`start` raises `ModelLoadError` for a model that cannot be loaded as configured: the child has exited and been
    joined, and the pipe's writer thread ends, also when `stop` follows (as a failed `WorkerService.start` calls it)."""
    from tokenmill.errors import ModelLoadError
    from tokenmill.worker.engine_process import EngineProcess

    engine = EngineProcess("/nonexistent/model-dir", {})
    with pytest.raises(ModelLoadError):
        engine.start(timeout=120)
    engine.stop(timeout=1)
    engine._outbox._thread.join(5)
    assert not engine._outbox._thread.is_alive()
    assert engine._process.exitcode is not None


def test_an_engine_that_dies_loading_its_model_fails_its_start_not_the_worker() -> None:
    """The child dies before "ready" (here: an option the engine does not take): `start` raises `EngineFailure`, with
    the child joined and the pipe's threads ended, and `on_fatal` (the worker's exit) is not called meanwhile: the
    failed start is its caller's to clean up and report (`tokenmill worker` exits 70 naming it)."""
    from tokenmill.worker.engine_process import EngineFailure, EngineProcess

    fatal: list[BaseException] = []
    engine = EngineProcess("builtin:tiny", {"no_such_option": 1}, on_fatal=fatal.append)
    with pytest.raises(EngineFailure, match="died loading its model"):
        engine.start(timeout=120)
    engine.stop(timeout=1)
    engine._outbox._thread.join(5)
    engine._reader.join(5)
    assert fatal == []
    assert not engine._outbox._thread.is_alive() and not engine._reader.is_alive()
    assert engine._process.exitcode not in (None, 0)


def test_a_plain_celery_worker_whose_engine_dies_loading_exits_70_and_keeps_the_job(redis_server: RedisServer,
                                                                                   tmp_path: Any) -> None:
    """Under plain `celery worker` the first job builds the service; an engine that dies loading its model (here a
    KV cache it cannot allocate) exits the worker with 70, as any engine failure, and the job is neither failed nor
    acked: a restarted or another worker runs it."""
    import os
    import subprocess
    import sys

    from service_fixtures import REPO, wait_for

    from tokenmill.client import Client

    env = {k: v for k, v in os.environ.items() if not k.startswith("TOKENMILL_")}
    env.update(PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", TOKENMILL_BROKER_URL=redis_server.url,
               TOKENMILL_MODEL="builtin:tiny", TOKENMILL_NUM_KV_BLOCKS=str(10**12), TOKENMILL_METRICS_PORT="0")
    with open(tmp_path / "celery.log", "wb") as log:
        worker = subprocess.Popen([sys.executable, "-m", "celery", "-A", "tokenmill.worker.app", "worker", "--pool",
                                   "threads", "--concurrency", "2", "--without-mingle", "--without-gossip"],
                                  env=env, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
        try:
            with Client(redis_server.url) as client:
                job = client.submit(prompt="a job for a worker that cannot start", max_tokens=2)
                assert worker.wait(timeout=180) == 70, (tmp_path / "celery.log").read_text()[-3000:]
                assert job.get() is None
                broker = redis_server.client()
                wait_for(lambda: broker.hlen("unacked") + broker.llen(client.queue) == 1, 10, "the job held in Redis")
        finally:
            if worker.poll() is None:
                worker.kill()
                worker.wait(10)
