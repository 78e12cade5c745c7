"""A group message whose run fails outside the engine (a Redis error at check-in) is requeued, never acked without
its jobs' results: a real worker, a real redis-server, a check-in that Redis itself refuses."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from service_fixtures import RedisServer, Worker, wait_for

from tokenmill.client import Client, JobHandle
from tokenmill.queue.names import BATCH_TASK_NAME, DELIVERIES_KEY
from tokenmill.queue.schemas import Job, content_hash


@pytest.fixture(scope="module")
def worker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[RedisServer, Worker, Client]]:
    root: Path = tmp_path_factory.mktemp("group-errors")
    redis_server = RedisServer(root / "redis")
    redis_server.start()
    worker = Worker(redis_server.url, root / "worker.log", "grouperr", {})
    client = Client(redis_server.url)
    try:
        worker.wait_ready()
        yield redis_server, worker, client
    finally:
        client.close()
        worker.close()
        redis_server.kill()


def test_a_group_whose_check_in_redis_refuses_is_requeued_and_runs_once_redis_accepts(worker) -> None:
    redis_server, process, client = worker
    broker = redis_server.client()
    jobs = [Job.from_wire({"id": f"row-{uuid.uuid4().hex}", "prompt": f"group {i}", "max_tokens": 3}).to_wire()
            for i in range(2)]
    # INCR of a delivery count that is no integer: Redis refuses the whole check-in script (a ResponseError, as
    # OOM or READONLY would be), while taking and acking messages still work
    poisoned = DELIVERIES_KEY.format(job_id=jobs[0]["id"])
    broker.set(poisoned, "not a number")
    app = client.app
    with app.producer_or_acquire() as producer:
        message = app.amqp.as_task_v2(uuid.uuid4().hex, BATCH_TASK_NAME, args=[{"jobs": jobs}], kwargs={},
                                      ignore_result=True)
        app.amqp.send_task_message(producer, BATCH_TASK_NAME, message, queue=client.queue)
    wait_for(lambda: "ResponseError" in process.log_text(), 60, "the worker to meet Redis's refusal")
    handles = [JobHandle(job["id"], client, content_hash(job)) for job in jobs]
    assert [handle.get() for handle in handles] == [None, None]

    broker.delete(poisoned)  # Redis accepts the check-in again: the requeued group runs
    assert all(handle.result(timeout=60).ok for handle in handles)
    assert int(broker.get(DELIVERIES_KEY.format(job_id=jobs[1]["id"]))) == 1  # counted only by the check-in that ran
