"""tokenmill's Redis transport against a real redis-server, in process: the atomic take-and-record, the
requeue of a dead consumer's processing list, and the reconnect crash of kombu's transport."""

from __future__ import annotations

import json
import logging
import threading
import time
import uuid

import pytest
from kombu import Connection, Consumer, Exchange, Producer, Queue
from service_fixtures import RedisServer, wait_for

from tokenmill.queue import transport as tm_transport
from tokenmill.queue.app import BROKER_TRANSPORT

EXCHANGE = Exchange("jobs", type="direct")


def _connection(server: RedisServer, transport: str = BROKER_TRANSPORT, **options: float) -> Connection:
    return Connection(server.url, transport=transport, transport_options={"visibility_timeout": 3600, **options})


def _publish(server: RedisServer, queue: Queue, count: int) -> list[str]:
    with Connection(server.url) as producer_connection:  # a plain kombu producer: redis:// as usual
        producer = Producer(producer_connection.channel(), exchange=EXCHANGE)
        bodies = [f"job-{uuid.uuid4().hex}" for _ in range(count)]
        for body in bodies:
            producer.publish({"body": body}, routing_key=queue.routing_key, declare=[queue])
    return bodies


def _consume(connection: Connection, queue: Queue, count: int, ack: bool = True, received: list | None = None,
             prefetch: int | None = None) -> list:
    """(body, message) of `count` messages, appended to `received` (if given) as they come; a prefetch of `count`
    unless given."""
    received = [] if received is None else received

    def on_message(body: dict, message: object) -> None:
        received.append((body["body"], message))
        if ack:
            message.ack()

    with Consumer(connection.channel(), [queue], callbacks=[on_message], prefetch_count=prefetch or count):
        deadline = time.monotonic() + 20
        while len(received) < count and time.monotonic() < deadline:
            try:
                connection.drain_events(timeout=1)
            except TimeoutError:
                pass
    return received


def test_a_message_is_recorded_unacked_by_one_script_and_acked_away(redis_server: RedisServer) -> None:
    queue = Queue(f"q-{uuid.uuid4().hex[:8]}", EXCHANGE, routing_key="r1")
    bodies = _publish(redis_server, queue, 3)
    client = redis_server.client()
    with _connection(redis_server) as connection:
        held = _consume(connection, queue, 3, ack=False)
        assert sorted(body for body, _ in held) == sorted(bodies)
        assert client.hlen("unacked") == 3 and client.zcard("unacked_index") == 3
        processing = [key for key in client.hkeys(tm_transport.CONSUMERS_KEY)]
        assert processing and all(client.llen(key) == 0 for key in processing)  # moved on to `unacked`
        for _, message in held:
            message.ack()
        assert client.hlen("unacked") == 0 and client.zcard("unacked_index") == 0


def test_a_dead_consumers_processing_list_goes_back_to_its_queue(redis_server: RedisServer) -> None:
    """The kill -9 window: the message was moved off the queue but not yet recorded as unacked."""
    queue = Queue(f"q-{uuid.uuid4().hex[:8]}", EXCHANGE, routing_key="r2")
    bodies = _publish(redis_server, queue, 2)
    client = redis_server.client()
    dead = "deadbeef" * 4
    processing = tm_transport.PROCESSING_KEY.format(consumer=dead, source=queue.name)
    client.hset(tm_transport.CONSUMERS_KEY, processing, json.dumps({"consumer": dead, "source": queue.name}))
    client.set(tm_transport.HEARTBEAT_KEY.format(consumer=dead), 1, px=1500)
    taken = client.lmove(queue.name, processing, "RIGHT", "LEFT")  # what the dead consumer's BLMOVE did
    assert taken is not None and client.llen(queue.name) == 1

    with _connection(redis_server) as connection:
        channel = connection.channel()
        assert channel.recover_orphans() == 0  # its heartbeat still lives: not yet
        wait_for(lambda: not client.exists(tm_transport.HEARTBEAT_KEY.format(consumer=dead)), 10, "the heartbeat to expire")
        assert channel.recover_orphans() == 1
        assert client.llen(processing) == 0 and not client.hexists(tm_transport.CONSUMERS_KEY, processing)
        received = _consume(connection, queue, 2)
    assert sorted(body for body, _ in received) == sorted(bodies)
    assert client.llen(queue.name) == 0 and client.hlen("unacked") == 0


