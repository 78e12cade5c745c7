"""The queue's promises under faults, with real redis-server and worker processes: no job lost to
kill -9 or Redis restarts at any moment, no malformed raw item stops a worker or makes it reconnect,
and reconnects charge no deliveries to the jobs running through them."""

from __future__ import annotations

import base64
import json
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from service_fixtures import (
    RedisServer,
    Worker,
    broker_connects,
    drop_client_connections,
    run_with_faults,
    wait_for,
)

from tokenmill.client import Client
from tokenmill.queue.names import DELIVERIES_KEY
from tokenmill.queue.transport import CONSUMERS_KEY, MALFORMED_KEY

SECRET = f"never-logged-{uuid.uuid4().hex}"


def test_kill_9_and_redis_restarts_at_random_moments_lose_no_job(redis_server: RedisServer, start_worker) -> None:
    jobs = [{"prompt": f"fault {i} {SECRET}", "max_tokens": 12 + i % 24, "ignore_eos": True, "temperature": 0.0}
            for i in range(300)]
    run = run_with_faults(redis_server, start_worker, jobs, workers=2, kills=2, restarts=2, seed=8, timeout=240)
    print(f"\nfault run: {run}")
    assert run.lost == [] and run.failed == [] and run.succeeded == len(jobs)
    assert run.workers_died == []  # nobody died of a Redis restart
    broker = redis_server.client()
    wait_for(lambda: broker.llen("tokenmill") == 0 and broker.hlen("unacked") == 0, 60, "queue drained and every message acked")
    assert broker.hlen(CONSUMERS_KEY) <= 2 * len(jobs)  # processing lists of dead consumers were cleared


# -- malformed raw items on the Redis list --------------------------------------------------------


def _genuine(client: Client) -> dict[str, Any]:
    """A real Celery message for a job, taken off a scratch queue so a test can tamper with it."""
    scratch = Client(client.settings.broker_url, queue=f"scratch-{uuid.uuid4().hex}")
    scratch.submit(prompt=SECRET, max_tokens=2)
    message = json.loads(client.app.backend.client.rpop(scratch.queue))
    message["properties"]["delivery_info"]["routing_key"] = client.queue
    return message


def _with(change: Callable[[dict[str, Any]], None]) -> Callable[[Client], bytes]:
    def build(client: Client) -> bytes:
        message = _genuine(client)
        change(message)
        return json.dumps(message).encode()

    return build


MALFORMED: dict[str, Callable[[Client], bytes]] = {
    "not JSON": lambda client: b"this is not json " + SECRET.encode(),
    "truncated JSON": lambda client: json.dumps(_genuine(client)).encode()[:150],
    "a JSON array": lambda client: json.dumps([SECRET, 1, 2]).encode(),
    "properties as a string": _with(lambda m: m.update(properties=SECRET)),
    "body not base64": _with(lambda m: m.update(body="this is not base64 " + SECRET)),
    "headers as a list": _with(lambda m: m.update(headers=[SECRET])),
    "{}": lambda client: b"{}",
    "no delivery_tag": _with(lambda m: m["properties"].pop("delivery_tag")),
    "JSON nested too deep to decode": lambda client: b"[" * 1100 + b"]" * 1100,
    "a kombu __type__ with a bad value": lambda client: b'{"__type__": "bytes", "__value__": 1}',
}


@pytest.fixture(scope="module")
def lone_worker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[RedisServer, Worker, Client]]:
    root = tmp_path_factory.mktemp("malformed")
    server = RedisServer(root / "redis")
    server.start()
    worker = Worker(server.url, root / "worker.log", "lone", {})
    try:
        worker.wait_ready()
        yield server, worker, Client(server.url)
    finally:
        worker.close()
        server.kill()


@pytest.mark.parametrize("kind", list(MALFORMED))
def test_malformed_raw_item_is_set_aside_without_stopping_or_reconnecting(lone_worker, kind: str) -> None:
    server, worker, client = lone_worker
    broker = server.client()
    item = MALFORMED[kind](client)
    connects = broker_connects(worker)
    kept = broker.llen(MALFORMED_KEY)

    broker.lpush(client.queue, item)
    after = client.submit(prompt="the next job runs", max_tokens=3).result(timeout=60)

    assert after.ok and worker.process.poll() is None
    assert broker_connects(worker) == connects, "the consumer reconnected"
    assert broker.llen(MALFORMED_KEY) == kept + 1 and broker.lindex(MALFORMED_KEY, 0) == item
    assert "discarded a malformed message" in worker.log_text()
    assert SECRET not in worker.log_text()
    wait_for(lambda: broker.hlen("unacked") == 0 and broker.llen(client.queue) == 0, 10, "nothing left in flight")


# -- reconnects ------------------------------------------------------------------------------------


