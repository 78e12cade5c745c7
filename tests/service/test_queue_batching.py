"""`Coalescer`: many threads' single calls answered by shared calls, each thread getting its own answer. `HeldScript`:
a script's calls on one held connection, through script flushes and Redis restarts."""

from __future__ import annotations

import signal
import threading
import time

import pytest
import redis
from redis.backoff import ExponentialBackoff
from redis.retry import Retry
from service_fixtures import RedisServer

from tokenmill.queue.batching import Coalescer, HeldScript


def _run_threads(count: int, target) -> None:
    threads = [threading.Thread(target=target, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert not any(thread.is_alive() for thread in threads), "a caller never got its answer"


def test_concurrent_calls_share_calls_and_each_gets_its_own_answer() -> None:
    sizes: list[int] = []

    def many(items: list[int]) -> list[int]:
        sizes.append(len(items))
        time.sleep(0.002)  # a round trip: callers arriving meanwhile wait for the next call
        return [item * 10 for item in items]

    coalescer = Coalescer(many, limit=16)
    answers: dict[int, int] = {}
    together = threading.Barrier(400)  # all call at once: thread start-up on a loaded machine must not spread them

    def call(i: int) -> None:
        together.wait()
        answers[i] = coalescer.call(i)

    _run_threads(400, call)
    assert answers == {i: i * 10 for i in range(400)}
    assert sum(sizes) == 400 and max(sizes) <= 16
    assert len(sizes) < 200  # shared: far fewer calls than callers


def test_a_lone_call_is_made_at_once() -> None:
    coalescer = Coalescer(lambda items: [item + 1 for item in items])
    assert coalescer.call(1) == 2
    assert coalescer.call(5) == 6


def test_an_error_reaches_the_callers_of_that_call_only_and_later_calls_work() -> None:
    release = threading.Event()

    def many(items: list[str]) -> list[str]:
        if "bad" in items:
            raise ConnectionError("redis is down")
        release.wait(5)  # hold the first call so that "bad" and "late" queue behind it, in one call
        return [item.upper() for item in items]

    coalescer = Coalescer(many)
    results: dict[str, object] = {}

    def call(item: str) -> None:
        try:
            results[item] = coalescer.call(item)
        except ConnectionError as exc:
            results[item] = exc

    first = threading.Thread(target=call, args=("first",))
    first.start()
    time.sleep(0.1)
    others = [threading.Thread(target=call, args=(item,)) for item in ("bad", "late")]
    for thread in others:
        thread.start()
    time.sleep(0.1)
    release.set()
    for thread in [first, *others]:
        thread.join(timeout=10)
    assert results["first"] == "FIRST"
    assert isinstance(results["bad"], ConnectionError) and isinstance(results["late"], ConnectionError)
    assert coalescer.call("after") == "AFTER"


def test_a_wrong_number_of_answers_is_an_error_not_a_mismatch() -> None:
    coalescer = Coalescer(lambda items: [])
    with pytest.raises(RuntimeError, match="0 answers for 1 items"):
        coalescer.call("x")


#: Sets each key to its argument unless it holds a value; returns how many it set and the values now held. An
#: argument "fail" makes it an error instead.
_SET_NEW = """
if ARGV[1] == 'fail' then return redis.error_reply('refused') end
local set = 0
for i, key in ipairs(KEYS) do
  if redis.call('SET', key, ARGV[i], 'NX') then set = set + 1 end
end
return {set, redis.call('MGET', unpack(KEYS))}
"""


def _retrying_client(server: RedisServer) -> redis.Redis:
    """A client with the worker service's retry policy (tries through a Redis restart)."""
    return redis.Redis.from_url(server.url, retry=Retry(ExponentialBackoff(cap=0.2, base=0.05), retries=100),
                                retry_on_error=[redis.ConnectionError, redis.TimeoutError])


def test_a_held_script_runs_on_one_connection_and_survives_a_script_flush(redis_server: RedisServer) -> None:
    client = _retrying_client(redis_server)
    script = HeldScript(client, _SET_NEW)
    assert script(["a", "b"], ["1", "2"]) == [2, [b"1", b"2"]]
    assert script(["b", "c"], ["x", "3"]) == [1, [b"2", b"3"]]  # NX: a stored value stays
    redis_server.client().script_flush()  # as after a Redis restart: EVALSHA finds no script
    assert script(["d"], ["4"]) == [1, [b"4"]]
    pool = client.connection_pool
    assert len(pool._in_use_connections) == 1 and not pool._available_connections  # one connection, held
    ids = {entry["id"] for entry in redis_server.client().client_list() if entry["cmd"] in ("evalsha", "eval")}
    assert len(ids) == 1, ids


def test_a_held_script_waits_through_a_redis_restart_and_its_errors_are_raised(redis_server: RedisServer) -> None:
    """A call while Redis is down is retried until it is back (the client's policy), on a new connection; a script
    error is raised, not retried, and the connection serves the next call."""
    client = _retrying_client(redis_server)
    script = HeldScript(client, _SET_NEW)
    assert script(["a"], ["1"]) == [1, [b"1"]]
    redis_server.stop()  # AOF flushed: "a" survives
    restarted = threading.Timer(0.5, redis_server.start)
    restarted.start()
    try:
        assert script(["a", "b"], ["9", "2"]) == [1, [b"1", b"2"]]
    finally:
        restarted.join()
    with pytest.raises(redis.ResponseError, match="refused"):
        script(["c"], ["fail"])
    assert script(["c"], ["3"]) == [1, [b"3"]]


def test_a_held_script_called_from_many_threads_at_once_answers_each_its_own(redis_server: RedisServer) -> None:
    """Calls that find the held connection busy take redis-py's pooled path: every call gets its own reply."""
    script = HeldScript(_retrying_client(redis_server), "return redis.call('INCR', KEYS[1])")
    replies: list[int] = []
    together = threading.Barrier(8)

    def call(_: int) -> None:
        together.wait()
        for _ in range(50):
            replies.append(script(["counter"], []))

    _run_threads(8, call)
    assert sorted(replies) == list(range(1, 401))


def test_a_held_script_interrupted_leaves_no_reply_for_the_next_call(redis_server: RedisServer) -> None:
    """A signal handler that raises while a call waits for its reply (as a worker's shutdown may): the next call reads
    its own reply, not the one left unread."""
    script = HeldScript(_retrying_client(redis_server), """
local function now()  -- microseconds: whole seconds alone made the wait end at the next second, 0-1 s away
  local time = redis.call('TIME')
  return tonumber(time[1]) * 1000000 + tonumber(time[2])
end
if ARGV[1] == 'slow' then
  local deadline = now() + 1000000
  while now() < deadline do end
end
return ARGV[1]
""")

    class Interrupted(Exception):
        pass

    def interrupt(*_: object) -> None:
        raise Interrupted

    previous = signal.signal(signal.SIGALRM, interrupt)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.1)
        with pytest.raises(Interrupted):
            script([], ["slow"])
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert script([], ["fast"]) == b"fast"
