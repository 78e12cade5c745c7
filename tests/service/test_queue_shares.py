"""Fair shares of a queue (`tokenmill.queue.names.SHARE_HEADER`), against a real redis-server: a take serves the
queue's own list and each share's in turn, priorities keep working inside a share, a share's messages held by a
consumer that dies go back to the queue, and a queued share's job is found by the cancel check."""

from __future__ import annotations

import json
import time
import uuid

import pytest
from kombu import Connection, Consumer, Exchange, Producer, Queue
from service_fixtures import RedisServer, wait_for
from test_queue_transport import _consume

from tokenmill.queue import transport as tm_transport
from tokenmill.queue.app import BROKER_TRANSPORT
from tokenmill.queue.names import SHARE_HEADER, SHARE_LIST, SHARES_KEY

EXCHANGE = Exchange("", type="direct")


def _connection(server: RedisServer) -> Connection:
    return Connection(server.url, transport=BROKER_TRANSPORT, transport_options={"visibility_timeout": 3600})


def _publish(server: RedisServer, queue: Queue, bodies: list[str], share: str | None = None,
             priority: int | None = None) -> None:
    """As tokenmill's publisher sends them: the share in the message's headers, on tokenmill's transport."""
    with _connection(server) as connection:
        producer = Producer(connection.channel(), exchange=EXCHANGE)
        headers = {SHARE_HEADER: share} if share else {}
        for body in bodies:
            producer.publish({"body": body}, routing_key=queue.name, declare=[queue], headers=headers,
                             priority=priority)


def _take_all(server: RedisServer, queue: Queue, count: int) -> list[str]:
    """The bodies of `count` messages, taken with room for more (so that a take also finds the lanes empty)."""
    with _connection(server) as connection:
        return [body for body, _ in _consume(connection, queue, count, prefetch=64)]


def test_a_take_serves_the_queue_and_each_share_in_turn(redis_server: RedisServer) -> None:
    """A backlog in share `big` published first; then a few messages of share `small` and of the queue itself (a
    plain producer). The first messages taken alternate between the three, each lane in its own order, and every
    share found empty leaves the index."""
    queue = Queue(f"q-{uuid.uuid4().hex[:8]}", EXCHANGE, routing_key="q")
    big = [f"big-{i}" for i in range(40)]
    small = [f"small-{i}" for i in range(3)]
    plain = [f"plain-{i}" for i in range(3)]
    _publish(redis_server, queue, big, share="big")
    _publish(redis_server, queue, small, share="small")
    _publish(redis_server, queue, plain)
    client = redis_server.client()
    assert client.smembers(SHARES_KEY.format(queue=queue.name)) == {b"big", b"small"}
    assert client.llen(SHARE_LIST.format(queue=queue.name, share="big")) == 40

    received = _take_all(redis_server, queue, 46)
    assert sorted(received) == sorted(big + small + plain)
    first = received[:9]
    assert sum(body.startswith("small") for body in first) == 3 and sum(body.startswith("plain") for body in first) == 3
    for lane in (big, small, plain):
        assert [body for body in received if body in lane] == lane  # oldest first inside a lane
    assert not client.exists(SHARES_KEY.format(queue=queue.name))


def test_priorities_keep_working_inside_a_share(redis_server: RedisServer) -> None:
    """kombu's Redis priorities (0 first) order a share's own messages, as they order the queue's."""
    queue = Queue(f"q-{uuid.uuid4().hex[:8]}", EXCHANGE, routing_key="q", max_priority=9)
    _publish(redis_server, queue, ["late-0", "late-1"], share="run1", priority=9)
    _publish(redis_server, queue, ["urgent-0", "urgent-1"], share="run1", priority=0)
    assert _take_all(redis_server, queue, 4) == ["urgent-0", "urgent-1", "late-0", "late-1"]


