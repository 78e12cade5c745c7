"""The client: validation before anything is queued, real Celery messages, torch-free import."""

from __future__ import annotations

import base64
import json
import subprocess
import sys

import pytest
from service_fixtures import REPO, RedisServer

from tokenmill.client import Client, JobTimeoutError
from tokenmill.errors import InvalidRequestError
from tokenmill.queue.names import JOB_HASH_HEADER
from tokenmill.queue.schemas import Job, content_hash


def _queued(server: RedisServer, queue: str = "tokenmill") -> list[dict]:
    return [json.loads(raw) for raw in server.client().lrange(queue, 0, -1)]


def test_importing_the_client_does_not_import_torch() -> None:
    code = (
        "import sys\n"
        "from tokenmill import Client\n"
        "import tokenmill.client, tokenmill.queue.app\n"
        "Client('redis://127.0.0.1:1/0')\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
        "assert 'transformers' not in sys.modules, 'transformers was imported'\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize(
    ("fields", "field"),
    [({"prompt": "x", "max_tokens": -1}, "max_tokens"), ({"prompt": "x", "temprature": 0.5}, "temprature"), ({}, "prompt")],
)
def test_invalid_job_is_refused_before_the_queue(redis_server: RedisServer, fields: dict, field: str) -> None:
    client = Client(redis_server.url)
    with pytest.raises(InvalidRequestError) as caught:
        client.submit(**fields)
    assert caught.value.field == field
    assert _queued(redis_server) == []


def test_oversized_job_is_refused_naming_the_big_field(redis_server: RedisServer) -> None:
    client = Client(redis_server.url, max_payload_bytes=10_000)
    with pytest.raises(InvalidRequestError) as caught:
        client.submit(prompt="ok", metadata={"blob": "x" * 20_000})
    assert caught.value.field == "metadata"
    assert "10000-byte limit" in caught.value.message
    with pytest.raises(InvalidRequestError) as caught:
        client.submit(prompt="y" * 20_000)
    assert caught.value.field == "prompt"
    assert _queued(redis_server) == []


def test_submit_many_queues_nothing_if_any_job_is_bad(redis_server: RedisServer) -> None:
    client = Client(redis_server.url)
    jobs = [{"prompt": f"p{i}"} for i in range(10)] + [{"prompt": "bad", "top_p": 0}]
    with pytest.raises(InvalidRequestError) as caught:
        client.submit_many(jobs)
    assert caught.value.field == "jobs[10].top_p"
    assert _queued(redis_server) == []


def test_submit_many_refuses_an_id_given_twice_and_queues_nothing(redis_server: RedisServer) -> None:
    client = Client(redis_server.url)
    jobs = [{"id": "a", "prompt": "first"}, {"id": "b", "prompt": "other"}, {"id": "a", "prompt": "second"}]
    with pytest.raises(InvalidRequestError, match=r"'a' is also the id of jobs\[0\]") as caught:
        client.submit_many(jobs)
    assert caught.value.field == "jobs[2].id"
    assert _queued(redis_server) == []


def test_handles_that_share_an_id_each_get_their_own_answer(redis_server: RedisServer) -> None:
    """Two submits under one id with different content: the stored result is the job's that ran; a wait over both
    handles, in either order, answers the other handle with a conflict, never with that job's result."""
    from tokenmill.queue.schemas import JobResult

    client = Client(redis_server.url)
    ran, reused = client.submit(id="shared", prompt="first"), client.submit(id="shared", prompt="second")
    stored = JobResult(id="shared", status="succeeded", text="t", token_ids=[1], job_hash=ran.job_hash)
    client.app.backend.store_result("shared", stored.to_wire(), "SUCCESS")
    for order in ([ran, reused], [reused, ran]):
        answers = dict(zip(map(id, order), client.results(order, timeout=30)))
        assert answers[id(ran)] == stored
        assert (answers[id(reused)].status, answers[id(reused)].error.code) == ("failed", "conflict")
        seen = list(client.as_completed(order, timeout=30))
        assert sorted(r.status for r in seen) == ["failed", "succeeded"]
    assert client.results(["shared", ran], timeout=30) == [stored, stored]  # a bare id takes the stored result


