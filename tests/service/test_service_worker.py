"""One real worker process on builtin:tiny, one redis-server, one moto S3: the normal paths and bad input."""

from __future__ import annotations

import base64
import gc
import json
import pickle
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from celery import chord, group
from service_fixtures import S3_BUCKET, RedisServer, ResultLog, S3Server, Worker, child_pids, engine_pid, stopped, wait_for

from tokenmill.client import Client, JobFailedError
from tokenmill.queue.names import DELIVERIES_KEY, TASK_NAME
from tokenmill.queue.settings import QueueSettings
from tokenmill.sampling_params import SamplingParams
from tokenmill.worker.app import create_app

#: Where the module's worker may write: the results bucket under runs/ only.
OUTPUT_PREFIXES = f"s3://{S3_BUCKET}/runs/"


@dataclass
class Service:
    redis: RedisServer
    s3: S3Server
    worker: Worker
    client: Client
    results: ResultLog


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    root = tmp_path_factory.mktemp("service")
    redis_server = RedisServer(root / "redis")
    redis_server.start()
    s3 = S3Server()
    s3.start()
    s3.client().create_bucket(Bucket=S3_BUCKET)
    results = ResultLog(redis_server)
    worker = Worker(redis_server.url, root / "worker.log", "main", {"s3-endpoint-url": s3.endpoint, "s3-region": "us-east-1",
                                                                   "output-prefixes": OUTPUT_PREFIXES})
    try:
        worker.wait_ready()
        yield Service(redis_server, s3, worker, Client(redis_server.url), results)
    finally:
        gc.collect()  # Celery AsyncResults unsubscribe when collected: let them, while Redis still runs
        worker.close()
        results.close()
        s3.stop()
        redis_server.kill()


@pytest.fixture(scope="module")
def reference() -> object:
    """The in-process engine on the same built-in model, to check what the queue returns."""
    from tokenmill import LLM

    return LLM("builtin:tiny")


def test_result_is_what_the_engine_computes(service: Service, reference: object) -> None:
    prompt = "The capital of France is"
    result = service.client.submit(prompt=prompt, max_tokens=12, temperature=0.0).result(timeout=60)
    expected = reference.generate([prompt], SamplingParams(max_tokens=12, temperature=0.0), use_tqdm=False)[0]
    assert result.status == "succeeded"
    assert result.token_ids == expected.token_ids and result.text == expected.text
    assert result.finish_reason == expected.finish_reason
    assert result.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert result.usage.completion_tokens == len(expected.token_ids)
    assert result.queued_at <= result.started_at <= result.first_token_at <= result.finished_at
    assert result.worker.startswith("main@") and result.attempt == 1


def test_many_jobs_all_come_back_once(service: Service) -> None:
    jobs = [{"prompt": f"job number {i}", "max_tokens": 1 + i % 24, "ignore_eos": True, "temperature": 0.0} for i in range(150)]
    handles = service.client.submit_many(jobs)
    results = list(service.client.as_completed(handles, timeout=120))
    assert sorted(r.id for r in results) == sorted(h.id for h in handles)
    by_id = {r.id: r for r in results}
    for handle, job in zip(handles, jobs):
        assert by_id[handle.id].usage.completion_tokens == job["max_tokens"]
    wait_for(lambda: all(service.results.counts.get(h.id) for h in handles), 10, "result notifications")
    assert {service.results.counts[h.id] for h in handles} == {1}


def test_chat_messages_use_the_chat_template(service: Service, reference: object) -> None:
    messages = [{"role": "user", "content": "hello there"}]
    result = service.client.submit(messages=messages, max_tokens=6, temperature=0.0).result(timeout=60)
    expected = reference.chat([messages], SamplingParams(max_tokens=6, temperature=0.0), use_tqdm=False)[0]
    assert result.token_ids == expected.token_ids


