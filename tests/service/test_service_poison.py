"""Bad input through each door it can come in by, at one real worker: the client refuses it naming the field;
a plain Celery app (not tokenmill's) gets a failed `JobResult` naming the field; the worker survives every one
and serves the next job. Also: routing for plain Celery apps, and dead letters (bounded, listed, requeued)."""

from __future__ import annotations

import gc
import json
import re
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from celery import Celery
from service_fixtures import REPO, RedisServer, Worker, wait_for

from tokenmill.client import Client
from tokenmill.errors import InvalidRequestError
from tokenmill.queue import dead_letters
from tokenmill.queue.names import BATCH_TASK_NAME, DEAD_LETTER_KEY, DELIVERIES_KEY, TASK_NAME
from tokenmill.worker.app import TASK_ROUTES  # the public path teams use

MAX_DELIVERIES = 2


@dataclass
class Service:
    redis: RedisServer
    worker: Worker
    client: Client
    team: Celery  # a team's own Celery app, routed with TASK_ROUTES


def plain_celery_app(url: str, **conf: Any) -> Celery:
    """What a team that already runs Celery has: its own app on the same Redis, nothing of tokenmill's."""
    app = Celery("team", broker=url, backend=url, set_as_current=False)
    app.conf.update(broker_connection_retry_on_startup=True, **conf)
    return app


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    root = tmp_path_factory.mktemp("poison")
    redis_server = RedisServer(root / "redis")
    redis_server.start()
    worker = Worker(redis_server.url, root / "worker.log", "poison", {"max-deliveries": MAX_DELIVERIES})
    team = plain_celery_app(redis_server.url, task_routes=TASK_ROUTES)
    try:
        worker.wait_ready()
        yield Service(redis_server, worker, Client(redis_server.url), team)
    finally:
        gc.collect()
        team.close()
        worker.close()
        redis_server.kill()


def _send(service: Service, **kwargs: Any) -> dict[str, Any]:
    """A job sent the plain Celery way; returns the stored JobResult dict."""
    return service.team.send_task(TASK_NAME, **kwargs).get(timeout=90)


POISON = [
    ({"seed": 2**64}, "seed"),
    ({"seed": 2**63 * 4}, "seed"),
    ({"top_k": 2**63}, "top_k"),
    ({"max_tokens": 2**63}, "max_tokens"),
    ({"min_tokens": 2**40, "max_tokens": 2**40}, "max_tokens"),
    ({"logprobs": 2**63}, "logprobs"),
    ({"stop_token_ids": [2**63]}, "stop_token_ids[0]"),
    ({"repetition_penalty": 1e309}, "repetition_penalty"),  # json: Infinity
]


@pytest.mark.parametrize(("fields", "field"), POISON)
def test_the_client_refuses_poison_naming_the_field(service: Service, fields: dict, field: str) -> None:
    with pytest.raises(InvalidRequestError) as caught:
        service.client.submit(prompt="poison", **fields)
    assert caught.value.field == field


def test_poison_sent_with_plain_celery_fails_that_job_only(service: Service) -> None:
    pending = [service.team.send_task(TASK_NAME, kwargs={"prompt": "poison", **fields}) for fields, _ in POISON]
    healthy = service.client.submit(prompt="a healthy neighbour", max_tokens=6, ignore_eos=True)
    for (_, field), handle in zip(POISON, pending):
        result = handle.get(timeout=90)
        assert (result["status"], result["error"]["code"], result["error"]["field"]) == ("failed", "invalid_job", field)
    assert healthy.result(timeout=60).usage.completion_tokens == 6
    assert service.worker.process.poll() is None


def _nested(depth: int, leaf: Any, wrap: Any) -> Any:
    value = leaf
    for _ in range(depth):
        value = wrap(value)
    return value


#: Nesting that once raised RecursionError out of validation (and failed a whole group), yet that Celery's JSON
#: encoder still sends (it gives up near Python's recursion limit, ~1000 levels).
DEEP = [
    ({"regex": "(" * 3000 + "a" + ")" * 3000}, "regex"),
    ({"json_schema": _nested(300, {"type": "string"}, lambda s: {"type": "object", "properties": {"a": s}})}, "json_schema"),
    ({"sampling": {"json_schema": {"type": "array", "items": _nested(600, [], lambda s: [s])}}}, "json_schema"),
    ({"metadata": _nested(600, {}, lambda m: {"a": m})}, "metadata"),
]