def test_messages_are_celery_protocol_2_json_tasks(redis_server: RedisServer) -> None:
    client = Client(redis_server.url)
    handles = client.submit_many([{"prompt": "secret prompt text", "max_tokens": 3, "id": "job-1"}, {"prompt": "b"}])
    queued = _queued(redis_server)
    assert len(queued) == 2
    message = next(m for m in queued if m["headers"]["id"] == "job-1")
    assert message["content-type"] == "application/json"
    assert message["headers"]["task"] == "tokenmill.generate"
    assert "secret prompt text" not in json.dumps(message["headers"])  # argsrepr never carries the prompt
    args, kwargs, embed = json.loads(base64.b64decode(message["body"]))
    assert args[0]["prompt"] == "secret prompt text" and args[0]["sampling"]["max_tokens"] == 3
    assert kwargs == {} and set(embed) == {"callbacks", "errbacks", "chain", "chord"}
    assert [h.id for h in handles][0] == "job-1"
    # each handle carries its own job's hash, the one its message's header tells the worker (hashed as it is published)
    by_id = {m["headers"]["id"]: m for m in queued}
    for handle in handles:
        wire = json.loads(base64.b64decode(by_id[handle.id]["body"]))[0][0]
        # the message leaves out sampling defaults (`message_wire`): the job a worker parses from it hashes the same
        assert handle.job_hash == Job.from_wire(wire).content_hash() == by_id[handle.id]["headers"][JOB_HASH_HEADER]
        assert content_hash(Job.from_wire(wire).to_wire()) == handle.job_hash


def test_result_timeout_is_a_clear_error(redis_server: RedisServer) -> None:
    client = Client(redis_server.url)
    handle = client.submit(prompt="nobody is listening")
    with pytest.raises(JobTimeoutError) as caught:
        handle.result(timeout=0.3)
    assert handle.id in str(caught.value) and caught.value.job_ids == [handle.id]


def test_submit_many_queues_every_job(redis_server: RedisServer) -> None:
    """2000 jobs in one call all land on the queue. Its speed (goal >= 2000 jobs/s on 2 cores) is measured by
    benchmarks/job_queue.py, not asserted here: a timing assertion fails on a loaded machine."""
    client = Client(redis_server.url)
    handles = client.submit_many([{"prompt": f"short prompt {i}", "max_tokens": 16} for i in range(2000)])
    assert len({h.id for h in handles}) == 2000
    assert redis_server.client().llen("tokenmill") == 2000


def test_submit_many_queues_its_first_jobs_while_it_encodes_the_rest(redis_server: RedisServer) -> None:
    """The pipelined writes grow from 32 jobs, doubling up to 1000: a worker starts on the first jobs while the
    client still encodes the others (with one write of 1000, the queue stayed empty until the last was encoded).
    The queue's length is read, from another connection, as each job is about to be published."""
    server = redis_server.client()
    queued_before: list[int] = []

    class Watched(Client):
        def _task(self, wire, job_hash):  # type: ignore[no-untyped-def]
            queued_before.append(server.llen("tokenmill"))
            return super()._task(wire, job_hash)

    Watched(redis_server.url).submit_many([{"prompt": f"p{i}"} for i in range(2100)])
    written = sorted(set(queued_before))
    assert written == [0, 32, 64, 128, 256, 512, 1024, 2024], written  # then the last 76 as the call ends
    prompts = [json.loads(base64.b64decode(message["body"]))[0][0]["prompt"] for message in _queued(redis_server)]
    assert prompts == [f"p{i}" for i in reversed(range(2100))]  # each job once, the first at the tail workers take from