def test_a_live_consumers_heartbeat_keeps_its_processing_list(redis_server: RedisServer) -> None:
    queue = Queue(f"q-{uuid.uuid4().hex[:8]}", EXCHANGE, routing_key="r3")
    _publish(redis_server, queue, 1)
    client = redis_server.client()
    with _connection(redis_server, consumer_ttl=1.0) as first, _connection(redis_server) as second:
        _consume(first, queue, 1, ack=False)
        owners = [json.loads(v)["consumer"] for v in client.hvals(tm_transport.CONSUMERS_KEY)]
        assert owners and client.exists(tm_transport.HEARTBEAT_KEY.format(consumer=owners[0]))
        assert second.channel().recover_orphans() == 0


@pytest.mark.parametrize("transport", ["redis", BROKER_TRANSPORT])
def test_closing_a_channel_after_its_connection_was_collected(redis_server: RedisServer, transport: str) -> None:
    """What Celery does on a broker reconnect: the old connection is collected, then its channel closes
    and its running jobs ack. kombu's transport rebuilds its Redis parameters from the collected
    connection there: `AttributeError: 'NoneType' object has no attribute 'hostname'`, which stopped
    workers ("Unrecoverable error") on Redis restarts. tokenmill's must not."""
    queue = Queue(f"q-{uuid.uuid4().hex[:8]}", EXCHANGE, routing_key="r4")
    _publish(redis_server, queue, 1)
    connection = _connection(redis_server, transport=transport)
    [(_, message)] = _consume(connection, queue, 1, ack=False)
    channel = message.channel
    channel._disconnect_pools()  # kombu's close does this first; the pools are rebuilt on the next command
    connection._do_close_transport()  # the connection let go of its transport (collect / close)
    if transport == "redis":
        with pytest.raises(AttributeError, match="hostname"):
            channel.close()
        return
    channel.close()
    message.ack()  # the job finished after the reconnect: it acks through the old channel
    client = redis_server.client()
    assert client.hlen("unacked") == 0 and client.llen(queue.name) == 0  # acked, not requeued


def test_a_channel_reuses_one_client_per_pool(redis_server: RedisServer) -> None:
    """Commands outside the poll share one `redis.Redis` per connection pool (kombu made one per call); when
    kombu drops the pool after a connection error, the next command gets a client of the new pool."""
    with _connection(redis_server) as connection:
        channel = connection.channel()
        with channel.conn_or_acquire() as first, channel.conn_or_acquire() as second:
            assert first is second and first.ping()
        channel._disconnect_pools()
        with channel.conn_or_acquire() as third:
            assert third is not first and third.connection_pool is channel.pool and third.ping()