@pytest.mark.parametrize(("fields", "field"), DEEP, ids=["regex", "json_schema", "json_schema_wire", "metadata"])
def test_the_client_refuses_deep_nesting_naming_the_field(service: Service, fields: dict, field: str) -> None:
    with pytest.raises(InvalidRequestError) as caught:
        service.client.submit(prompt="deep", **fields)
    assert caught.value.field == field and "nest" in caught.value.message


@pytest.mark.parametrize(("fields", "field"), DEEP, ids=["regex", "json_schema", "json_schema_wire", "metadata"])
def test_deep_nesting_sent_with_plain_celery_fails_that_job_naming_the_field(service: Service, fields: dict,
                                                                             field: str) -> None:
    result = _send(service, kwargs={"prompt": "deep", **fields})
    assert (result["status"], result["error"]["code"], result["error"]["field"]) == ("failed", "invalid_job", field)


def test_deep_nesting_in_a_group_fails_those_jobs_only(service: Service) -> None:
    """A group with valid jobs around deeply nested ones: every job gets its own result, the valid ones succeed."""
    run = uuid.uuid4().hex[:8]
    valid = [{"id": f"ok-{run}-{i}", "prompt": f"fine {i}", "max_tokens": 3, "ignore_eos": True} for i in range(2)]
    deep = [{"id": f"deep-{run}-{i}", "prompt": "deep", **fields} for i, (fields, _) in enumerate(DEEP)]
    jobs = [valid[0], *deep, valid[1]]
    service.team.send_task(BATCH_TASK_NAME, args=[{"jobs": jobs}], queue="tokenmill")
    results = {r.id: r for r in service.client.results([job["id"] for job in jobs], timeout=90)}
    assert [results[job["id"]].usage.completion_tokens for job in valid] == [3, 3]
    for job, (_, field) in zip(deep, DEEP):
        result = results[job["id"]]
        assert (result.status, result.error.code, result.error.field) == ("failed", "invalid_job", field), result.error
    assert service.worker.process.poll() is None


def test_former_poison_that_is_valid_now_completes(service: Service) -> None:
    greedy = service.client.submit(prompt="tiny temperature", max_tokens=10, temperature=0.0).result(timeout=60)
    tiny = _send(service, kwargs={"prompt": "tiny temperature", "max_tokens": 10, "temperature": 1e-300})
    assert tiny["status"] == "succeeded" and tiny["token_ids"] == greedy.token_ids
    for seed in (2**63, 2**64 - 1):
        jobs = [service.client.submit(prompt="big seed", max_tokens=8, temperature=1.0, seed=seed, top_k=2**31 - 1,
                                      ignore_eos=True) for _ in range(2)]
        first, second = (job.result(timeout=60) for job in jobs)
        assert first.token_ids == second.token_ids and len(first.token_ids) == 8
    assert service.worker.process.poll() is None


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"args": ["a prompt"]}, "job"),
        ({"kwargs": {"job": [1, 2, 3]}}, "job"),
        ({"args": [{"prompt": "one"}, {"prompt": "two"}]}, "job"),
        ({"args": [{"prompt": "x", "metadata": "not an object"}]}, "metadata"),
        ({"kwargs": {"prompt": "x", "nonsense": 1}}, "nonsense"),
    ],
)
def test_wrong_shapes_through_celery_fail_with_a_job_result(service: Service, kwargs: dict, field: str) -> None:
    result = _send(service, **kwargs)
    assert (result["status"], result["error"]["code"], result["error"]["field"]) == ("failed", "invalid_job", field)


def test_non_json_metadata_is_refused_by_the_client_naming_it(service: Service) -> None:
    for metadata in ({"when": object()}, {"raw": b"bytes"}, {"x": float("nan")}):
        with pytest.raises(InvalidRequestError) as caught:
            service.client.submit(prompt="x", metadata=metadata)
        assert caught.value.field == "metadata"
    assert service.client.submit(prompt="x", max_tokens=2, metadata={"a": [1, {"b": None}]}).result(timeout=60).ok


