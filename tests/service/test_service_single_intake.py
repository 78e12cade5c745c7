"""Single jobs on the intake thread (`tokenmill.worker.intake`), with real redis-server and worker processes on
builtin:tiny: held by one thread instead of a pool thread each, yet active in `celery inspect`, kept by their
leases, and each stored once; the jobs the intake leaves to the pool path beside them end as they do alone.
"""

from __future__ import annotations

import os
import socket
import threading
import time

from service_fixtures import TEST_VISIBILITY_TIMEOUT, RedisServer, ResultLog, engine_pid, stopped, wait_for

from tokenmill.client import Client
from tokenmill.queue.names import DEFAULT_QUEUE, DELIVERIES_KEY, TASK_NAME
from tokenmill.queue.settings import QueueSettings
from tokenmill.worker.app import create_app

SHORT = {"max_tokens": 2, "temperature": 0.0, "ignore_eos": True}


def _threads(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/task"))


def _settled_threads(pid: int) -> int:
    """The thread count once it holds for half a second (a thread serving a metrics scrape, say, comes and goes)."""
    count = _threads(pid)
    for _ in range(20):
        time.sleep(0.5)
        count, before = _threads(pid), count
        if count == before:
            break
    return count


def _active_ids(app, node: str) -> set[str]:
    replies = app.control.inspect(timeout=5, destination=[node]).active() or {}
    return {task["id"] for task in replies.get(node, []) if task["name"] == TASK_NAME}


def test_jobs_held_by_the_intake_thread_are_active_in_inspect_keep_their_leases_and_take_no_thread_each(
        redis_server: RedisServer, start_worker, result_log: ResultLog) -> None:
    """Fails on the pool path: each held job had its own pool thread (16 jobs, 16 more threads). Also: Celery's count
    of the jobs it accepted, as `celery inspect stats` shows it."""
    client = Client(redis_server.url)
    app = create_app(QueueSettings(broker_url=redis_server.url))
    worker = start_worker(redis_server.url, "intake").wait_ready().wait_listening(app)
    node = next(name for reply in app.control.ping(timeout=5) for name in reply if name.startswith("intake@"))
    assert client.submit(prompt="warm", **SHORT).result(timeout=60).ok
    threads_before = _threads(worker.process.pid)
    with stopped(engine_pid(worker.process.pid)):  # no job can finish: every one is held while the checks below run
        # Sent while the worker is stopped too, so that they wait together: its blocked take gets the first,
        # the next take all 15 others, and a take is one group (a thread each). Taken as they arrive instead, a
        # pipeline of 16 reaches Redis in a few reads, with as many takes between them.
        with stopped(worker.process.pid):
            handles = client.submit_many({"prompt": f"held {i}", **SHORT} for i in range(16))
        ids = {h.id for h in handles}
        wait_for(lambda: _active_ids(app, node) == ids, 60, "all 16 jobs active in celery inspect")
        assert _threads(worker.process.pid) - threads_before <= 2  # a group thread for each take
        time.sleep(3 * TEST_VISIBILITY_TIMEOUT)  # unrenewed, kombu's sweep would requeue them by now
        assert redis_server.client().llen(DEFAULT_QUEUE) == 0
    results = client.results(handles, timeout=60)
    assert all(r.ok and r.attempt == 1 for r in results), [(r.status, r.attempt) for r in results]
    broker = redis_server.client()
    assert [int(c) for c in broker.mget([DELIVERIES_KEY.format(job_id=h.id) for h in handles])] == [1] * 16
    wait_for(lambda: broker.hlen("unacked") == 0 and not _active_ids(app, node), 15, "every message acked, none active")
    wait_for(lambda: all(h.id in result_log.counts for h in handles), 10, "every result notification")
    assert {h.id: result_log.counts[h.id] for h in handles} == {h.id: 1 for h in handles}
    # `celery inspect stats` counts every job the intake accepted (once per group there, once per job in Celery)
    stats = app.control.inspect(timeout=5, destination=[node]).stats() or {}
    assert stats[node]["total"] == {TASK_NAME: 17}, stats.get(node, {}).get("total")


def test_one_take_of_intake_jobs_and_pool_path_jobs_each_ends_as_alone(
        redis_server: RedisServer, start_worker, result_log: ResultLog) -> None:
    """Queued before the worker starts, so one take holds them all: plain jobs (the Client's and plain Celery's
    keyword fields), the same job twice, a deadline, a Celery time limit, an ETA and a body the task cannot read."""
    client = Client(redis_server.url)
    app = create_app(QueueSettings(broker_url=redis_server.url))
    plain = [client.submit(prompt=f"plain {i}", **SHORT) for i in range(5)]
    twice = client.submit(prompt="sent twice", id="twice-1", **SHORT)
    client.submit(prompt="sent twice", id="twice-1", **SHORT)
    deadline = client.submit(prompt="with a deadline", deadline_s=60, **SHORT)
    celery_fields = app.send_task(TASK_NAME, kwargs={"prompt": "plain celery", **SHORT})
    limited = app.send_task(TASK_NAME, kwargs={"prompt": "time limited", **SHORT}, time_limit=60)
    unreadable = app.send_task(TASK_NAME, args=["a bare prompt"])
    eta_at = time.time() + 3
    later = app.send_task(TASK_NAME, kwargs={"prompt": "at its ETA", **SHORT}, countdown=3)
    assert redis_server.client().llen(DEFAULT_QUEUE) == 12

    start_worker(redis_server.url, "mixed").wait_ready()
    results = client.results([*plain, twice, deadline], timeout=90)
    assert all(r.ok and r.usage.completion_tokens == 2 for r in results), [r.error for r in results if not r.ok]
    for handle in (celery_fields, limited, later):
        value = handle.get(timeout=60)
        assert value["status"] == "succeeded" and len(value["token_ids"]) == 2 and value["id"] == handle.id
    assert later.get()["started_at"] >= eta_at - 0.01  # held until its ETA (UTC), not run at once
    bad = unreadable.get(timeout=60)
    assert bad["status"] == "failed" and bad["error"]["code"] == "invalid_job" and bad["error"]["field"] == "job"
    broker = redis_server.client()
    wait_for(lambda: broker.hlen("unacked") == 0 and broker.llen(DEFAULT_QUEUE) == 0, 15, "every message acked")
    every = [h.id for h in [*plain, twice, deadline]] + [celery_fields.id, limited.id, unreadable.id, later.id]
    wait_for(lambda: all(i in result_log.counts for i in every), 10, "every result notification")
    assert {i: result_log.counts[i] for i in every} == {i: 1 for i in every}
    assert int(broker.get(DELIVERIES_KEY.format(job_id="twice-1"))) <= 2 and client.get("twice-1").attempt == 1


def test_with_the_intake_off_every_job_takes_a_pool_thread(redis_server: RedisServer, start_worker) -> None:
    """`single_job_intake=false`: held jobs each have their own pool thread again (fails if the switch is ignored)."""
    client = Client(redis_server.url)
    worker = start_worker(redis_server.url, "pooled", extra_env={"TOKENMILL_SINGLE_JOB_INTAKE": "false"}).wait_ready()
    assert client.submit(prompt="warm", **SHORT).result(timeout=60).ok
    threads_before = _threads(worker.process.pid)
    with stopped(engine_pid(worker.process.pid)):
        handles = client.submit_many({"prompt": f"pooled {i}", **SHORT} for i in range(8))
        wait_for(lambda: _threads(worker.process.pid) - threads_before >= 7, 60, "a pool thread per held job")
    assert all(r.ok for r in client.results(handles, timeout=60))


def test_a_remote_shutdown_waits_for_the_jobs_the_intake_holds(redis_server: RedisServer, start_worker,
                                                              result_log: ResultLog) -> None:
    """Celery's `shutdown` command sends no signal: the intake still drains (found in review: it drained on SIGTERM
    only, and the process exited with the held jobs unfinished and their messages unacked)."""
    client = Client(redis_server.url)
    app = create_app(QueueSettings(broker_url=redis_server.url))
    worker = start_worker(redis_server.url, "remote", remote_control_writes=True).wait_ready().wait_listening(app)
    node = next(name for reply in app.control.ping(timeout=5) for name in reply if name.startswith("remote@"))
    assert client.submit(prompt="warm", **SHORT).result(timeout=60).ok
    with stopped(engine_pid(worker.process.pid)):
        handles = client.submit_many({"prompt": f"held {i}", **SHORT} for i in range(6))
        ids = {h.id for h in handles}
        wait_for(lambda: _active_ids(app, node) == ids, 60, "all 6 jobs held by the intake")
        app.control.broadcast("shutdown", destination=[node], reply=True, timeout=10)
    assert worker.process.wait(timeout=60) == 0
    results = [client.get(h.id) for h in handles]
    assert all(r is not None and r.ok and r.attempt == 1 for r in results), results
    broker = redis_server.client()
    assert broker.hlen("unacked") == 0 and broker.llen(DEFAULT_QUEUE) == 0


def test_a_worker_refills_half_its_engine_queue_at_once(redis_server: RedisServer, start_worker) -> None:
    """`tokenmill worker` hands `WorkerSettings.take_at_least` to its transport: with `--max-num-seqs 64` it holds
    80 jobs and takes more once 8 have ended (`celery inspect conf` shows what the worker's app runs with)."""
    app = create_app(QueueSettings(broker_url=redis_server.url))
    start_worker(redis_server.url, "refill").wait_ready().wait_listening(app)
    replies = app.control.inspect(timeout=5).conf() or {}
    (conf,) = [reply for node, reply in replies.items() if node.startswith("refill@")]
    assert conf["broker_transport_options"]["take_at_least"] == 8


def test_lone_jobs_on_an_idle_worker_are_admitted_on_the_consumers_loop(redis_server: RedisServer, start_worker) -> None:
    """One small job at a time, each the only one running: admitted where the consumer's loop delivered it, with no
    group thread. Fails where every group is handed to a thread: the first lone job starts one, kept for later
    groups. A large lone job (tokenized and piped to the engine by whoever admits it) still gets a group thread."""
    from tokenmill.worker.intake import LOOP_ADMISSION_MAX_BYTES

    client = Client(redis_server.url)
    worker = start_worker(redis_server.url, "lone").wait_ready()
    threads_before = _settled_threads(worker.process.pid)
    for i in range(5):
        assert client.submit(prompt=f"lone {i}", **SHORT).result(timeout=60).ok
        # The job's group ends on the finisher thread just after its stored result is published: a job that reached
        # the worker before that was not alone (on a loaded machine, 2 of 4 runs here without this pause).
        time.sleep(0.5)
    assert _settled_threads(worker.process.pid) - threads_before == 1  # the finisher's
    large = client.submit(prompt="lone and large", metadata={"pad": "x" * LOOP_ADMISSION_MAX_BYTES}, **SHORT)
    assert large.result(timeout=60).ok
    assert _settled_threads(worker.process.pid) - threads_before == 2  # and a group thread


def test_a_lone_job_admitted_on_the_loop_does_not_wait_on_the_engine_s_pipe(redis_server: RedisServer,
                                                                            start_worker) -> None:
    """The engine frozen while a pool-path job's message, more than the pipe holds, is being written to it: a lone job
    admitted on the consumer's loop then only queues its own message for the pipe, and the loop goes on (it answers a
    ping, as it renews leases and acks). Fails where the loop's write waited behind the pool thread's: no answer."""
    client = Client(redis_server.url)
    broker = redis_server.client()
    app = create_app(QueueSettings(broker_url=redis_server.url))
    worker = start_worker(redis_server.url, "piped").wait_ready()
    node = f"piped@{socket.gethostname()}"
    assert app.control.ping(destination=[node], timeout=10)
    with stopped(engine_pid(worker.process.pid)):
        # `deadline_s` takes the pool path; its token ids go to the engine as they are: several times what the pipe
        # holds
        big = client.submit(prompt_token_ids=[5] * 300_000, max_tokens=1, deadline_s=600)
        wait_for(lambda: broker.hlen("unacked") == 1, 30, "the big job taken")
        time.sleep(2)  # its write under way, the pipe full
        lone = client.submit(prompt="lone while the pipe is full", **SHORT)
        wait_for(lambda: broker.hlen("unacked") == 2, 30, "the lone job taken")
        time.sleep(1)  # admitted on the loop
        assert app.control.ping(destination=[node], timeout=5), "the consumer's loop waited on the engine's pipe"
    assert lone.result(timeout=60).ok
    client.results([big], timeout=60)  # ended too (refused by the engine: longer than the model)


class _EventReceiver:
    """Celery's task events as Flower receives them: an event receiver on the broker, in a thread of its own."""

    def __init__(self, app) -> None:
        self.seen: list[dict] = []
        self._connection = app.connection_for_read()
        self._receiver = app.events.Receiver(self._connection, handlers={"*": self.seen.append})
        self._thread = threading.Thread(target=self._receiver.capture, kwargs={"limit": None, "timeout": None},
                                        daemon=True)
        self._thread.start()

    def of(self, job_id: str) -> list[str]:
        return [event["type"] for event in list(self.seen) if event.get("uuid") == job_id]

    def close(self) -> None:
        self._receiver.should_stop = True
        self._thread.join(10)
        self._connection.release()


def test_flower_sees_a_single_jobs_task_events_once_it_turns_them_on(redis_server: RedisServer, start_worker) -> None:
    """With task events off (the default), a job sends none; `celery control enable_events`, as Flower sends it, turns
    them on for the next jobs: received, started and succeeded (with its result), the events of Celery's pool path; off
    again, none. Fails if the intake decides once, at its first job, whether to send them."""
    client = Client(redis_server.url)
    app = create_app(QueueSettings(broker_url=redis_server.url))
    start_worker(redis_server.url, "events").wait_ready().wait_listening(app)
    node = next(name for reply in app.control.ping(timeout=5) for name in reply if name.startswith("events@"))
    events = _EventReceiver(app)
    try:
        wait_for(lambda: any(e["type"] == "worker-heartbeat" for e in list(events.seen)), 30, "a worker heartbeat")
        quiet = client.submit(prompt="no events yet", **SHORT)
        assert quiet.result(timeout=60).ok
        # its result is published before the finisher settles it (`task-succeeded` is sent then, if events are on)
        wait_for(lambda: quiet.id not in _active_ids(app, node), 15, "the first job settled")
        app.control.enable_events(reply=True, timeout=5)  # answered once the worker's dispatcher sends task events
        watched = client.submit(prompt="with events", **SHORT)
        assert watched.result(timeout=60).ok
        wanted = ["task-received", "task-started", "task-succeeded"]
        wait_for(lambda: events.of(watched.id) == wanted, 30, "the job's three task events")
        succeeded = next(e for e in events.seen if e.get("uuid") == watched.id and e["type"] == "task-succeeded")
        assert watched.id in succeeded["result"] and succeeded["runtime"] >= 0
        app.control.disable_events(reply=True, timeout=5)
        after = client.submit(prompt="events off again", **SHORT)
        assert after.result(timeout=60).ok
        time.sleep(2)  # events would have come by now (the watched job's came within its result's wait)
        assert events.of(quiet.id) == [] and events.of(after.id) == []
    finally:
        events.close()