def test_engine_refusal_fails_that_job_only(service: Service) -> None:
    good = [{"prompt": f"fine {i}", "max_tokens": 8} for i in range(20)]
    bad = [
        {"prompt_token_ids": [1, 2, 10_000], "max_tokens": 4, "id": f"oov-{uuid.uuid4().hex}"},
        {"prompt": "too long", "max_tokens": 5000, "id": f"long-{uuid.uuid4().hex}"},
    ]
    handles = service.client.submit_many(good[:10] + bad + good[10:])
    results = {r.id: r for r in service.client.as_completed(handles, timeout=60)}
    oov, too_long = results[bad[0]["id"]], results[bad[1]["id"]]
    assert (oov.status, oov.error.code, oov.error.field) == ("failed", "invalid_request", "prompt_token_ids")
    assert "10000" in oov.error.message
    assert (too_long.error.code, too_long.error.field) == ("invalid_request", "max_tokens")
    assert sum(r.ok for r in results.values()) == 20
    with pytest.raises(JobFailedError, match="prompt_token_ids"):
        next(h for h in handles if h.id == bad[0]["id"]).result(timeout=5)
    assert service.worker.process.poll() is None


def test_celery_users_get_the_same_task(service: Service) -> None:
    app = create_app(QueueSettings(broker_url=service.redis.url))
    single = app.send_task(TASK_NAME, kwargs={"prompt": "via send_task", "max_tokens": 5}).get(timeout=60)
    assert single["status"] == "succeeded" and len(single["token_ids"]) == 5
    task = app.tasks[TASK_NAME]
    batch = group(task.s({"prompt": f"group {i}", "max_tokens": 3}) for i in range(5))().get(timeout=60)
    assert [r["usage"]["completion_tokens"] for r in batch] == [3] * 5


def test_celery_remote_control_reaches_the_worker(service: Service) -> None:
    """What `celery inspect` and Flower use: broadcast commands answered by the worker."""
    app = create_app(QueueSettings(broker_url=service.redis.url))
    replies = app.control.ping(timeout=10, limit=1)
    nodes = [name for reply in replies for name in reply]
    assert len(nodes) == 1 and nodes[0].startswith("main@")
    active = app.control.inspect(timeout=10, destination=nodes).active_queues() or {}
    assert [q["name"] for q in active[nodes[0]]] == ["tokenmill"]


def test_chord_of_jobs_calls_back_with_every_result(service: Service) -> None:
    """Celery's Redis chord: the worker that finishes the last job sends the user's callback task."""
    app = create_app(QueueSettings(broker_url=service.redis.url))
    callback_queue = f"user-callbacks-{uuid.uuid4().hex}"
    # ignore_eos: sampled at the default temperature, a job may end at EOS before 3 tokens (seen: 'stop' after 2)
    header = [app.tasks[TASK_NAME].s({"prompt": f"chord {i}", "max_tokens": 3, "ignore_eos": True}) for i in range(4)]
    chord(header)(app.signature("user.collect_results").set(queue=callback_queue))
    raw = wait_for(lambda: service.redis.client().lpop(callback_queue), 60, "the chord's callback message")
    message = json.loads(raw)
    (results,), _, _ = json.loads(base64.b64decode(message["body"]))
    assert message["headers"]["task"] == "user.collect_results"
    assert len(results) == 4 and all(r["status"] == "succeeded" and len(r["token_ids"]) == 3 for r in results)


def test_result_goes_to_s3_and_redis_keeps_its_uri(service: Service) -> None:
    job_id = f"s3-{uuid.uuid4().hex}"
    result = service.client.submit(id=job_id, prompt="to s3", max_tokens=7, output=f"s3://{S3_BUCKET}/runs/a").result(timeout=60)
    assert result.output_uri == f"s3://{S3_BUCKET}/runs/a/{job_id}.json"
    assert result.text is None and result.token_ids is None
    stored = json.loads(service.s3.client().get_object(Bucket=S3_BUCKET, Key=f"runs/a/{job_id}.json")["Body"].read())
    assert stored["id"] == job_id and len(stored["token_ids"]) == 7 and stored["status"] == "succeeded"