def test_a_trickle_of_messages_costs_a_blmove_and_a_record_each(redis_server: RedisServer) -> None:
    """A consumer whose record found every list it took from empty blocks in BLMOVE next: no take script that finds
    nothing (one per message before) and no LLEN round (that record was the check of the other lists; one LLEN
    round per message before that, four LLENs with priorities). A message waiting behind the taken one is taken by a
    take script, not left waiting for BLMOVE."""
    queue = Queue(f"q-{uuid.uuid4().hex[:8]}", EXCHANGE, routing_key="r1")
    client = redis_server.client()
    count = 10

    def calls(name: str) -> int:
        return int(client.info("commandstats").get(f"cmdstat_{name}", {}).get("calls", 0))

    received: list = []
    with _connection(redis_server) as connection, Connection(redis_server.url) as producer_connection:
        producer = Producer(producer_connection.channel(), exchange=EXCHANGE)
        producer.publish({"body": "0"}, routing_key=queue.routing_key, declare=[queue])  # a declare checks lengths
        before = {name: calls(name) for name in ("llen", "eval", "blmove")}
        consumer = threading.Thread(target=_consume, args=(connection, queue, count + 2), kwargs={"received": received})
        consumer.start()
        for sent in range(1, count):  # one at a time, each once the last is taken
            wait_for(lambda: len(received) >= sent, 10, "the message taken")  # noqa: B023
            time.sleep(0.05)  # the consumer is blocked in BLMOVE again
            producer.publish({"body": str(sent)}, routing_key=queue.routing_key)
        wait_for(lambda: len(received) >= count, 10, "the message taken")
        trickle = {name: calls(name) - before[name] for name in before}
        staging = Queue(f"staging-{uuid.uuid4().hex[:8]}", EXCHANGE, routing_key="staging")
        for body in ("a", "b"):
            producer.publish({"body": body}, routing_key=staging.routing_key, declare=[staging])
        time.sleep(0.05)  # the consumer is blocked in BLMOVE again
        evals = calls("eval")
        client.pipeline(transaction=True).lmove(staging.name, queue.name, "RIGHT", "LEFT").lmove(
            staging.name, queue.name, "RIGHT", "LEFT").execute()  # two at once: BLMOVE takes one, the record sees one
        consumer.join(30)
    assert [body for body, _ in received] == [str(n) for n in range(count)] + ["a", "b"]
    # the consumer's declare (a length per priority) and BLMOVE timeouts' checks at most
    assert trickle["llen"] <= 8, f"{trickle['llen']} LLEN calls for {count} messages"
    assert trickle["eval"] <= 2, f"{trickle['eval']} take scripts for {count} messages"
    assert calls("eval") - evals >= 1  # the one the record saw was taken by a take script
    assert trickle["blmove"] >= count - 1