def test_a_dead_consumers_share_messages_go_back_to_the_queue(redis_server: RedisServer) -> None:
    """A consumer registers the processing list of a queue's shares with the queue's own list as the place its items
    go back to, so a consumer that dies between a take and its record loses none of a share's messages."""
    queue = Queue(f"q-{uuid.uuid4().hex[:8]}", EXCHANGE, routing_key="q")
    _publish(redis_server, queue, ["a-0"], share="a")
    client = redis_server.client()
    shares_source = SHARE_LIST.format(queue=queue.name, share="")
    with _connection(redis_server) as connection:
        held: list = []
        with Consumer(connection.channel(), [queue], callbacks=[lambda body, message: held.append(message)]):
            while not held:
                try:
                    connection.drain_events(timeout=1)
                except TimeoutError:
                    pass
            owners = [json.loads(raw) for key, raw in client.hgetall(tm_transport.CONSUMERS_KEY).items()
                      if key.decode().endswith(shares_source)]
            assert owners and all(owner["source"] == queue.name for owner in owners)
            held[0].ack()

    dead = "deadbeef" * 4
    processing = tm_transport.PROCESSING_KEY.format(consumer=dead, source=shares_source)
    client.hset(tm_transport.CONSUMERS_KEY, processing, json.dumps({"consumer": dead, "source": queue.name}))
    _publish(redis_server, queue, ["a-1"], share="a")
    assert client.lmove(SHARE_LIST.format(queue=queue.name, share="a"), processing, "RIGHT", "LEFT")  # its take
    assert _take_all(redis_server, queue, 1) == ["a-1"]  # a live consumer's sweep put it back on the queue
    assert client.llen(processing) == 0


def test_the_cancel_check_finds_a_job_queued_in_a_share(redis_server: RedisServer) -> None:
    """`Client.unknown` (what `tokenmill cancel` asks before recording a cancel) reads the shares' lists too: a job
    queued in a share is known."""
    from tokenmill.client import Client

    queue = f"q-{uuid.uuid4().hex[:8]}"
    with Client(redis_server.url, queue=queue, share="run-7") as client:
        handle = client.submit(prompt="hello", max_tokens=1)
        assert redis_server.client().llen(SHARE_LIST.format(queue=queue, share="run-7")) == 1
        assert client.unknown([handle.id, "no-such-job"], [queue]) == ["no-such-job"]


def test_a_job_queued_behind_another_runs_backlog_is_taken_at_once(redis_server: RedisServer, start_worker) -> None:
    """A real worker busy with a run's backlog in a share of its own: a single client job queued after the whole
    backlog, and a job of another share, finish while most of the backlog still waits (first in, first out they
    came after all of it)."""
    from tokenmill.client import Client

    start_worker(redis_server.url, max_num_seqs=4, num_kv_blocks=256).wait_ready()
    backlog = 400
    with Client(redis_server.url, share="run-big") as big, Client(redis_server.url) as plain, \
            Client(redis_server.url, share="run-small") as small:
        handles = big.submit_many({"id": f"big-{i}", "prompt": f"row {i}", "max_tokens": 24, "ignore_eos": True}
                                  for i in range(backlog))
        wait_for(lambda: big.get(handles[0].id) is not None, 60, "the backlog running")
        probes = [plain.submit(prompt="a lone job", max_tokens=4), small.submit(prompt="another run", max_tokens=4)]
        for probe in probes:
            assert probe.result(timeout=120).status == "succeeded"
        done = sum(big.get(handle.id) is not None for handle in handles)
        assert done < backlog // 2, f"{done} of the {backlog} backlog jobs finished before the probes"
        big.cancel(handles)


def test_a_consumers_prefetch_counts_the_jobs_a_message_carries(redis_server: RedisServer) -> None:
    """Messages of 4 jobs each (`JOBS_HEADER`, as a group message carries it) and a prefetch of 8 jobs: the consumer
    holds 2 of them, not 8, and takes one more as one is acked."""
    queue = _group_messages(redis_server, 6, 4)
    held: list = []
    with _connection(redis_server) as connection, Consumer(
            connection.channel(), [queue], callbacks=[lambda body, message: held.append(message)], prefetch_count=8):
        _drain(connection, 2.0)
        assert len(held) == 2
        held[0].ack()
        _drain(connection, 2.0)
        assert len(held) == 3
        for message in held[1:]:
            message.ack()
        _drain(connection, 2.0)
        assert len(held) == 5


def _group_messages(redis_server: RedisServer, count: int, jobs: int) -> Queue:
    """A new queue holding `count` messages of `jobs` jobs each (`JOBS_HEADER`), Celery task ids group-0, group-1..."""
    from tokenmill.queue.names import JOBS_HEADER

    queue = Queue(f"q-{uuid.uuid4().hex[:8]}", EXCHANGE, routing_key="q")
    with _connection(redis_server) as connection:
        producer = Producer(connection.channel(), exchange=EXCHANGE)
        for i in range(count):
            producer.publish({"body": f"group-{i}"}, routing_key=queue.name, declare=[queue],
                             headers={JOBS_HEADER: jobs, "id": f"group-{i}"})
    return queue