def test_resubmitting_a_finished_job_id_does_not_run_it_again(service: Service) -> None:
    job_id = f"idem-{uuid.uuid4().hex}"
    first = service.client.submit(id=job_id, prompt="only once", max_tokens=4).result(timeout=60)
    before = service.worker.metrics()["tokenmill_jobs_succeeded_total"]
    service.client.submit(id=job_id, prompt="only once", max_tokens=4)
    done = service.client.submit(prompt="after the duplicate", max_tokens=2).result(timeout=60)  # FIFO: the duplicate went first
    assert done.ok
    assert int(service.redis.client().get(DELIVERIES_KEY.format(job_id=job_id))) == 2  # delivered twice...
    assert service.worker.metrics()["tokenmill_jobs_succeeded_total"] == before + 1  # ...run once
    assert service.results.counts[job_id] == 1
    assert service.client.get(job_id) == first


def _raw_message(client: Client, fields: dict) -> dict:
    """A genuine Celery message for `fields`, taken off a scratch queue so a test can tamper with it."""
    scratch = Client(client.settings.broker_url, queue=f"scratch-{uuid.uuid4().hex}")
    handle = scratch.submit(**fields)
    raw = client.app.backend.client.rpop(scratch.queue)
    message = json.loads(raw)
    message["properties"]["delivery_info"]["routing_key"] = client.queue
    return {"id": handle.id, "message": message}


class _Evil:
    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple:
        import os

        return (os.system, (f"touch {self.path}",))


def _set_body(item: dict, body: bytes, content_type: str | None = None) -> dict:
    item["message"]["body"] = base64.b64encode(body).decode()
    if content_type is not None:
        item["message"].update({"content-type": content_type, "content-encoding": "binary"})
    return item


def test_non_json_malformed_and_pickle_messages_never_run(service: Service, tmp_path: Path) -> None:
    marker = tmp_path / "pickle-was-executed"
    secret = f"never-logged-{uuid.uuid4().hex}"
    redis_client = service.redis.client()

    def message(fields: dict | None = None) -> dict:
        return _raw_message(service.client, fields or {"prompt": secret})

    discarded = [
        _set_body(message(), pickle.dumps(_Evil(str(marker))), "application/x-python-serialize"),
        _set_body(message(), b"!!python/object/apply:os.system ['true']", "application/x-yaml"),
        _set_body(message(), b"{this is not json " + secret.encode()),
        _set_body(message(), json.dumps({"prompt": secret}).encode()),  # JSON, but not [args, kwargs, embed]
        _set_body(message(), json.dumps([{"prompt": secret}, {}, {}]).encode()),  # args not a list
    ]
    unknown = message()
    unknown["message"]["headers"]["task"] = "someone.elses.task"
    bad_job = message()
    args, kwargs, embed = json.loads(base64.b64decode(bad_job["message"]["body"]))
    args[0]["sampling"]["max_tokens"] = "many"
    _set_body(bad_job, json.dumps([args, kwargs, embed]).encode())
    for item in [*discarded, unknown, bad_job]:
        redis_client.lpush(service.client.queue, json.dumps(item["message"]))

    refused = service.client.results([bad_job["id"]], timeout=60)[0]
    after = service.client.submit(prompt="still alive", max_tokens=3).result(timeout=60)
    assert (refused.status, refused.error.code, refused.error.field) == ("failed", "invalid_job", "max_tokens")
    assert after.ok and service.worker.process.poll() is None
    assert not marker.exists()
    for item in discarded:  # never run, but answered: the sender gets a failure naming the id, not a wait forever
        refusal = service.client.results([item["id"]], timeout=30)[0]
        assert refusal.error.code == "task_failure" and item["id"] in refusal.error.message
        assert secret not in refusal.error.message and refusal.text is None
    unknown_result = service.client.get(unknown["id"])  # as Celery does: unknown tasks are marked failed
    assert unknown_result.error.code == "task_failure" and "NotRegistered" in unknown_result.error.message
    # late ack: a message is acknowledged just after its result is stored, so the last one may still be in flight
    wait_for(lambda: redis_client.llen(service.client.queue) == 0 and redis_client.hlen("unacked") == 0, 10,
             "every message acknowledged or discarded")
    assert secret not in service.worker.log_text()


