"""Cancelling jobs and deadlines, with real redis-server and worker processes on builtin:tiny.

A "long" job generates 3,000 tokens (min_tokens = max_tokens, so no early EOS): far longer than any test waits,
so a result with fewer tokens can only come from the cancel or the deadline. Workers get a KV cache that holds
two of them (`KV_BLOCKS`).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from service_fixtures import REPO, RedisServer, ResultLog, Worker, child_pids, wait_for

from tokenmill.client import Client, JobCancelledError, JobHandle
from tokenmill.queue.app import queue_app
from tokenmill.queue.names import BATCH_TASK_NAME, CANCEL_KEY, DELIVERIES_KEY, TASK_NAME
from tokenmill.queue.settings import QueueSettings

LONG = {"max_tokens": 3000, "min_tokens": 3000, "temperature": 0.0}
SHORT = {"max_tokens": 4, "min_tokens": 4, "temperature": 0.0}
KV_BLOCKS = 512  # of 16 tokens


def _generating(worker: Worker, sequences: int = 1, steps: int = 3) -> None:
    """Until the worker's engine runs `sequences` sequences and has stepped `steps` more times since."""
    wait_for(lambda: worker.metrics().get("tokenmill_running_sequences", 0) >= sequences, 90, "the jobs to run")
    start = worker.metrics()["tokenmill_engine_steps_total"]
    wait_for(lambda: worker.metrics()["tokenmill_engine_steps_total"] >= start + steps, 60, "engine steps")


def _assert_cancelled_while_running(client: Client, job_id: str, max_tokens: int = LONG["max_tokens"]) -> Any:
    with pytest.raises(JobCancelledError) as raised:
        JobHandle(job_id, client).result(timeout=90)
    result = raised.value.result
    assert result.status == "cancelled" and result.error.code == "cancelled" and result.finish_reason == "cancelled"
    assert 0 < result.usage.completion_tokens < max_tokens and len(result.token_ids) == result.usage.completion_tokens
    assert result.text is not None and result.worker is not None
    return result


def test_a_queued_job_never_starts_and_a_running_one_stops_and_frees_its_slot(
    redis_server: RedisServer, start_worker: Any, result_log: ResultLog
) -> None:
    worker = start_worker(redis_server.url, max_num_seqs=1, concurrency=2, num_kv_blocks=KV_BLOCKS).wait_ready()
    with Client(redis_server.url) as client, Client(redis_server.url, queue="unserved") as elsewhere:
        running = client.submit(prompt="a long one", **LONG)
        _generating(worker)
        after = client.submit(prompt="waits for the slot", **SHORT)  # the engine's one slot is taken: it waits
        wait_for(lambda: worker.metrics()["tokenmill_waiting_sequences"] >= 1, 60, "the second job to wait")
        queued = elsewhere.submit(prompt="never runs", **SHORT)  # no worker takes this queue

        assert client.cancel([queued, running.id]) == {queued.id: "cancelled", running.id: "cancelling"}
        with pytest.raises(JobCancelledError, match="cancelled before it started"):
            queued.result(timeout=10)  # stored by the cancel itself: nobody has to take it first
        _assert_cancelled_while_running(client, running.id)
        assert after.result(timeout=90).usage.completion_tokens == 4  # took the freed slot: it never could before

        assert client.cancel(running) == {running.id: "finished"}  # a late cancel changes nothing, and says so
        assert client.cancel(after.id) == {after.id: "finished"} and client.get(after.id).status == "succeeded"
        wait_for(lambda: worker.metrics()["tokenmill_jobs_in_flight"] == 0, 30, "the worker to hold nothing")
    assert redis_server.client().get(DELIVERIES_KEY.format(job_id=queued.id)) is None  # never started
    assert worker.metrics()["tokenmill_jobs_succeeded_total"] == 1 and worker.metrics()["tokenmill_jobs_cancelled_total"] == 1
    wait_for(lambda: len(result_log.counts) >= 3, 30, "every result announced")  # the listener thread may lag
    assert result_log.counts == {running.id: 1, after.id: 1, queued.id: 1}  # each result stored once