def test_each_body_is_decoded_once(redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """The envelope check decodes a message's base64 body; kombu's `Message` gets that, not a second decode."""
    from kombu.transport.virtual.base import Base64

    calls: list[int] = []
    decode = Base64.decode
    monkeypatch.setattr(Base64, "decode", lambda codec, s: calls.append(1) or decode(codec, s))
    queue = Queue(f"q-{uuid.uuid4().hex[:8]}", EXCHANGE, routing_key="r1")
    bodies = _publish(redis_server, queue, 5)
    with _connection(redis_server) as connection:
        assert sorted(body for body, _ in _consume(connection, queue, 5)) == sorted(bodies)
    assert len(calls) == 5


def test_json_bodies_are_read_without_kombus_registry_as_it_reads_them(redis_server: RedisServer,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """A JSON body a consumer accepts is read by `fastjson.loads` (kombu's types included); a body that is no JSON is
    a DecodeError, as kombu's registry makes it; a consumer without an accept list still goes through the registry."""
    import datetime

    import kombu.message
    from kombu.exceptions import DecodeError

    calls: list[int] = []
    loads = kombu.message.loads
    monkeypatch.setattr(kombu.message, "loads", lambda *args, **kwargs: calls.append(1) or loads(*args, **kwargs))
    queue = Queue(f"q-{uuid.uuid4().hex[:8]}", EXCHANGE, routing_key="r1")
    when = datetime.datetime(2026, 12, 2, 1, 2, 3)
    with Connection(redis_server.url) as producer_connection:
        producer = Producer(producer_connection.channel(), exchange=EXCHANGE)
        producer.publish({"when": when, "n": 2**70}, routing_key="r1", declare=[queue])
        producer.publish(b"{not json", routing_key="r1", declare=[queue], content_type="application/json",
                         content_encoding="utf-8")
        producer.publish({"plain": 1}, routing_key="r1", declare=[queue])
    bodies, errors = [], []
    with _connection(redis_server) as connection:
        consumer = Consumer(connection.channel(), [queue], accept=["json"], prefetch_count=3,
                            callbacks=[lambda body, message: (bodies.append(body), message.ack())],
                            on_decode_error=lambda message, exc: (errors.append(exc), message.ack()))
        with consumer:
            deadline = time.monotonic() + 20
            while len(bodies) + len(errors) < 3 and time.monotonic() < deadline:
                try:
                    connection.drain_events(timeout=1)
                except TimeoutError:
                    pass
        assert bodies == [{"when": when, "n": 2**70}, {"plain": 1}]
        assert len(errors) == 1 and isinstance(errors[0], DecodeError)
        assert calls == []
        message = tm_transport.Message({"body": '{"a": 1}', "content-type": "application/json",
                                        "properties": {"delivery_tag": "t"}}, channel=connection.default_channel)
        assert message.decode() == {"a": 1} and calls == [1]  # no accept list: kombu's registry, as before


def test_a_full_consumer_takes_again_once_take_at_least_slots_are_free(redis_server: RedisServer) -> None:
    """With `take_at_least`, a consumer holding its whole prefetch takes nothing while fewer slots are free, then
    the waiting messages in one take; an idle one takes a lone message at once."""
    queue = Queue(f"q-{uuid.uuid4().hex[:8]}", EXCHANGE, routing_key="r1")
    _publish(redis_server, queue, 12)
    received: list = []

    def on_message(body: dict, message: object) -> None:
        received.append(message)

    with _connection(redis_server, take_at_least=3) as connection, Consumer(
            connection.channel(), [queue], callbacks=[on_message], prefetch_count=8) as consumer:
        def drain_until(count: int, seconds: float) -> None:
            deadline = time.monotonic() + seconds
            while len(received) < count and time.monotonic() < deadline:
                try:
                    connection.drain_events(timeout=0.2)
                except TimeoutError:
                    pass

        drain_until(8, 20)
        assert len(received) == 8
        qos = consumer.channel.qos
        for message in received[:2]:
            message.ack()
        assert not qos.can_consume()  # two slots free, three wanted
        drain_until(9, 1.5)
        assert len(received) == 8
        received[2].ack()
        assert qos.can_consume() and qos.can_consume_max_estimate() == 3
        drain_until(11, 20)
        assert len(received) == 11  # the three free slots, filled at once
        for message in received[3:]:
            message.ack()
        drain_until(12, 20)  # plenty of room: the last message alone
        assert len(received) == 12
        received[-1].ack()


def test_a_message_acked_by_a_script_frees_its_slot_without_an_ack_of_its_own(redis_server: RedisServer) -> None:
    """`ack_records` names what acking a held message removes from Redis; once a script removed it,
    `acked_by_script` frees the message's prefetch slot and marks it acked, sending nothing."""
    queue = Queue(f"q-{uuid.uuid4().hex[:8]}", EXCHANGE, routing_key="r1")
    _publish(redis_server, queue, 2)
    client = redis_server.client()
    with _connection(redis_server) as connection:
        held = [message for _, message in _consume(connection, queue, 2, ack=False)]
        records = tm_transport.ack_records(held)
        assert records == [("unacked", "unacked_index", message.delivery_tag) for message in held]
        hash_key, index_key, tag = records[0]
        client.zrem(index_key, tag)
        client.hdel(hash_key, tag)
        qos = held[0].channel.qos
        assert qos.can_consume_max_estimate() == 0
        client.config_resetstat()
        tm_transport.acked_by_script(held[0])
        assert held[0].acknowledged and tm_transport.ack_records(held[:1]) == [None]
        assert qos.can_consume_max_estimate() == 1
        assert not any(name in client.info("commandstats") for name in ("cmdstat_zrem", "cmdstat_hdel"))
        assert client.hkeys("unacked") == [held[1].delivery_tag.encode()]  # the other one is still held
        assert tm_transport.ack_records([object(), held[1]]) == [None, records[1]]  # not a message of this transport
        held[1].ack()
        assert client.hlen("unacked") == 0


def _recorded(item: bytes) -> bytes:
    """kombu's unacked record of a taken item, as the record scripts write it: `[item, exchange, routing key]`."""
    return b"[" + item + b', "jobs", "r1"]'


def test_a_take_is_recorded_by_place_and_its_reused_and_malformed_items_set_aside(redis_server: RedisServer) -> None:
    """One take of five items: three messages, a malformed item between them and the first message's envelope again
    (its delivery tag reused). The record script finds the messages at the head of the processing list, where the take
    put them: each is recorded under its own tag with its own bytes, the reused one is set aside beside the malformed
    one, and the processing list is left empty, without any item sent back to Redis (no by-content fallback)."""
    queue = Queue(f"q-{uuid.uuid4().hex[:8]}", EXCHANGE, routing_key="r1")
    bodies = _publish(redis_server, queue, 3)
    client = redis_server.client()
    items = client.lrange(queue.name, 0, -1)[::-1]  # oldest first: the order a take moves them in
    client.delete(queue.name)
    malformed = b"\x00 not a kombu message"
    client.lpush(queue.name, items[0], malformed, items[1], items[0], items[2])  # taken from the right: in this order
    received: list = []
    with _connection(redis_server) as connection:
        channel = connection.channel()
        channel._record_items = lambda entries: pytest.fail(f"{len(entries)} items recorded by content")
        with Consumer(channel, [queue], prefetch_count=16,
                      callbacks=[lambda body, message: received.append((body["body"], message))]):
            deadline = time.monotonic() + 20
            while len(received) < 3 and time.monotonic() < deadline:
                try:
                    connection.drain_events(timeout=1)
                except TimeoutError:
                    pass
            assert [body for body, _ in received] == bodies
            tags = [message.delivery_tag for _, message in received]
            assert [client.hget("unacked", tag) for tag in tags] == [_recorded(item) for item in items]
            assert client.zcard("unacked_index") == 3
            assert client.lrange(tm_transport.MALFORMED_KEY, 0, -1) == [items[0], malformed]
            assert all(client.llen(key) == 0 for key in client.hkeys(tm_transport.CONSUMERS_KEY))


def test_items_not_where_the_take_left_them_are_recorded_by_content(redis_server: RedisServer) -> None:
    """If the head of a processing list is not the taken items (something else pushed there), nothing of that list is
    recorded by place: the items are recorded by content, and whatever else is there stays; one whose tag is in flight
    is set aside. Items a sweep requeued before the record are not recorded, and the next take gets them."""
    queue = Queue(f"q-{uuid.uuid4().hex[:8]}", EXCHANGE, routing_key="r1")
    _publish(redis_server, queue, 4)
    client = redis_server.client()
    with _connection(redis_server) as connection:
        channel = connection.channel()
        processing = channel._processing_key(queue.name)
        taken = [(queue.name, client.lmove(queue.name, processing, "RIGHT", "LEFT")) for _ in range(2)]
        client.lpush(processing, b"something else")
        delivered, _ = channel._claim_many(taken)
        assert [payload["properties"]["delivery_tag"] for payload, _ in delivered] == [
            json.loads(item)["properties"]["delivery_tag"] for _, item in taken]
        assert sorted(client.hvals("unacked")) == sorted(_recorded(item) for _, item in taken)
        assert client.lrange(processing, 0, -1) == [b"something else"]

        again = taken[0][1]  # the first message's envelope taken again while its tag is in flight: set aside
        client.rpush(processing, again)  # behind the other item: not at the head either
        assert channel._claim_many([(queue.name, again)])[0] == []
        assert client.lrange(processing, 0, -1) == [b"something else"]
        assert client.lrange(tm_transport.MALFORMED_KEY, 0, -1) == [again] and client.hlen("unacked") == 2

        client.delete(processing)
        swept = [(queue.name, client.lmove(queue.name, processing, "RIGHT", "LEFT")) for _ in range(2)]
        client.lmove(processing, queue.name, "LEFT", "RIGHT")  # a sweep puts the list back on its queue
        client.lmove(processing, queue.name, "LEFT", "RIGHT")
        assert channel._claim_many(swept)[0] == []
        assert client.hlen("unacked") == 2 and client.llen(queue.name) == 2
        assert client.lrange(queue.name, -2, -1) == [item for _, item in swept[::-1]]  # taken next, the first first

        with _connection(redis_server) as other:  # another consumer takes and records them before this one's record
            assert len(_consume(other, queue, 2, ack=False)) == 2
            assert channel._claim_many(swept)[0] == []  # requeued, not a reused tag: nothing set aside
        assert client.lrange(tm_transport.MALFORMED_KEY, 0, -1) == [again] and client.hlen("unacked") == 4


#: Another client's script that keeps Redis busy for 4 s (under its 5 s `busy-reply-threshold`): commands sent meanwhile wait, then run in order.
_BUSY_4S = ("local t0 = redis.call('TIME') local s = t0[1] + t0[2] / 1e6 "
            "repeat local t = redis.call('TIME') until t[1] + t[2] / 1e6 - s > 4 return 1")


def test_a_take_whose_reply_is_lost_with_its_connection_is_requeued(redis_server: RedisServer,
                                                                      caplog: pytest.LogCaptureFixture) -> None:
    """kombu drops a consumer connection whose reply is overdue (`maybe_check_brpop_health`: `brpop_timeout` +
    `health_check_interval`) and sends the next take on a new one. Redis, busy meanwhile, still runs the take sent on
    the dropped connection: its items go into this live consumer's processing list, and its reply nowhere. The next
    take puts them back on their queue first, so every message is delivered once and nothing stays behind."""
    queue = Queue(f"q-{uuid.uuid4().hex[:8]}", EXCHANGE, routing_key="r-lost")
    client = redis_server.client()
    received: list[str] = []

    def on_message(body: dict, message: object) -> None:
        received.append(body["body"])
        message.ack()

    # kombu's check: a reply overdue by `brpop_timeout` (1 s) + 1 s; redis-py's (the same setting) pings a connection
    # idle for 1 s before its next command, which the take below is sent well within
    with _connection(redis_server, health_check_interval=1.0) as connection:
        with Consumer(connection.channel(), [queue], callbacks=[on_message], prefetch_count=20):
            bodies = _publish(redis_server, queue, 1)
            wait_for(lambda: _drained(connection) or received == bodies, 20, "the first message")  # its lists registered
            bodies += _publish(redis_server, queue, 5)  # waiting: taken at the next poll
            busy = threading.Thread(target=redis_server.client().eval, args=(_BUSY_4S, 0))
            busy.start()
            time.sleep(0.2)
            poller = connection.transport.cycle
            poller.on_poll_start()  # kombu sends the take, which waits for the busy script
            time.sleep(2.2)
            with caplog.at_level("WARNING"):
                poller.maybe_check_brpop_health()  # overdue: kombu drops the connection
                busy.join()  # then Redis runs the take, its reply going nowhere
                wait_for(lambda: _drained(connection) or sorted(received) == sorted(bodies), 20, "every message")
    assert sorted(received) == sorted(bodies)  # each once
    assert "dropping stale connection" in caplog.text and "whose reply was not read" in caplog.text
    assert client.llen(queue.name) == 0 and client.hlen("unacked") == 0
    assert all(client.llen(key) == 0 for key in client.hkeys(tm_transport.CONSUMERS_KEY))


def _drained(connection: Connection, timeout: float = 0.2) -> bool:
    """One `drain_events` (False, for `wait_for`'s predicates)."""
    try:
        connection.drain_events(timeout=timeout)
    except TimeoutError:
        pass
    return False


def test_a_requeue_that_meets_redis_down_leaves_the_message_to_the_visibility_timeout(
        redis_server: RedisServer) -> None:
    """A requeue (`reject(requeue=True)`, as the intake requeues a group's jobs on Celery's loop, which logs and
    swallows the connection error) while Redis is down: the message is no longer held by the consumer, so no lease
    renews it, and once Redis is back the visibility timeout puts it back on its queue."""
    queue = Queue(f"q-{uuid.uuid4().hex[:8]}", EXCHANGE, routing_key="r-requeue")
    _publish(redis_server, queue, 1)
    with _connection(redis_server, visibility_timeout=1) as connection:
        ((_, message),) = _consume(connection, queue, 1, ack=False)

        def held() -> bool:  # among the messages this process's leases renew (other tests' channels may hold more)
            return message.delivery_tag in tm_transport.held_deliveries().get(message.channel.qos.unacked_index_key, [])

        assert held()
        redis_server.stop()
        message.reject_log_error(logging.getLogger("test"), connection.connection_errors, requeue=True)
        assert not held()  # no lease renews it
        redis_server.start()
        client = redis_server.client()
        assert client.hexists("unacked", message.delivery_tag)  # still recorded: the visibility timeout's to requeue
        time.sleep(1.5)
        message.channel.qos.restore_visible()
        assert client.llen(queue.name) == 1 and client.hlen("unacked") == 0