def test_oversized_job_is_refused_by_the_worker_before_tokenizing(service: Service) -> None:
    huge = "x" * (10 * 2**20)
    with pytest.raises(InvalidRequestError) as caught:
        service.client.submit(prompt=huge)
    assert caught.value.field == "prompt"
    sent = service.team.send_task(TASK_NAME, kwargs={"prompt": huge, "max_tokens": 3})
    small = service.client.submit(prompt="small", max_tokens=3, ignore_eos=True)
    result = sent.get(timeout=90)
    assert (result["status"], result["error"]["code"], result["error"]["field"]) == ("failed", "invalid_job", "prompt")
    assert "1048576-byte limit" in result["error"]["message"]
    assert small.result(timeout=60).ok


def test_prompt_too_long_in_characters_is_refused_before_tokenizing(service: Service) -> None:
    """builtin:tiny: 4096 tokens of at most 5 characters each, so 30,000 characters can never fit."""
    sent = service.team.send_task(TASK_NAME, kwargs={"prompt": "ab" * 15_000, "max_tokens": 3})
    result = sent.get(timeout=90)
    assert (result["status"], result["error"]["code"], result["error"]["field"]) == ("failed", "invalid_request", "prompt")
    assert "30000 characters cannot fit in max_model_len" in result["error"]["message"]
    fits = service.client.submit(prompt="ab" * 1000, max_tokens=2).result(timeout=60)  # 2000 characters: tokenized
    assert fits.ok and fits.usage.prompt_tokens >= 1000


def test_routing_for_a_plain_celery_app(service: Service) -> None:
    """TASK_ROUTES (or queue="tokenmill") takes a plain app's send_task to the tokenmill queue."""
    routed = _send(service, kwargs={"prompt": "routed", "max_tokens": 4, "ignore_eos": True})
    assert routed["status"] == "succeeded" and len(routed["token_ids"]) == 4
    unrouted = plain_celery_app(service.redis.url)
    try:
        explicit = unrouted.send_task(TASK_NAME, kwargs={"prompt": "explicit", "max_tokens": 4}, queue="tokenmill")
        assert explicit.get(timeout=90)["status"] == "succeeded"
        job_id = f"lost-{uuid.uuid4().hex}"
        unrouted.send_task(TASK_NAME, kwargs={"prompt": "default queue"}, task_id=job_id)  # what the issue saw
        broker = service.redis.client()
        assert broker.llen("celery") == 1 and service.client.get(job_id) is None  # nobody consumes "celery"
        broker.delete("celery")
    finally:
        unrouted.close()


def _cli(*args: str, url: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tokenmill.cli", "dead-letters", "--broker", url, *args], cwd=REPO,
                          capture_output=True, text=True, timeout=60, env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})


def test_dead_letters_are_listed_and_requeued_from_the_cli(service: Service) -> None:
    broker = service.redis.client()
    broker.delete(DEAD_LETTER_KEY)
    job_id = f"dead-{uuid.uuid4().hex}"
    # As if every earlier delivery had died with its worker: the next one is over max_deliveries.
    broker.set(DELIVERIES_KEY.format(job_id=job_id), MAX_DELIVERIES)
    dead = service.client.submit(id=job_id, prompt="dead then alive", max_tokens=5, ignore_eos=True, metadata={"k": 1})
    failed = service.client.results([dead], timeout=60)[0]
    assert failed.error.code == "dead_letter"

    listed = _cli("list", url=service.redis.url)
    assert listed.returncode == 0, listed.stderr
    [summary] = [json.loads(line) for line in listed.stdout.splitlines()]
    assert summary["id"] == job_id and summary["deliveries"] == MAX_DELIVERIES + 1 and "delivered" in summary["reason"]
    [entry] = service.client.dead_letters()
    assert set(entry) == {"job", "reason", "deliveries", "dead_lettered_at"} and entry["job"]["metadata"] == {"k": 1}

    missing = _cli("requeue", "no-such-job", url=service.redis.url)
    assert missing.returncode == 1 and "no-such-job" in missing.stderr
    requeued = _cli("requeue", job_id, url=service.redis.url)
    assert requeued.returncode == 0 and job_id in requeued.stdout, requeued.stderr
    result = dead.result(timeout=60)
    assert result.ok and len(result.token_ids) == 5 and result.attempt == 1 and result.metadata == {"k": 1}
    assert service.client.dead_letters() == [] and _cli("list", url=service.redis.url).stdout == ""


