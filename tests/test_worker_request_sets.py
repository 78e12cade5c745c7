"""Celery's request sets, iterated by the consumer when the broker connection drops, while other threads change them."""

from __future__ import annotations

import gc
import sys
import threading
from collections.abc import Iterator

import pytest
from celery.worker import state

from tokenmill.worker.celery_adapter import snapshot_request_sets


class _Request:
    """Stands for a Celery request: the sets hold weak references to any object."""


@pytest.fixture
def frequent_switches() -> Iterator[None]:
    """Threads switch every microsecond, so that a thread changing a set lands inside another's iteration."""
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        yield
    finally:
        sys.setswitchinterval(interval)


def test_the_request_sets_can_be_iterated_while_other_threads_change_them(frequent_switches: None) -> None:
    snapshot_request_sets()
    for requests in (state.reserved_requests, state.active_requests, state.scheduled_requests):
        members = [_Request() for _ in range(50)]
        stop = threading.Event()

        def churn() -> None:  # as the intake's threads mark requests accepted and ready
            while not stop.is_set():
                for request in members:
                    requests.add(request)
                for request in members:
                    requests.discard(request)

        thread = threading.Thread(target=churn)
        thread.start()
        try:
            for _ in range(20_000):  # as `Consumer.on_close` does; a plain WeakSet raised within ~20 here
                assert all(isinstance(request, _Request) for request in tuple(requests))
        finally:
            stop.set()
            thread.join()


def test_a_garbage_collection_inside_the_copy_cannot_break_the_iteration() -> None:
    """A collection may start at any allocation, and its finalizers run Python code (here: one that changes the set,
    as another thread could once the collection lets it in). Whichever allocation it lands on, iterating still works."""
    snapshot_request_sets()
    members = [_Request() for _ in range(50)]
    for request in members:
        state.reserved_requests.add(request)
    added: list[_Request] = []

    class Garbage:
        def __del__(self) -> None:
            added.append(_Request())
            state.reserved_requests.add(added[-1])

    threshold = gc.get_threshold()
    try:
        for collect_after in range(1, 8):  # lands the collection on each allocation of the iteration in turn
            for _ in range(20):
                gc.collect()
                garbage = Garbage()
                garbage.cycle = garbage  # type: ignore[attr-defined]
                del garbage
                gc.set_threshold(collect_after, 1, 1)
                try:
                    assert len(tuple(state.reserved_requests)) >= len(members)
                finally:
                    gc.set_threshold(*threshold)
    finally:
        for request in members + added:
            state.reserved_requests.discard(request)
    assert added, "no collection ran a finalizer: the test did not exercise what it is about"


def test_the_sets_still_hold_add_discard_and_clear_as_celery_uses_them() -> None:
    snapshot_request_sets()
    kept, dropped = _Request(), _Request()
    state.reserved_requests.add(kept)
    state.reserved_requests.add(dropped)
    state.reserved_requests.discard(dropped)
    assert kept in state.reserved_requests and dropped not in state.reserved_requests
    assert kept in tuple(state.reserved_requests) and dropped not in tuple(state.reserved_requests)
    del kept  # a weak set forgets a request nobody holds
    assert not any(isinstance(request, _Request) for request in state.reserved_requests)