def test_celery_revoke_and_terminate_cancel_like_the_client(redis_server: RedisServer, start_worker: Any) -> None:
    """What Flower's buttons send: revoke(id) and revoke(id, terminate=True) both stop a running job."""
    app = queue_app(QueueSettings(broker_url=redis_server.url))
    worker = start_worker(redis_server.url, max_num_seqs=4, num_kv_blocks=KV_BLOCKS).wait_ready().wait_listening(app)
    with Client(redis_server.url) as client:
        plain, terminate = client.submit(prompt="revoke me", **LONG), client.submit(prompt="terminate me", **LONG)
        _generating(worker, sequences=2)
        # limit=1: return at the one worker's answer (a broadcast waits out its whole timeout otherwise, long
        # enough on an idle machine for the second job to finish before its revoke is even sent)
        replies = app.control.revoke(plain.id, reply=True, timeout=10, limit=1)
        assert replies and f"{plain.id}: cancelling" in str(replies)
        app.control.revoke(terminate.id, terminate=True, reply=True, timeout=10, limit=1)
        _assert_cancelled_while_running(client, plain.id)
        _assert_cancelled_while_running(client, terminate.id)
        celery_view = app.AsyncResult(plain.id)
        assert celery_view.state == "REVOKED"  # what Flower and plain Celery callers see
        with pytest.raises(Exception, match="cancelled") as raised:
            celery_view.get(timeout=5)
        assert type(raised.value).__name__ == "TaskRevokedError"


def test_a_revoke_sent_while_no_worker_takes_the_queue_is_honoured_by_a_worker_started_later(
    redis_server: RedisServer, start_worker: Any, result_log: ResultLog
) -> None:
    app = queue_app(QueueSettings(broker_url=redis_server.url))
    other = start_worker(redis_server.url, name="other", queues="elsewhere", num_kv_blocks=KV_BLOCKS)  # hears the revoke, not the job
    other.wait_ready().wait_listening(app)
    with Client(redis_server.url, queue="later") as client:
        job = client.submit(prompt="revoked before any worker took it", **SHORT)
        app.control.revoke(job.id)
        wait_for(lambda: app.AsyncResult(job.id).state == "REVOKED", 60, "the other worker to record the revoke")
        late = start_worker(redis_server.url, name="late", queues="later", num_kv_blocks=KV_BLOCKS).wait_ready()
        ran = client.submit(prompt="runs", **SHORT)  # same queue, after the revoked one
        assert ran.result(timeout=90).ok
        with pytest.raises(JobCancelledError):
            job.result(timeout=5)
    assert late.metrics()["tokenmill_jobs_succeeded_total"] == 1  # the revoked job was not run
    assert result_log.counts[job.id] == 1  # and its REVOKED result never overwritten


def test_in_a_group_message_a_cancelled_job_stops_and_the_others_go_on(
    redis_server: RedisServer, start_worker: Any, result_log: ResultLog
) -> None:
    with Client(redis_server.url) as client:
        group = [client.prepare({"id": f"g-{i}", "prompt": f"row {i}", **(LONG if i == 1 else SHORT)}) for i in range(4)]
        client.cancel("g-2")  # cancelled before the group is even sent
        app = queue_app(QueueSettings(broker_url=redis_server.url))
        app.send_task(BATCH_TASK_NAME, args=[{"jobs": group}], queue="tokenmill", ignore_result=True)
        worker = start_worker(redis_server.url, max_num_seqs=8, num_kv_blocks=KV_BLOCKS).wait_ready()
        _generating(worker)  # a group's results are stored together, when its last job ends
        assert client.cancel("g-1") == {"g-1": "cancelling"}
        _assert_cancelled_while_running(client, "g-1")
        results = {i: client.get(f"g-{i}") for i in range(4)}
    assert [results[i].status for i in range(4)] == ["succeeded", "cancelled", "cancelled", "succeeded"]
    assert results[2].error.message == "cancelled before it started" and results[2].usage is None
    wait_for(lambda: len(result_log.counts) >= 4, 30, "every result announced")  # the listener thread may lag
    assert all(count == 1 for count in result_log.counts.values()) and len(result_log.counts) == 4