def test_the_dead_letter_list_is_bounded_and_expires(service: Service) -> None:
    broker = service.redis.client()
    broker.delete(DEAD_LETTER_KEY)
    for i in range(25):
        dead_letters.push(broker, {"id": f"j{i}", "prompt": "p"}, "test", 6, max_len=10, expires=3600)
    assert broker.llen(DEAD_LETTER_KEY) == 10 and 0 < broker.ttl(DEAD_LETTER_KEY) <= 3600
    assert [e["job"]["id"] for e in service.client.dead_letters()] == [f"j{i}" for i in range(24, 14, -1)]
    purged = _cli("purge", "j24", "j20", url=service.redis.url)
    assert purged.returncode == 0 and "purged 2" in purged.stdout
    assert _cli("purge", "--all", url=service.redis.url).returncode == 0
    assert broker.llen(DEAD_LETTER_KEY) == 0


def test_a_refused_task_id_is_answered_never_left_waiting(service: Service) -> None:
    """An id the worker refuses (not the job-id pattern) still names a result key: the sender gets a failure
    naming it instead of waiting forever."""
    odd_id = f"a b/c {uuid.uuid4().hex}"
    pending = service.team.send_task(TASK_NAME, kwargs={"prompt": "odd id", "max_tokens": 2}, task_id=odd_id)
    with pytest.raises(Exception, match=re.escape(repr(odd_id))) as refused:
        pending.get(timeout=60)
    assert "does not match" in str(refused.value)
    result = service.client.get(odd_id)
    assert result.error.code == "task_failure" and odd_id in result.error.message


@pytest.mark.parametrize("bad_id", [None, "", 12345, "x" * 5000])
def test_a_refused_message_without_a_usable_id_is_set_aside_for_the_dead_letter_tool(service: Service, bad_id: Any) -> None:
    broker = service.redis.client()
    scratch = f"scratch-{uuid.uuid4().hex}"
    service.team.send_task(TASK_NAME, kwargs={"prompt": "no usable id"}, queue=scratch)
    message = json.loads(broker.rpop(scratch))
    message["headers"]["id"] = bad_id
    message["properties"]["delivery_info"]["routing_key"] = service.client.queue
    before = len(service.client.dead_letters())
    broker.lpush(service.client.queue, json.dumps(message))

    def refused_entries() -> list[dict[str, Any]]:
        return [json.loads(line) for line in _cli("list", "--full", url=service.redis.url).stdout.splitlines()
                if "refused_message" in line]

    wait_for(lambda: len(service.client.dead_letters()) > before, 60, "the refused message in the dead-letter list")
    [entry] = [e for e in refused_entries() if e["job"]["refused_message"]["id"] == repr(bad_id)[:200]]
    assert entry["job"]["refused_message"]["task"] == TASK_NAME and "without a usable task id" in entry["reason"]
    assert "no usable id" not in json.dumps(entry)  # the envelope, never the job's content
    requeue = _cli("requeue", "--all", url=service.redis.url)  # not a job: stays, with a warning
    assert requeue.returncode == 0 and "not requeued" in requeue.stderr, requeue.stderr
    assert refused_entries()
    assert _cli("purge", "--all", url=service.redis.url).returncode == 0 and not refused_entries()


def test_the_worker_is_still_serving(service: Service) -> None:
    assert service.worker.process.poll() is None
    assert service.client.submit(prompt="after everything", max_tokens=3).result(timeout=60).ok
    assert "Traceback" not in service.worker.log_text()


def test_worker_size_limit_is_a_setting(tmp_path: Path) -> None:
    from tokenmill.queue.settings import MAX_JOB_BYTES, QueueSettings

    assert QueueSettings().max_job_bytes == MAX_JOB_BYTES == 2**20
    client = Client("redis://127.0.0.1:1/0", max_payload_bytes=2048)
    with pytest.raises(InvalidRequestError, match="2048-byte limit"):
        client.prepare({"prompt": "y" * 3000})
