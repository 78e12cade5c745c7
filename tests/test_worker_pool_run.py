"""A single job on Celery's pool is the group pipeline run for a group of one (`tokenmill.worker.batch_task.PoolRun`):
its result goes back to Celery, a cancelled one is stored here as REVOKED, a delivery of a job running here waits for
that run, and the message's Celery time limit is the job's deadline. On a fake service: no Redis, no engine."""

from __future__ import annotations

import json
import threading
from concurrent.futures import Future
from types import SimpleNamespace
from typing import Any

import pytest
from celery.exceptions import Ignore

from tokenmill.queue.schemas import Job
from tokenmill.worker.admission import Attempt, Decision, Run, Stored


class _Backend:
    serializer = "json"
    READY_STATES = frozenset({"SUCCESS", "REVOKED"})
    app = SimpleNamespace(timezone=None)

    def get_key_for_task(self, task_id: str) -> bytes:
        return f"celery-task-meta-{task_id}".encode()

    def current_task_children(self, request: Any) -> list[Any]:
        return []


class _Counter:
    def inc(self, n: int = 1) -> None:
        pass

    dec = inc


class _Service:
    """What `PoolRun` asks of `WorkerService`, recorded."""

    def __init__(self, decision: Decision = Run(), answer: dict[str, Any] | None = None) -> None:
        self.decision, self.answer = decision, answer
        self.running: dict[str, Future] = {}
        self.admitted: list[Attempt] = []
        self.stored: dict[bytes, bytes] = {}
        self.released: list[tuple[list[str], Any, Any]] = []
        self.grace_expired = threading.Event()
        self.metrics = SimpleNamespace(jobs_in_flight=_Counter())
        self.engine = SimpleNamespace(cancel=lambda *a: None, abort=lambda *a: None)

    def claim(self, jobs: list[Job]) -> tuple[list[Job], list[tuple[Job, Future]]]:
        return [j for j in jobs if j.id not in self.running], [(j, self.running[j.id]) for j in jobs if j.id in self.running]

    def release(self, jobs: list[Job], results: Any = None, error: Any = None) -> None:
        self.released.append(([job.id for job in jobs], results, error))

    def admit_one(self, run: Attempt, key: bytes) -> tuple[Decision, tuple[Future | None, str] | None]:
        self.admitted.append(run)
        if not isinstance(self.decision, Run):
            return self.decision, None
        future: Future = Future()
        future.set_result("engine output")
        return self.decision, (future, f"{run.job.id}#0")

    def settle(self, run: Attempt, decision: Decision) -> dict[str, Any] | None:
        return None  # Stored

    def complete(self, run: Attempt, output: Any = None, error: Any = None) -> dict[str, Any]:
        assert output == "engine output"
        return dict(self.answer or {"id": run.job.id, "status": "succeeded"})

    def joined_another(self, job: Job, result: dict[str, Any]) -> bool:
        return result.get("job_hash") not in (None, job.content_hash())

    def store_results(self, encoded: dict[bytes, bytes], acks: Any = ()) -> None:
        self.stored.update(encoded)


def _run(service: _Service, time_limit: float | None = None) -> Any:
    from tokenmill.worker.batch_task import PoolRun

    return PoolRun(service, "job-1", _Backend(), time_limit).run_one(Job.from_wire({"id": "job-1", "prompt": "x"}))


def test_a_lone_job_runs_and_its_result_goes_back_to_celery() -> None:
    service = _Service()
    assert _run(service, time_limit=30.0) == {"id": "job-1", "status": "succeeded"}
    (attempt,) = service.admitted
    assert attempt.time_limit == 30.0 and attempt.deadline == pytest.approx(attempt.started_at + 30.0)
    assert service.stored == {}  # Celery's tracer stores it
    assert service.released == [(["job-1"], {"job-1": {"id": "job-1", "status": "succeeded"}}, None)]


def test_a_cancelled_result_is_stored_here_as_revoked_and_celery_stores_nothing() -> None:
    service = _Service(answer={"id": "job-1", "status": "cancelled", "text": "par"})
    with pytest.raises(Ignore):
        _run(service)
    (stored,) = service.stored.values()
    assert json.loads(stored)["status"] == "REVOKED"


def test_a_job_found_stored_is_not_run_and_celery_stores_nothing() -> None:
    service = _Service(decision=Stored(None))
    with pytest.raises(Ignore):
        _run(service)
    assert service.stored == {} and service.released == [(["job-1"], {}, None)]


@pytest.mark.parametrize(("joined", "returned"), [
    ({"id": "job-1", "status": "succeeded"}, True),
    (None, False),  # that run found the result stored
    ({"id": "job-1", "status": "cancelled"}, False),  # that run stored it
    ({"id": "job-1", "status": "succeeded", "job_hash": "f" * 64}, False),  # another job's run under this id
])
def test_a_delivery_of_a_job_running_here_waits_for_that_run(joined: dict[str, Any] | None, returned: bool) -> None:
    service = _Service()
    service.running["job-1"] = future = Future()
    threading.Timer(0.05, future.set_result, args=(joined,)).start()
    if returned:
        assert _run(service) == joined
    else:
        with pytest.raises(Ignore):
            _run(service)
    assert service.admitted == []  # not a delivery to count