def test_metrics_endpoint_reports_jobs_tokens_and_engine_state(service: Service) -> None:
    before = service.worker.metrics()
    handles = service.client.submit_many([{"prompt": f"metric {i}", "max_tokens": 10, "ignore_eos": True} for i in range(8)])
    handles.append(service.client.submit(prompt_token_ids=[99_999]))
    list(service.client.as_completed(handles, timeout=60))
    after = service.worker.metrics()

    def grew(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    assert grew("tokenmill_jobs_succeeded_total") == 8
    assert grew('tokenmill_jobs_failed_total{code="invalid_request"}') == 1
    assert grew("tokenmill_generated_tokens_total") == 80
    assert grew("tokenmill_queue_wait_seconds_count") == 9
    for gauge in ("tokenmill_running_sequences", "tokenmill_waiting_sequences", "tokenmill_kv_cache_usage_ratio",
                  "tokenmill_generation_tokens_per_second", "tokenmill_jobs_in_flight"):
        assert gauge in after


def test_logs_never_contain_prompt_text(service: Service) -> None:
    secret = f"confidential-{uuid.uuid4().hex}"
    failing = service.client.submit(prompt=secret, max_tokens=5000)  # fails in the engine: error paths log too
    ok = service.client.submit(prompt=secret, max_tokens=4, metadata={"note": secret})
    service.client.results([failing, ok], timeout=60)
    log = service.worker.log_text()
    assert ok.id in log or failing.id in log  # the log does talk about these jobs...
    assert secret not in log  # ...but never quotes them


def test_structured_outputs_through_the_queue(service: Service, reference: object) -> None:
    """json_schema / choice / regex travel as job fields (Client.submit, Celery kwargs); the result carries
    the parsed JSON; what the client can check is refused before queueing, what only xgrammar can check
    fails that job with the field named."""
    import pydantic

    from tokenmill.errors import InvalidRequestError

    class Label(pydantic.BaseModel):
        label: str = pydantic.Field(json_schema_extra={"enum": ["cat", "dog"]})
        score: int = pydantic.Field(ge=0, le=9)

    result = service.client.submit(prompt="label this", max_tokens=48, temperature=0.0, json_schema=Label).result(timeout=60)
    expected = reference.generate(["label this"], SamplingParams(max_tokens=48, temperature=0.0, json_schema=Label),
                                  use_tqdm=False)[0]
    assert result.text == expected.text and result.constraint_satisfied is True
    assert result.constraint_backend == expected.constraint_backend == "xgrammar"
    assert result.parsed == json.loads(result.text) and Label.model_validate(result.parsed)
    app = create_app(QueueSettings(broker_url=service.redis.url))
    picked = app.send_task(TASK_NAME, kwargs={"prompt": "pick", "max_tokens": 8, "choice": ["yes", "no"]}).get(timeout=60)
    assert picked["text"] in ("yes", "no") and picked["constraint_satisfied"] is True and picked["parsed"] is None
    assert picked["constraint_backend"] == "xgrammar"
    short = service.client.submit(prompt="x", max_tokens=16, json_schema={"type": "string", "pattern": "^[a-z]+$",
                                                                       "maxLength": 4}).result(timeout=60)
    assert short.constraint_backend == "llguidance" and short.constraint_satisfied is True  # xgrammar ignores maxLength here
    with pytest.raises(InvalidRequestError) as error:
        service.client.submit(prompt="x", regex="(unclosed")
    assert error.value.field == "regex"
    with pytest.raises(JobFailedError, match="regex") as failed:
        service.client.submit(prompt="x", regex=r"(a)\1").result(timeout=60)  # Python compiles it, xgrammar cannot
    assert (failed.value.result.error.code, failed.value.result.error.field) == ("invalid_request", "regex")



def _nice_values(pid: int) -> dict[int, int]:
    """Each thread's nice value by thread id (/proc: the 19th field of a task's stat); a thread that ends while
    this reads (a finished group of single jobs) is left out."""
    values = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            values[int(task.name)] = int((task / "stat").read_text().rsplit(")", 1)[1].split()[16])
        except OSError:
            continue
    return values


def test_the_worker_yields_the_cpu_to_its_engine(service: Service) -> None:
    """The worker's main thread and the Celery threads it starts run at `--worker-nice` (10) below the engine
    process, which keeps the normal priority: on busy cores the engine, which the whole batch waits on, runs first."""
    worker_pid = service.worker.process.pid
    [engine_pid] = [pid for pid in child_pids(worker_pid)
                    if b"resource_tracker" not in Path(f"/proc/{pid}/cmdline").read_bytes()]
    service.client.submit(prompt="start the pool threads", max_tokens=2).result(timeout=60)
    worker_threads, engine_threads = _nice_values(worker_pid), _nice_values(engine_pid)
    assert worker_threads[worker_pid] == 10 and sum(nice == 10 for nice in worker_threads.values()) >= 2, worker_threads
    # the engine loop at the normal priority; only its grammar compile threads (once a structured job came) at 19
    assert engine_threads[engine_pid] == 0 and set(engine_threads.values()) <= {0, 19}, engine_threads


def test_a_job_id_or_field_name_with_a_newline_cannot_forge_log_lines(service: Service) -> None:
    """A refused job's raw id and field names are data: the stored result carries the task's (checked) id, and
    the log shows them with repr, on one line, so `\\nCRITICAL ...` never starts a line of its own."""
    app = create_app(QueueSettings(broker_url=service.redis.url))
    forged = f"CRITICAL forged-{uuid.uuid4().hex}"
    by_id = app.send_task(TASK_NAME, kwargs={"id": f"x\n{forged}", "prompt": "p"}, task_id=f"t-{uuid.uuid4().hex}")
    by_field = app.send_task(TASK_NAME, kwargs={"prompt": "p", f"bad\n{forged}": 1}, task_id=f"t-{uuid.uuid4().hex}")
    results = [by_id.get(timeout=60), by_field.get(timeout=60)]
    assert [r["id"] for r in results] == [by_id.id, by_field.id]
    assert [(r["status"], r["error"]["code"]) for r in results] == [("failed", "invalid_job")] * 2
    assert results[0]["error"]["field"] == "id"
    log = wait_for(lambda: by_id.id in (text := service.worker.log_text()) and by_field.id in text and text, 30,
                   "both refusals logged")
    assert not [line for line in log.splitlines() if line.startswith(forged)], "a forged line reached the log"


def _failed_with(service: Service, code: str) -> float:
    return service.worker.metrics().get(f'tokenmill_jobs_failed_total{{code="{code}"}}', 0.0)


def test_a_reused_job_id_with_other_content_is_a_conflict_never_the_old_result(service: Service) -> None:
    job_id = f"row-{uuid.uuid4().hex}"
    first = service.client.submit(id=job_id, prompt="prompt A", max_tokens=4).result(timeout=60)
    assert first.ok
    conflicts, succeeded = _failed_with(service, "conflict"), service.worker.metrics()["tokenmill_jobs_succeeded_total"]
    reused = service.client.submit(id=job_id, prompt="prompt B", max_tokens=4)
    with pytest.raises(JobFailedError, match=f"job id '{job_id}' was already used for a job with different content"):
        reused.result(timeout=60)
    assert (reused.get().error.code, reused.get().error.field) == ("conflict", "id")
    wait_for(lambda: _failed_with(service, "conflict") == conflicts + 1, 30, "the worker to refuse the reused id")
    assert service.worker.metrics()["tokenmill_jobs_succeeded_total"] == succeeded  # B never ran
    assert service.client.get(job_id) == first  # and A's result is kept
    assert service.results.counts[job_id] == 1
    again = service.client.submit(id=job_id, prompt="prompt A", max_tokens=4)  # same content: still idempotent
    assert again.result(timeout=60) == first
    wait_for(lambda: int(service.redis.client().get(DELIVERIES_KEY.format(job_id=job_id))) == 3, 30, "the third delivery")
    assert service.worker.metrics()["tokenmill_jobs_succeeded_total"] == succeeded


def test_a_results_job_hash_is_the_senders_header_when_it_is_one_else_the_workers_own(service: Service) -> None:
    """The client sends each job's content hash in a header (`JOB_HASH_HEADER`) so that the worker need not hash the
    job again; a message without one, or with a value that is no SHA-256 hex digest, is hashed by the worker."""
    from tokenmill.queue.names import JOB_HASH_HEADER
    from tokenmill.queue.schemas import Job

    app = create_app(QueueSettings(broker_url=service.redis.url))
    submitted = service.client.submit(prompt="hashed by its sender", max_tokens=3)
    assert submitted.result(timeout=60).job_hash == submitted.job_hash
    wires = [Job.from_wire({"prompt": f"hash {n}", "max_tokens": 3}).to_wire() for n in range(4)]
    own = [Job.from_wire(wire).content_hash() for wire in wires]
    headers = [{JOB_HASH_HEADER: "b" * 64}, {JOB_HASH_HEADER: "not a hash"}, {JOB_HASH_HEADER: "B" * 64}, {}]
    results = [app.send_task(TASK_NAME, args=[wire], task_id=wire["id"], headers=header)
               for wire, header in zip(wires, headers)]
    stored = [result.get(timeout=60)["job_hash"] for result in results]
    assert stored == ["b" * 64, own[1], own[2], own[3]]  # the sender's claim is taken as the job id is


def test_a_reused_job_id_in_a_group_message_is_a_conflict_too(service: Service) -> None:
    from tokenmill.client import JobHandle
    from tokenmill.queue.names import BATCH_TASK_NAME
    from tokenmill.queue.schemas import Job, content_hash

    job_id, fresh_id = f"row-{uuid.uuid4().hex}", f"row-{uuid.uuid4().hex}"
    first = service.client.submit(id=job_id, prompt="group A", max_tokens=3).result(timeout=60)
    conflicts = _failed_with(service, "conflict")
    jobs = [Job.from_wire({"id": job_id, "prompt": "group B", "max_tokens": 3}).to_wire(),
            Job.from_wire({"id": fresh_id, "prompt": "group C", "max_tokens": 3}).to_wire()]
    app = service.client.app
    with app.producer_or_acquire() as producer:
        message = app.amqp.as_task_v2(uuid.uuid4().hex, BATCH_TASK_NAME, args=[{"jobs": jobs}], kwargs={}, ignore_result=True)
        app.amqp.send_task_message(producer, BATCH_TASK_NAME, message, queue=service.client.queue)
    reused, fresh = (JobHandle(job["id"], service.client, content_hash(job)) for job in jobs)
    assert fresh.result(timeout=60).ok
    assert (reused.get().error.code, reused.get().error.field) == ("conflict", "id")
    wait_for(lambda: _failed_with(service, "conflict") == conflicts + 1, 30, "the worker to refuse the reused id")
    assert service.client.get(job_id) == first and service.results.counts[job_id] == 1


def test_a_reused_job_id_in_a_group_message_while_that_job_runs_is_a_conflict(service: Service) -> None:
    """The group joins a job of its id that is still running here; other content under that id is a conflict, as
    on the pool path (found when a loaded run had the group arrive before the single job left the running set)."""
    from tokenmill.client import JobHandle
    from tokenmill.queue.names import BATCH_TASK_NAME
    from tokenmill.queue.schemas import Job, content_hash

    job_id, fresh_id = f"row-{uuid.uuid4().hex}", f"row-{uuid.uuid4().hex}"
    conflicts = _failed_with(service, "conflict")
    jobs = [Job.from_wire({"id": job_id, "prompt": "group B", "max_tokens": 3}).to_wire(),
            Job.from_wire({"id": fresh_id, "prompt": "group C", "max_tokens": 3}).to_wire()]
    app = service.client.app
    with stopped(engine_pid(service.worker.process.pid)):  # the single job is still running when the group comes
        first = service.client.submit(id=job_id, prompt="group A", max_tokens=3)
        wait_for(lambda: job_id in _active_ids(app), 30, "the single job running")
        with app.producer_or_acquire() as producer:
            message = app.amqp.as_task_v2(uuid.uuid4().hex, BATCH_TASK_NAME, args=[{"jobs": jobs}], kwargs={},
                                          ignore_result=True)
            app.amqp.send_task_message(producer, BATCH_TASK_NAME, message, queue=service.client.queue)
        wait_for(lambda: len(_active_ids(app)) == 2, 30, "the group running beside it")
    assert first.result(timeout=60).ok
    reused, fresh = (JobHandle(job["id"], service.client, content_hash(job)) for job in jobs)
    assert fresh.result(timeout=60).ok
    wait_for(lambda: _failed_with(service, "conflict") == conflicts + 1, 30, "the worker to refuse the reused id")
    assert (reused.get().error.code, reused.get().error.field) == ("conflict", "id")
    assert service.client.get(job_id).ok and service.results.counts[job_id] == 1


def _active_ids(app) -> set[str]:
    replies = app.control.inspect(timeout=5).active() or {}
    return {task["id"] for tasks in replies.values() for task in tasks}


OUTSIDE = [f"s3://{S3_BUCKET}/other", f"s3://{S3_BUCKET}/runs-x/a", f"s3://{S3_BUCKET}", "s3://elsewhere/runs/a",
           f"s3://{S3_BUCKET}/runs/../other", f"s3://{S3_BUCKET}/runs//a"]


def _objects(service: Service) -> list[str]:
    return [o["Key"] for o in service.s3.client().list_objects_v2(Bucket=S3_BUCKET).get("Contents", [])]


def test_outputs_outside_the_allowed_prefixes_are_refused_before_generating(service: Service) -> None:
    before, objects = service.worker.metrics(), _objects(service)
    handles = service.client.submit_many([{"prompt": "escape", "max_tokens": 5, "output": uri} for uri in OUTSIDE])
    results = service.client.results(handles, timeout=60)
    for uri, result in zip(OUTSIDE, results):
        assert (result.status, result.error.code, result.error.field) == ("failed", "invalid_request", "output"), uri
        assert result.usage is None and result.output_uri is None
    assert "outside the S3 prefixes this worker may write: " + OUTPUT_PREFIXES in results[0].error.message
    assert "'..'" in results[4].error.message
    assert _objects(service) == objects  # nothing written anywhere
    assert service.worker.metrics()["tokenmill_generated_tokens_total"] == before["tokenmill_generated_tokens_total"]
    inside = service.client.submit(prompt="inside", max_tokens=3, output=f"s3://{S3_BUCKET}/runs/deeper/b").result(timeout=60)
    assert inside.output_uri == f"s3://{S3_BUCKET}/runs/deeper/b/{inside.id}.json"


def test_group_messages_refuse_outputs_outside_the_prefixes_too(service: Service) -> None:
    from tokenmill.client import JobHandle
    from tokenmill.queue.names import BATCH_TASK_NAME
    from tokenmill.queue.schemas import Job, content_hash

    jobs = [Job.from_wire({"prompt": "group escape", "max_tokens": 3, "output": f"s3://{S3_BUCKET}/other"}).to_wire(),
            Job.from_wire({"prompt": "group inside", "max_tokens": 3, "output": f"s3://{S3_BUCKET}/runs/g"}).to_wire()]
    app = service.client.app
    with app.producer_or_acquire() as producer:
        message = app.amqp.as_task_v2(uuid.uuid4().hex, BATCH_TASK_NAME, args=[{"jobs": jobs}], kwargs={}, ignore_result=True)
        app.amqp.send_task_message(producer, BATCH_TASK_NAME, message, queue=service.client.queue)
    refused, inside = service.client.results([JobHandle(j["id"], service.client, content_hash(j)) for j in jobs], timeout=60)
    assert (refused.error.code, refused.error.field, refused.usage) == ("invalid_request", "output", None)
    assert inside.ok and inside.output_uri == f"s3://{S3_BUCKET}/runs/g/{inside.id}.json"
    assert f"other/{refused.id}.json" not in _objects(service)


def test_a_worker_without_output_prefixes_writes_no_s3_output(redis_server: RedisServer, s3_server: S3Server,
                                                               start_worker) -> None:
    start_worker(redis_server.url, "nos3", s3_endpoint_url=s3_server.endpoint, s3_region="us-east-1").wait_ready()
    with Client(redis_server.url) as client:
        [result] = client.results([client.submit(prompt="x", max_tokens=3, output=f"s3://{S3_BUCKET}/runs/a")], timeout=60)
    assert (result.error.code, result.error.field) == ("invalid_request", "output")
    assert "TOKENMILL_OUTPUT_PREFIXES" in result.error.message
    listed = s3_server.client().list_objects_v2(Bucket=S3_BUCKET).get("Contents", [])  # moto's store is per process
    assert not [o["Key"] for o in listed if result.id in o["Key"]]