def test_a_cancel_racing_completion_leaves_exactly_one_final_result(
    redis_server: RedisServer, start_worker: Any, result_log: ResultLog
) -> None:
    """Cancels sent while jobs finish: each job ends once, succeeded or cancelled, as its outcome says."""
    start_worker(redis_server.url, max_num_seqs=16, num_kv_blocks=KV_BLOCKS).wait_ready()
    with Client(redis_server.url) as client:
        handles = client.submit_many([{"prompt": f"race {i}", "max_tokens": 6 + i % 5, "temperature": 0.0}
                                      for i in range(60)])
        wait_for(lambda: any(client.get(h.id) for h in handles), 90, "the first results")
        outcomes = {}
        for handle in handles:
            outcomes.update(client.cancel(handle))
        results = {r.id: r for r in client.as_completed(handles, timeout=120)}
    assert set(outcomes.values()) <= {"finished", "cancelling", "cancelled"} and "finished" in outcomes.values()
    expected = {"finished": {"succeeded"}, "cancelled": {"cancelled"}, "cancelling": {"succeeded", "cancelled"}}
    for job_id, outcome in outcomes.items():
        assert results[job_id].status in expected[outcome], (job_id, outcome, results[job_id])
    wait_for(lambda: len(result_log.counts) == 60, 30, "every result announced")
    assert set(result_log.counts.values()) == {1}


def test_an_unknown_id_is_recorded_so_a_job_sent_later_with_it_does_not_run(
    redis_server: RedisServer, start_worker: Any
) -> None:
    start_worker(redis_server.url, num_kv_blocks=KV_BLOCKS).wait_ready()
    with Client(redis_server.url) as client:
        assert client.cancel("not-sent-yet") == {"not-sent-yet": "cancelled"}
        assert redis_server.client().ttl(CANCEL_KEY.format(job_id="not-sent-yet")) > 86000  # kept as long as results
        late = client.submit(id="not-sent-yet", prompt="too late", **SHORT)
        with pytest.raises(JobCancelledError):
            late.result(timeout=30)
        assert client.submit(prompt="others run", **SHORT).result(timeout=90).ok


def test_deadlines_end_a_job_with_its_partial_output(redis_server: RedisServer, start_worker: Any) -> None:
    """`Job.deadline_s`, and Celery's `time_limit` of apply_async, which the threads pool would ignore."""
    start_worker(redis_server.url, max_num_seqs=4, num_kv_blocks=KV_BLOCKS).wait_ready()
    app = queue_app(QueueSettings(broker_url=redis_server.url))
    with Client(redis_server.url) as client:
        own = client.submit(prompt="has a deadline", deadline_s=2, **LONG)
        celery = app.send_task(TASK_NAME, kwargs={"prompt": "celery time limit", **LONG}, time_limit=2)
        on_time = client.submit(prompt="well within", deadline_s=600, **SHORT)
        for job_id in (own.id, celery.id):
            result = client.as_completed([job_id], timeout=90).__next__()
            assert result.status == "failed" and result.error.code == "deadline_exceeded"
            assert result.finish_reason == "deadline" and 0 < result.usage.completion_tokens < LONG["max_tokens"]
            assert "deadline of 2s" in result.error.message
        assert on_time.result(timeout=30).ok


def test_remote_commands_that_cannot_work_or_change_the_worker_answer_with_an_error(
    redis_server: RedisServer, start_worker: Any
) -> None:
    app = queue_app(QueueSettings(broker_url=redis_server.url))
    worker = start_worker(redis_server.url, num_kv_blocks=KV_BLOCKS).wait_ready().wait_listening(app)
    for name, arguments in (("rate_limit", {"task_name": TASK_NAME, "rate_limit": "1/s"}),
                            ("time_limit", {"task_name": TASK_NAME, "soft": 1, "hard": 2}),
                            ("shutdown", {}), ("pool_shrink", {"n": 1}), ("add_consumer", {"queue": "x"})):
        [reply] = app.control.broadcast(name, arguments=arguments, reply=True, timeout=10, limit=1)
        [answer] = reply.values()
        assert "error" in answer and "ok" not in answer, (name, answer)
    assert worker.process.poll() is None  # the shutdown was refused
    assert app.control.inspect(timeout=10).ping()  # reading still works
    with Client(redis_server.url) as client:
        assert client.submit(prompt="still serving", **SHORT).result(timeout=60).ok


