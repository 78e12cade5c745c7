"""A run's requeues with Redis down have one bound for the whole run, whatever its size (`intake.REQUEUE_SECONDS`).

Real messages, taken through tokenmill's transport from a real redis-server (recorded as unacked there), in real
Celery requests; then the redis-server is stopped. One thing is not the worker's: the worker's consumer hands a
request's reject to its loop, which logs and drops a Redis error; here the reject is the message's own
(`Message.reject`), so that a requeue failing on the stopped server raises into `_requeue_rest` as it may.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from celery.worker.request import Request
from kombu import Consumer, Queue
from service_fixtures import RedisServer

from tokenmill.queue.names import DEFAULT_QUEUE, TASK_NAME
from tokenmill.queue.settings import QueueSettings
from tokenmill.worker.app import create_app
from tokenmill.worker import intake
from tokenmill.worker.intake import Intake, IntakeRun

JOBS = 20


def test_requeues_with_redis_down_stop_at_one_deadline_per_run(redis_server: RedisServer, monkeypatch: Any) -> None:
    monkeypatch.setattr(intake, "REQUEUE_SECONDS", 2.0, raising=False)
    app = create_app(QueueSettings(broker_url=redis_server.url, redis_socket_timeout=2))  # the worker's, its task too
    for i in range(JOBS):
        app.send_task(TASK_NAME, kwargs={"i": i}, task_id=f"requeue-{i}", queue=DEFAULT_QUEUE)
    connection = app.connection_for_read()
    try:
        channel = connection.default_channel
        messages: list[Any] = []
        consumer = Consumer(channel, [Queue(DEFAULT_QUEUE)], callbacks=[lambda _, m: messages.append(m)],
                            accept=["json"])
        channel.basic_qos(0, 100, False)
        consumer.consume()
        deadline = time.monotonic() + 30
        while len(messages) < JOBS and time.monotonic() < deadline:
            connection.drain_events(timeout=5)
        assert len(messages) == JOBS and redis_server.client().hlen("unacked") == JOBS
        tries: list[str] = []

        def rejecter(message: Any) -> Any:
            def on_reject(_logger: Any, _errors: Any, requeue: bool) -> None:
                tries.append(message.delivery_tag)
                message.reject(requeue=requeue)
            return on_reject

        run = IntakeRun.__new__(IntakeRun)  # the run's requests and intake only: what `_requeue_rest` reads
        run.intake = Intake()  # attached to no consumer's loop: what it is left to release, it releases at once
        run.requests = {m.headers["id"]: Request(
            m, app=app, task=app.tasks[TASK_NAME], on_reject=rejecter(m),
            connection_errors=connection.connection_errors) for m in messages}
        assert len(run.requests) == JOBS
        redis_server.stop()

        requeuing = threading.Thread(target=run._requeue_rest, args=("test",), daemon=True)
        started = time.monotonic()
        requeuing.start()
        requeuing.join(timeout=2.0 + 5)  # the run's deadline and a margin, not one per job
        assert not requeuing.is_alive(), f"still requeuing after {time.monotonic() - started:.0f}s, {len(tries)} tries"
        assert 1 <= len(tries) <= 2 + 1, tries  # a second apart until the deadline, then no more
        assert run.requests == {}
        qos = channel.qos
        assert len(qos._delivered) - len(qos._dirty) == 0  # released: no lease of them is renewed any more

        redis_server.start()  # their unacked records stayed (append-only file): the visibility timeout requeues them
        assert redis_server.client().hlen("unacked") == JOBS
    finally:
        connection.close()
