"""`Coalescer`: many threads' single calls answered by shared calls, each thread getting its own answer."""

from __future__ import annotations

import threading
import time

import pytest

from tokenmill.queue.batching import Coalescer


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