def test_remote_control_writes_turns_the_state_changing_commands_back_on(
    redis_server: RedisServer, start_worker: Any
) -> None:
    app = queue_app(QueueSettings(broker_url=redis_server.url))
    worker = start_worker(redis_server.url, remote_control_writes=True, num_kv_blocks=KV_BLOCKS).wait_ready().wait_listening(app)
    app.control.broadcast("shutdown", reply=True, timeout=10)  # Celery's own handler: the worker stops
    assert worker.process.wait(timeout=60) is not None


def test_the_cancel_command(redis_server: RedisServer) -> None:
    """Queued jobs, alone or in a group message, are cancelled; an id no job has (a typo) is said, exit 1, and not
    recorded."""
    with Client(redis_server.url, queue="nobody") as client:
        job = client.submit(prompt="x", **SHORT)
        grouped = [client.prepare({"id": f"grouped-{i}", "prompt": "y", **SHORT}) for i in range(2)]
        client.app.send_task(BATCH_TASK_NAME, args=[{"jobs": grouped}], queue="nobody", ignore_result=True)
    command = [sys.executable, "-m", "tokenmill.cli", "cancel", "--broker", redis_server.url, "--queue", "nobody"]
    done = subprocess.run([*command, job.id, "grouped-1", "missing-id"], cwd=REPO, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 1, done.stderr
    assert done.stdout.splitlines() == [f"{job.id}\tcancelled", "grouped-1\tcancelled"]
    assert done.stderr.splitlines() == ["tokenmill cancel: no job missing-id: no result, never delivered, not on queue "
                                        "'nobody' (nothing cancelled; check the id, or --queue)"]
    with Client(redis_server.url) as client:
        assert client.get("missing-id") is None and client.get("grouped-0") is None
    again = subprocess.run([*command, job.id], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert again.returncode == 0 and again.stdout.splitlines() == [f"{job.id}\tfinished"]
    usage = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=60)
    assert usage.returncode == 2 and "give job ids or --run" in usage.stderr


def test_a_job_cancelled_while_its_worker_is_dying_is_not_run_again_after_the_redelivery(
    redis_server: RedisServer, start_worker: Any, result_log: ResultLog
) -> None:
    """kill -9 of the worker that holds a cancelled job (its engine frozen, so it could not stop it): the job
    is delivered again and the next worker's check-in finds the cancel."""
    doomed = start_worker(redis_server.url, name="doomed", num_kv_blocks=KV_BLOCKS).wait_ready()
    with Client(redis_server.url) as client:
        job = client.submit(prompt="held by a dying worker", **LONG)
        wait_for(lambda: redis_server.client().get(DELIVERIES_KEY.format(job_id=job.id)), 60, "the job to start")
        [engine] = [pid for pid in child_pids(doomed.process.pid)
                    if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes()]
        os.kill(engine, signal.SIGSTOP)
        assert client.cancel(job) == {job.id: "cancelling"}
        doomed.kill()
        os.kill(engine, signal.SIGKILL)
        heir = start_worker(redis_server.url, name="heir", num_kv_blocks=KV_BLOCKS).wait_ready()
        with pytest.raises(JobCancelledError, match="cancelled before it started"):
            job.result(timeout=90)  # after the visibility timeout; the heir never runs it
    assert redis_server.client().get(DELIVERIES_KEY.format(job_id=job.id)) == b"2"
    assert heir.metrics()["tokenmill_jobs_cancelled_total"] == 1 and result_log.counts == {job.id: 1}


def test_celery_expires_still_drops_a_job_that_waited_too_long(redis_server: RedisServer, start_worker: Any) -> None:
    app = queue_app(QueueSettings(broker_url=redis_server.url))
    sent = app.send_task(TASK_NAME, kwargs={"prompt": "expires", **SHORT}, expires=1)
    time.sleep(1.5)  # expired before any worker exists
    worker = start_worker(redis_server.url, num_kv_blocks=KV_BLOCKS).wait_ready()
    with Client(redis_server.url) as client:
        with pytest.raises(JobCancelledError, match="expired"):
            JobHandle(sent.id, client).result(timeout=60)
    assert worker.metrics()["tokenmill_jobs_succeeded_total"] == 0