def test_submits_bind_their_queue_once_per_channel_and_declare_it_as_kombu_does(redis_server: RedisServer,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """kombu binds (copies) an unbound queue at each publish just to check that it was declared; the client binds it
    once per producer channel, for `submit_many` and `submit` alike (six binds here before). The queue is still
    declared, so a plain Celery worker routes the jobs as before; after a Redis restart `submit` still queues."""
    from kombu import Queue

    binds: list[str] = []
    bind = Queue.bind
    monkeypatch.setattr(Queue, "bind", lambda queue, channel: binds.append(queue.name) or bind(queue, channel))
    client = Client(redis_server.url)
    client.submit_many([{"prompt": f"p{i}"} for i in range(50)])
    for i in range(5):
        client.submit(prompt=f"one {i}")
    assert binds == ["tokenmill"]
    server = redis_server.client()
    assert server.llen("tokenmill") == 55 and server.smembers("_kombu.binding.tokenmill")
    redis_server.stop()
    redis_server.start()
    client.submit(prompt="after a restart")  # on the channel kombu opens anew, the queue bound to it
    assert redis_server.client().llen("tokenmill") == 56


def test_a_waiting_client_rides_out_a_redis_restart(redis_server: RedisServer) -> None:
    import time
    from concurrent.futures import ThreadPoolExecutor

    from tokenmill.queue.schemas import JobResult

    client = Client(redis_server.url)
    handle = client.submit(prompt="x")
    redis_server.stop()
    with ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(handle.result, 60)
        time.sleep(1.0)  # the outage: the client starts waiting while Redis is down
        redis_server.start()
        stored = JobResult(id=handle.id, status="succeeded", text="t", token_ids=[1])
        client.app.backend.store_result(handle.id, stored.to_wire(), "SUCCESS")  # as the worker's Celery does
        assert waiting.result(timeout=60) == stored


def test_a_wait_that_times_out_while_redis_is_down_says_so(redis_server: RedisServer,
                                                           caplog: pytest.LogCaptureFixture) -> None:
    """A slow job and an unreachable Redis are told apart: the timeout names Redis, and the wait logs once that it
    is not answering (a wait without a timeout would otherwise wait silently)."""
    import logging
    import time

    client = Client(redis_server.url)
    handle = client.submit(prompt="x")
    redis_server.stop()
    try:
        with caplog.at_level(logging.WARNING, logger="tokenmill.client"):
            started = time.monotonic()
            with pytest.raises(JobTimeoutError, match=r"no result after 2s .*\(Redis not answering: ConnectionError"):
                handle.result(timeout=2)
            assert time.monotonic() - started < 15
        said = [r.getMessage() for r in caplog.records if "Redis does not answer" in r.getMessage()]
        assert len(said) == 1 and said[0].startswith("waiting for 1 result(s)")
    finally:
        redis_server.start()
    with pytest.raises(JobTimeoutError) as quiet:
        handle.result(timeout=0.5)  # Redis answers again: a slow job's timeout, no word of Redis
    assert "Redis" not in str(quiet.value)


def test_as_completed_with_a_tick_yields_none_while_waiting_on_one_subscription(redis_server: RedisServer) -> None:
    """The HTTP API's batch driver waits for thousands of results and does periodic work meanwhile: each tick is a
    None from the same watch, never a new subscription to every pending key."""
    import time

    from tokenmill.queue.schemas import JobResult

    client = Client(redis_server.url)
    handles = [client.submit(prompt=f"x {i}") for i in range(3)]
    watch = client.as_completed(handles, tick=0.2)
    started = time.monotonic()
    assert next(watch) is None and next(watch) is None  # nothing stored yet: a tick every 0.2 s
    assert 0.3 <= time.monotonic() - started < 10
    redis = redis_server.client()
    subscribes = redis.info("commandstats")["cmdstat_subscribe"]["calls"]
    assert next(watch) is None
    assert redis.info("commandstats")["cmdstat_subscribe"]["calls"] == subscribes
    stored = {}
    for handle in handles:
        stored[handle.id] = JobResult(id=handle.id, status="succeeded", text="t", token_ids=[1])
        client.app.backend.store_result(handle.id, stored[handle.id].to_wire(), "SUCCESS")
    got = [result for result in watch if result is not None]  # ends once all three are in
    assert sorted(got, key=lambda r: r.id) == sorted(stored.values(), key=lambda r: r.id)


def test_waits_one_after_another_share_one_pubsub_connection(redis_server: RedisServer) -> None:
    """A wait leaves its pub/sub connection to the next (which unsubscribes it) instead of closing it: fails where each
    `result()` connects anew (five more connections). A notification of an earlier wait, still unread on the kept
    connection, is not taken for a later job's; a kept connection Redis dropped (a restart) is replaced. Results are
    stored through a backend of their own, as a worker's: storing through the client's pool, a store still holding
    its connection as the next wait began made that wait's first read open another."""
    import threading
    import time

    from tokenmill.queue.schemas import JobResult

    client = Client(redis_server.url)
    redis = redis_server.client()
    worker_backend = Client(redis_server.url).app.backend

    def store(job_id: str, text: str, delay: float = 0.0) -> JobResult:
        stored = JobResult(id=job_id, status="succeeded", text=text, token_ids=[1])
        threading.Timer(delay, worker_backend.store_result, (job_id, stored.to_wire(), "SUCCESS")).start()
        return stored  # stored after `delay` seconds, as the worker's Celery stores (SET, then PUBLISH)

    earlier, unread = client.submit(prompt="earlier"), client.submit(prompt="left unread")
    watch = client.as_completed([earlier, unread])
    first = store(earlier.id, "earlier", 0.2)
    assert next(watch) == first  # announced on pub/sub
    store(unread.id, "unread")
    time.sleep(0.3)  # its notification waits, unread, on the connection the wait is about to leave
    watch.close()
    connections = redis.info("stats")["total_connections_received"]
    for i in range(5):
        handle = client.submit(prompt=f"later {i}")
        stored = store(handle.id, f"later {i}", 0.05)
        assert handle.result(timeout=10) == stored
    assert redis.info("stats")["total_connections_received"] == connections

    redis_server.stop()
    redis_server.start()
    handle = client.submit(prompt="after a restart")
    stored = store(handle.id, "after a restart", 0.05)
    assert handle.result(timeout=30) == stored


def test_a_finished_wait_is_unsubscribed_by_the_next_wait_not_before_result_returns(redis_server: RedisServer) -> None:
    """`result()` returns as soon as its result is read: its channel is unsubscribed when the kept connection is next
    taken (0.35 ms of a lone job's wait after a pause), and the next wait gets its own result only."""
    import threading

    from tokenmill.queue.schemas import JobResult

    client = Client(redis_server.url)
    redis = redis_server.client()

    def waited(prompt: str) -> tuple[bytes, JobResult]:
        handle = client.submit(prompt=prompt)
        stored = JobResult(id=handle.id, status="succeeded", text=prompt, token_ids=[1])
        threading.Timer(0.05, client.app.backend.store_result, (handle.id, stored.to_wire(), "SUCCESS")).start()
        assert handle.result(timeout=10) == stored
        return client.app.backend.get_key_for_task(handle.id), stored

    first_key, _ = waited("first")
    assert redis.pubsub_numsub(first_key) == [(first_key, 1)]
    second_key, _ = waited("second")
    assert redis.pubsub_numsub(first_key, second_key) == [(first_key, 0), (second_key, 1)]


def test_logprobs_come_back_from_a_worker_with_each_token_s_text_and_bytes(redis_server: RedisServer,
                                                                           start_worker) -> None:
    """`submit(..., logprobs=N)`: a real worker's result holds, per generated token, its id, text and own bytes, its
    logprob, and the N alternatives with their texts (builtin:tiny: ids below 256 are one byte each, so a byte of a
    UTF-8 character decodes to U+FFFD yet keeps its byte)."""
    from tokenmill.engine.tiny import tiny_tokenizer

    start_worker(redis_server.url).wait_ready()
    with Client(redis_server.url) as client:
        result = client.submit(prompt="héllo", max_tokens=8, temperature=0.0, logprobs=2).result(timeout=120)
    tokenizer = tiny_tokenizer()

    def own(token_id: int) -> list:
        text = tokenizer.decode([token_id])
        return [text, [token_id] if token_id < 256 else list(text.encode())]

    assert [entry["token_id"] for entry in result.logprobs] == result.token_ids and result.token_ids
    for entry in result.logprobs:
        assert [entry["token"], entry["bytes"]] == own(entry["token_id"]) and entry["logprob"] <= 0
        assert len(entry["top_logprobs"]) == 2
        assert entry["top_tokens"] == [own(token_id) for token_id, _ in entry["top_logprobs"]]
    assert any(b >= 0x80 for entry in result.logprobs for b in entry["bytes"])


def test_embed_through_a_worker_equals_the_engine_s_vectors(redis_server: RedisServer, start_worker) -> None:
    """`Client.embed`: embedding jobs on a real worker give the vectors `LLM.embed` gives here (to 1e-5), in input
    order, with `dimensions`, `pooling` and `normalize`; a job's result carries its prompt tokens as usage and no
    completion; a bad option is refused before anything is queued."""
    from tokenmill import LLM

    texts = ["the first text", "a second, longer text to embed", "é"]
    llm = LLM("builtin:tiny")
    start_worker(redis_server.url).wait_ready()
    with Client(redis_server.url) as client:
        got = client.embed(texts, timeout=120)
        cut = client.embed(texts, dimensions=8, pooling="mean", timeout=120)
        tokens = client.embed([1, 2, 3], normalize=False, timeout=120)
        result = client.submit(prompt=texts[0], embed={}).result(timeout=120)
        with pytest.raises(InvalidRequestError) as caught:
            client.embed(texts, dimensions=0)
    assert caught.value.field == "jobs[0].embed.dimensions" and _queued(redis_server) == []
    expected = [out.embedding for out in llm.embed(texts)]
    assert [len(v) for v in got] == [64] * 3
    _close(got, expected)
    _close(cut, [out.embedding for out in llm.embed(texts, dimensions=8, pooling="mean")])
    assert [len(v) for v in cut] == [8] * 3
    _close(tokens, [llm.embed([[1, 2, 3]], normalize=False)[0].embedding])
    _close([result.embedding], expected[:1])
    assert result.text == "" and not result.token_ids and result.usage.completion_tokens == 0
    assert result.usage.prompt_tokens == result.usage.total_tokens == llm.embed(texts[:1])[0].num_prompt_tokens


def _close(got: list[list[float]], expected: list[list[float]], tolerance: float = 1e-5) -> None:
    assert [len(vector) for vector in got] == [len(vector) for vector in expected]
    assert max(abs(x - y) for a, b in zip(got, expected) for x, y in zip(a, b)) <= tolerance


def test_score_through_a_worker_equals_the_engine_s_scores(redis_server: RedisServer, start_worker) -> None:
    """`Client.score`: a score job on a real worker gives each continuation's log-likelihood and greediness as
    `LLM.score` gives them here (to 1e-5), in order, for text and token-id continuations and prompts; its result has
    no completion; a bad continuation is refused before anything is queued, one the engine refuses fails its job."""
    from tokenmill import LLM
    from tokenmill.client import JobFailedError

    prompt, continuations = "The capital of France is", [" Paris", " Rome and more", [7, 8, 9], "é"]
    llm = LLM("builtin:tiny")
    start_worker(redis_server.url).wait_ready()
    with Client(redis_server.url) as client:
        got = client.score(prompt, continuations, timeout=120)
        many = client.score_many([([1, 2, 3], [[4], [5, 6]]), (prompt, [" x"])], timeout=120)
        result = client.submit(prompt=prompt, score={"continuations": [" Paris"]}).result(timeout=120)
        with pytest.raises(InvalidRequestError) as caught:
            client.score(prompt, [""])
        assert caught.value.field.startswith("jobs[0].score.continuations[0]") and _queued(redis_server) == []
        with pytest.raises(JobFailedError) as failed:
            client.score(prompt, [[10**9]], timeout=120)
    assert failed.value.result.error.code == "invalid_request"
    for scores, (p, c) in ((got, (prompt, continuations)), (many[0], ([1, 2, 3], [[4], [5, 6]])),
                           (many[1], (prompt, [" x"]))):
        expected = llm.score(p, c)
        assert [s.num_tokens for s in scores] == [len(e.token_ids) for e in expected]
        assert [s.is_greedy for s in scores] == [e.is_greedy for e in expected]
        assert max(abs(s.logprob - e.logprob) for s, e in zip(scores, expected)) <= 1e-5
    assert result.text == "" and not result.token_ids and result.usage.completion_tokens == 0
    assert abs(result.scores[0].logprob - llm.score(prompt, [" Paris"])[0].logprob) <= 1e-5


def test_clients_sharing_a_subscription_wait_on_one_connection_and_ride_out_a_restart(
        redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """Nine waits at once, from two clients given one `SharedSubscription`: Redis sees one subscribed connection
    where each wait held its own; every wait gets its own results, announced on pub/sub (the waits' sweeps, after
    the first, are 60 s apart here), a key two waits wait for reaches both; each key is unsubscribed once its waits
    end; after a Redis restart the keys still waited for are subscribed again and their results announced. Redis down
    for 3 s (six reconnect attempts) is logged once."""
    import time
    from concurrent.futures import ThreadPoolExecutor

    from service_fixtures import wait_for

    import tokenmill.client
    from tokenmill.client import SharedSubscription
    from tokenmill.queue.schemas import JobResult
    from tokenmill.queue.tls import redis_client

    shared = SharedSubscription(redis_client(redis_server.url, max_connections=4, pool_timeout=5), confirm_timeout=5)
    clients = [Client(redis_server.url, subscription=shared) for _ in range(2)]
    worker = Client(redis_server.url).app.backend
    redis = redis_server.client()

    def store(job_id: str) -> None:
        worker.store_result(job_id, JobResult(id=job_id, status="succeeded", text=job_id, token_ids=[1]).to_wire(),
                            "SUCCESS")

    monkeypatch.setattr(tokenmill.client, "_SWEEP_INTERVAL", 60.0)
    groups = [[f"job-{g}-{i}" for i in range(20)] for g in range(8)]
    groups.append(groups[0][:5])  # a second wait for five of the first wait's keys
    try:
        with ThreadPoolExecutor(len(groups)) as pool:
            waits = [pool.submit(clients[n % 2].results, ids, 30) for n, ids in enumerate(groups)]
            wait_for(lambda: shared.keys == 160, 10, "every wait subscribed")
            assert sum(int(client["sub"]) > 0 for client in redis.client_list()) == 1
            time.sleep(0.2)  # past each wait's first sweep
            for job_id in (job_id for ids in groups[:8] for job_id in ids):
                store(job_id)
            got = [[result.id for result in wait.result(timeout=30)] for wait in waits]
        assert got == groups
        assert shared.keys == 0
        key = worker.get_key_for_task(groups[0][0])
        assert redis.pubsub_numsub(key) == [(key, 0)]

        with ThreadPoolExecutor(1) as pool:
            waiting = pool.submit(clients[0].results, ["after-restart"], 60)
            key = worker.get_key_for_task("after-restart")
            wait_for(lambda: redis.pubsub_numsub(key) == [(key, 1)], 10, "the wait subscribed")
            with caplog.at_level("WARNING", logger="tokenmill.client"):
                redis_server.stop()
                time.sleep(3)
                redis_server.start()
                redis = redis_server.client()
                wait_for(lambda: redis.pubsub_numsub(key) == [(key, 1)], 20, "the key subscribed again")
            failed = [r for r in caplog.records if "shared results subscription failed" in r.getMessage()]
            assert len(failed) == 1, [r.getMessage() for r in failed]
            store("after-restart")
            assert [result.id for result in waiting.result(timeout=30)] == ["after-restart"]
    finally:
        for client in clients:
            client.close()
        shared.close()


def test_a_shared_subscription_connects_outside_its_lock(redis_server: RedisServer) -> None:
    """The first wait's connect is the reader's, outside the lock: with the pool exhausted, a take returns within
    `confirm_timeout` (the wait then sweeps), a subscribe fails at once instead of queueing behind the connect, and
    `close` returns at once; once a connection frees, the subscription connects and announcements arrive; a close
    during the connect gives its connection back to the pool."""
    import time

    import redis
    from service_fixtures import wait_for

    from tokenmill.client import SharedSubscription
    from tokenmill.queue.schemas import JobResult
    from tokenmill.queue.tls import redis_client

    worker = Client(redis_server.url).app.backend
    client = redis_client(redis_server.url, max_connections=1, pool_timeout=3)
    pool = client.connection_pool
    held = pool.get_connection()
    shared = SharedSubscription(client, confirm_timeout=0.5)
    try:
        started = time.monotonic()
        feed = shared.take()
        assert time.monotonic() - started < 1.5
        started = time.monotonic()
        with pytest.raises(redis.ConnectionError):
            feed.subscribe(worker.get_key_for_task("first"))
        assert time.monotonic() - started < 0.5
        pool.release(held)
        wait_for(lambda: _subscribed(feed, worker.get_key_for_task("first")), 10, "the subscription connected")
        worker.store_result("first", JobResult(id="first", status="succeeded", text="x", token_ids=[1]).to_wire(),
                            "SUCCESS")
        message = feed.get_message(timeout=10)
        assert message is not None and message["channel"] == worker.get_key_for_task("first")
    finally:
        shared.close()

    held = pool.get_connection()  # the subscription's connection is back in the pool
    closing = SharedSubscription(client, confirm_timeout=0.5)
    closing.take()
    started = time.monotonic()
    closing.close()
    assert time.monotonic() - started < 0.5
    pool.release(held)
    wait_for(lambda: pool.pool.qsize() == pool.max_connections, 10, "the reader gave its connection back")
    client.close()


def test_a_shared_subscriptions_reader_that_dies_gives_its_connection_back_and_is_replaced(
        redis_server: RedisServer) -> None:
    """A reader killed by an unexpected error gives its connection back to the pool; the next take starts a new
    reader, whose subscription gets announcements again."""
    from service_fixtures import wait_for

    from tokenmill.client import SharedSubscription
    from tokenmill.queue.schemas import JobResult
    from tokenmill.queue.tls import redis_client

    worker = Client(redis_server.url).app.backend
    client = redis_client(redis_server.url, max_connections=1, pool_timeout=5)
    shared = SharedSubscription(client, confirm_timeout=5)

    def store(job_id: str) -> None:
        worker.store_result(job_id, JobResult(id=job_id, status="succeeded", text="x", token_ids=[1]).to_wire(),
                            "SUCCESS")

    def broken(reply: object) -> None:
        raise RuntimeError("a bug in the reader")

    try:
        feed = shared.take()
        feed.subscribe(worker.get_key_for_task("first"))
        shared._dispatch, dispatch = broken, shared._dispatch
        store("first")
        wait_for(lambda: client.connection_pool.pool.qsize() == 1, 10, "the dead reader's connection back in the pool")
        shared._dispatch = dispatch
        feed = shared.take()
        wait_for(lambda: _subscribed(feed, worker.get_key_for_task("second")), 10, "a new reader subscribed")
        store("second")
        message = feed.get_message(timeout=10)
        assert message is not None and message["channel"] == worker.get_key_for_task("second")
    finally:
        shared.close()
        client.close()


def _subscribed(feed: object, key: bytes) -> bool:
    """Whether `feed` subscribed `key`; False while its shared subscription is not connected."""
    import redis

    try:
        feed.subscribe(key)
        return True
    except redis.ConnectionError:
        return False