def _drain(connection: Connection, seconds: float) -> None:
    """Let the consumer on `connection` take and deliver messages for `seconds`."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            connection.drain_events(timeout=0.2)
        except TimeoutError:
            pass


def test_a_group_messages_ended_jobs_free_their_prefetch_room(redis_server: RedisServer) -> None:
    """Messages of 4 jobs, a prefetch of 8 jobs: the consumer holds 2; once 3 jobs of the first have ended
    (`transport.jobs_ended`, as the group task reports them) it takes one more while both are still held; a message
    counts one job until acked, however many ended."""
    from tokenmill.queue import transport

    queue = _group_messages(redis_server, 6, 4)
    held: list = []
    with _connection(redis_server) as connection, Consumer(
            connection.channel(), [queue], callbacks=[lambda body, message: held.append(message)], prefetch_count=8):
        _drain(connection, 1.0)
        assert [m.headers["id"] for m in held] == ["group-0", "group-1"]
        transport.jobs_ended("group-0", 3)
        transport.jobs_ended("not-held", 4)
        _drain(connection, 1.0)
        assert len(held) == 3 and not any(m.acknowledged for m in held)
        transport.jobs_ended("group-1", 9)  # more than it carries: it still counts one
        _drain(connection, 1.0)
        assert len(held) == 4  # room 2 (held: 1 + 1 + 4 jobs): one more message, and no room after it


def test_a_take_whose_room_runs_out_still_takes_each_lanes_single_job(redis_server: RedisServer) -> None:
    """Room for 4 jobs; shares `big` and `other` hold group messages of 4 jobs, the queue itself and share `small` a
    single job each. Whichever lane a take starts with (the turn moves one lane a take), its first take holds exactly
    one group and both single jobs: once the room runs out, the round ends with the single jobs only."""
    from tokenmill.queue.names import JOBS_HEADER

    for _ in range(4):
        queue = Queue(f"q-{uuid.uuid4().hex[:8]}", EXCHANGE, routing_key="q")
        with _connection(redis_server) as connection:
            producer = Producer(connection.channel(), exchange=EXCHANGE)
            for body, headers in [*((f"big-{i}", {SHARE_HEADER: "big", JOBS_HEADER: 4}) for i in range(3)),
                                  *((f"other-{i}", {SHARE_HEADER: "other", JOBS_HEADER: 4}) for i in range(3)),
                                  ("small", {SHARE_HEADER: "small"}), ("plain", {})]:
                producer.publish({"body": body}, routing_key=queue.name, declare=[queue], headers=headers)
        held: list = []
        with _connection(redis_server) as connection, Consumer(
                connection.channel(), [queue], callbacks=[lambda body, message: held.append(body["body"])],
                prefetch_count=4):
            _drain(connection, 1.0)
        assert sorted(held)[-2:] == ["plain", "small"] and len(held) == 3, held


def test_a_consumer_blocked_on_the_queue_wakes_for_a_shares_message(redis_server: RedisServer) -> None:
    """A consumer blocked in BLMOVE on the queue's own list (for 5 s here) is woken at once by a share's message:
    the publish rang the bell on that list; the consumer drops the bell and takes next."""
    from kombu.transport import redis as kombu_redis

    from tokenmill.queue.names import SHARE_BELL

    queue = Queue(f"q-{uuid.uuid4().hex[:8]}", EXCHANGE, routing_key="q")
    received: list[str] = []
    with _connection(redis_server) as connection:
        channel = connection.channel()
        channel.brpop_timeout = 5
        with Consumer(channel, [queue], callbacks=[lambda body, message: (received.append(body["body"]),
                                                                          message.ack())]):
            channel._take_many, channel._found_empty = False, True  # as after a take that found nothing
            connection.transport.cycle._register_BRPOP(channel)  # BLMOVE on the queue's own list, for up to 5 s
            time.sleep(0.2)
            _publish(redis_server, queue, ["wake"], share="run-1")
            sent = time.monotonic()
            with pytest.raises(kombu_redis.Empty):
                channel._brpop_read()  # the bell
            assert time.monotonic() - sent < 1.0
            deadline = time.monotonic() + 10
            while not received and time.monotonic() < deadline:
                try:
                    connection.drain_events(timeout=0.2)
                except TimeoutError:
                    pass
    assert received == ["wake"]
    client = redis_server.client()
    assert all(SHARE_BELL.encode() not in client.lrange(key, 0, -1)
               for key in [queue.name, *client.hkeys(tm_transport.CONSUMERS_KEY)])


def test_a_groups_ended_jobs_let_the_worker_take_more_while_its_long_job_runs(redis_server: RedisServer,
                                                                             start_worker) -> None:
    """A real worker (prefetch 5 jobs) holds two group messages of 4 jobs, each with one long job: once their short
    jobs end, a single job queued after them is taken and finishes while both long jobs still run. (With the groups
    counting all 4 jobs until acked, it waited for a long job to end; a group's results are stored at its end.)"""
    from tokenmill.client import Client
    from tokenmill.queue.names import BATCH_TASK_NAME, JOBS_HEADER
    from tokenmill.queue.schemas import message_wire

    start_worker(redis_server.url, max_num_seqs=4, num_kv_blocks=512).wait_ready()
    with Client(redis_server.url) as client:
        groups = [[{"id": f"g{g}-long", "prompt": "long", "max_tokens": 1500, "ignore_eos": True}]
                  + [{"id": f"g{g}-short-{i}", "prompt": "short", "max_tokens": 2} for i in range(3)]
                  for g in range(2)]
        for group in groups:
            client.publisher.publish(BATCH_TASK_NAME, uuid.uuid4().hex, [{"jobs": [message_wire(j) for j in group]}],
                                     "[<4 jobs>]", {JOBS_HEADER: 4}, ignore_result=True)
        wait_for(lambda: redis_server.client().llen(client.queue) == 0, 60, "both groups taken")
        probe = client.submit(prompt="a lone job", max_tokens=4)
        assert probe.result(timeout=120).status == "succeeded"
        assert client.get("g0-long") is None and client.get("g1-long") is None, "a long job ended before the probe"
        ids = [job["id"] for group in groups for job in group]
        assert [result.status for result in client.results(ids, 300)] == ["succeeded"] * 8


@pytest.mark.parametrize("path", ["single-job-intake", "celery-pool", "group-messages"])
def test_the_engine_admits_a_jobs_share_before_another_shares_waiting_jobs(redis_server: RedisServer, start_worker,
                                                                          path: str) -> None:
    """A real worker holding far more jobs than its engine runs (`--concurrency` 24, `max_num_seqs` 2): its engine
    queue is full of one run's jobs (single jobs, through the intake or Celery's pool, or group messages of 8, as
    `annotate --broker` sends them) when a single client job is taken. The engine admits it at the next free slot (its
    share runs nothing) instead of after the run's jobs taken before it: few of them end meanwhile."""
    from tokenmill.client import Client
    from tokenmill.queue.names import BATCH_TASK_NAME, JOBS_HEADER
    from tokenmill.queue.schemas import message_wire

    flags = {"no_single_job_intake": True} if path == "celery-pool" else {}
    start_worker(redis_server.url, max_num_seqs=2, concurrency=24, num_kv_blocks=256, **flags).wait_ready()
    jobs = [{"id": f"big-{i}", "prompt": f"row {i}", "max_tokens": 12, "ignore_eos": True} for i in range(200)]
    with Client(redis_server.url, share="run-big") as big, Client(redis_server.url) as plain:
        if path == "group-messages":
            for start in range(0, len(jobs), 8):
                group = [message_wire(big.prepare(job)) for job in jobs[start:start + 8]]
                big.publisher.publish(BATCH_TASK_NAME, uuid.uuid4().hex, [{"jobs": group}], "[<8 jobs>]",
                                      {JOBS_HEADER: len(group)}, ignore_result=True)
        else:
            big.submit_many(jobs)
        handles = [job["id"] for job in jobs]
        wait_for(lambda: big.get(handles[0]) is not None, 60, "the backlog running")
        probe = plain.submit(prompt="a lone job", max_tokens=4).result(timeout=120)
        assert probe.status == "succeeded"
        big.cancel(handles)
        ended = [result for result in big.results(handles, 120) if result.status == "succeeded"]
        meanwhile = sum(probe.started_at < result.finished_at < probe.finished_at for result in ended)
        # Taken, it waited behind up to 22 of the run's jobs in the engine's own first-in, first-out queue (12 or more
        # end meanwhile); in shares it takes the next free slot, and ends after the 4 tokens it runs beside one of the
        # run's jobs (1-2 end meanwhile, more on a loaded machine while the job goes from the take to the engine)
        assert meanwhile <= 6, f"{meanwhile} of the run's jobs ended between the worker taking the lone job and its end"