def test_long_job_rides_out_consumer_reconnects_without_being_charged_deliveries(
    redis_server: RedisServer, start_worker, tmp_path: Path
) -> None:
    """`max_deliveries=1`: one charged redelivery would dead-letter the job."""
    worker = start_worker(redis_server.url, "steady", max_deliveries=1).wait_ready()
    client = Client(redis_server.url)
    broker = redis_server.client()
    job = client.submit(prompt="a long job", max_tokens=3000, ignore_eos=True)
    deliveries = DELIVERIES_KEY.format(job_id=job.id)
    wait_for(lambda: broker.get(deliveries) == b"1", 60, "the job to start")

    for reconnect in range(3):
        connects = broker_connects(worker)
        assert job.get() is None, f"the job finished before reconnect {reconnect + 1}: make it longer"

        def reconnected() -> bool:  # drop again until the consumer's own connection was among those dropped
            if broker_connects(worker) > connects:
                return True
            drop_client_connections(redis_server)
            return False

        wait_for(reconnected, 60, f"reconnect {reconnect + 1}", interval=1.0)

    result = job.result(timeout=300)
    assert result.ok and result.attempt == 1 and result.usage.completion_tokens == 3000
    assert broker.get(deliveries) == b"1"
    assert worker.process.poll() is None
    wait_for(lambda: broker.hlen("unacked") == 0 and broker.llen(client.queue) == 0, 10, "the job acked, not requeued")


def test_job_from_a_plain_celery_app_goes_through_the_reliable_transport(lone_worker) -> None:
    """A team's own Celery app (kombu's stock Redis transport, no tokenmill settings) only publishes; the
    worker takes its message through tokenmill's transport like any other (BLMOVE + atomic record)."""
    from celery import Celery

    server, worker, _ = lone_worker
    plain = Celery("theirs", broker=server.url, backend=server.url, set_as_current=False)
    assert plain.connection_for_write().transport_cls == "redis"
    result = plain.send_task("tokenmill.generate", kwargs={"prompt": "from a plain Celery app", "max_tokens": 4},
                             queue="tokenmill").get(timeout=60)
    assert result["status"] == "succeeded" and result["usage"]["completion_tokens"] == 4
    assert "Connected to tokenmill.queue.transport:Transport" in worker.log_text()
    assert server.client().hlen(CONSUMERS_KEY) >= 1  # the worker's processing list, registered
    plain.close()


# -- what a worker executes -------------------------------------------------------------------------


def test_celery_builtin_task_sent_raw_is_refused_not_run(lone_worker) -> None:
    server, worker, client = lone_worker
    message = _genuine(client)
    task_id = message["headers"]["id"]
    message["headers"]["task"] = "celery.chord_unlock"
    server.client().lpush(client.queue, json.dumps(message))
    refused = wait_for(lambda: client.get(task_id), 60, "the refusal to be recorded")
    assert refused.status == "failed" and "NotRegistered" in refused.error.message
    assert "celery.chord_unlock" in refused.error.message
    assert "a task this worker does not run" in worker.log_text() and worker.process.poll() is None


@pytest.mark.parametrize("task_id", ["has spaces", "../../etc", "x" * 200, "-leading-dash", "line\nbreak"])
def test_task_id_that_is_not_a_valid_job_id_is_refused(lone_worker, task_id: str) -> None:
    server, worker, client = lone_worker
    message = _genuine(client)
    args, kwargs, embed = json.loads(base64.b64decode(message["body"]))
    args[0]["id"] = message["headers"]["id"] = task_id
    message["body"] = base64.b64encode(json.dumps([args, kwargs, embed]).encode()).decode()
    broker = server.client()
    broker.lpush(client.queue, json.dumps(message))
    assert client.submit(prompt="the next job runs", max_tokens=2).result(timeout=60).ok
    assert "the task id does not match" in worker.log_text()
    # not run, and answered: the only key naming it is its failed result (the sender does not wait forever)
    assert broker.keys(f"*{task_id}*") == [f"celery-task-meta-{task_id}".encode()]
    assert json.loads(broker.get(f"celery-task-meta-{task_id}"))["status"] == "FAILURE"
    assert broker.get(DELIVERIES_KEY.format(job_id=task_id)) is None
    wait_for(lambda: broker.hlen("unacked") == 0, 10, "nothing left in flight")  # the next job acks after its result


@pytest.mark.parametrize("timelimit", [5, [1, 2, 3], "soon"])
def test_task_with_a_bad_timelimit_header_is_refused(lone_worker, timelimit) -> None:
    """Celery unpacks `timelimit` only when the job starts, outside any guard: a bad one stopped the worker."""
    server, worker, client = lone_worker
    message = _genuine(client)
    message["headers"]["timelimit"] = timelimit
    server.client().lpush(client.queue, json.dumps(message))
    assert client.submit(prompt="the next job runs", max_tokens=2).result(timeout=60).ok
    assert "the 'timelimit' header is not" in worker.log_text() and worker.process.poll() is None
