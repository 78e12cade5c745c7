"""The finisher (`tokenmill.worker.finisher`): jobs of every group that end together are stored in one call; a run
whose completion or store fails is abandoned alone (or with the runs of that store), and so is every run still
running when the shutdown grace ends; the runs that settle in one turn queue their messages' acks for one turn of the
consumer's loop. Runs here are stand-ins for `IntakeRun` that record what was asked of them;
the path through Redis, the engine and real workers is tested in `test_service_intake.py` and the fault tests."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from kombu.transport import virtual

from tokenmill.worker.finisher import Finisher
from tokenmill.worker.intake import Intake


class Service:
    def __init__(self) -> None:
        self.stores: list[dict[bytes, bytes]] = []
        self.acks: list[list[tuple[str, str, str]]] = []
        self.grace_expired = threading.Event()
        self.fail_store = False
        self.lock = threading.Lock()

    def store_results(self, encoded: dict[bytes, bytes], acks: list[tuple[str, str, str]]) -> None:
        if self.fail_store:
            raise ConnectionError("redis down")
        with self.lock:
            self.stores.append(dict(encoded))
            self.acks.append(list(acks))


class Run:
    def __init__(self, service: Service, name: str, jobs: int, fail_on: int | None = None) -> None:
        self.service = service
        self.name = name
        self.ids = [f"{name}#{index}" for index in range(jobs)]  # its engine request ids
        self.pending = set(self.ids)
        self.unstored: dict[bytes, bytes] = {}
        self.stored: list[bytes] = []
        self.fail_on = fail_on
        self.ended = threading.Event()
        self.abandoned: str | None = None
        self.accepting = True

    def finish(self, answers: list[tuple[str, Any]], turn: dict) -> tuple[dict[bytes, bytes], list[tuple[str, str, str]]]:
        for request_id, answer in answers:
            index = self.ids.index(request_id)
            if index == self.fail_on:
                raise ValueError("cannot complete")
            self.pending.discard(request_id)
            self.unstored[f"{self.name}-{index}".encode()] = answer
        return dict(self.unstored), [("unacked", "unacked_index", key.decode()) for key in self.unstored]

    def stored_all(self) -> bool:
        self.stored += self.unstored
        self.unstored = {}
        if self.pending:
            return False
        self.accepting = False
        self.ended.set()
        return True

    def abandon(self, reason: str) -> None:
        self.accepting = False
        self.abandoned = reason
        self.ended.set()


def watched(finisher: Finisher, *runs: Run) -> list[Any]:
    """Each run handed to the finisher; their sinks, as the engine would answer them."""
    sinks = [finisher.sink(run) for run in runs]
    for run in runs:
        finisher.watch(run)
    return sinks


def wait(event: threading.Event) -> None:
    assert event.wait(10), "the finisher never ended the run"


def test_jobs_of_several_runs_that_end_together_are_stored_in_one_call() -> None:
    service, finisher = Service(), Finisher()
    first, second = Run(service, "a", 2), Run(service, "b", 3)
    with service.lock:  # the finisher's first store waits, so everything below is answered before its next turn
        answer_first, answer_second = watched(finisher, first, second)
        answer_first(first.ids[0], b"a0")
        time.sleep(0.2)  # the finisher takes a0 and blocks in its store
        answer_first(first.ids[1], b"x")
        for request_id in second.ids:
            answer_second(request_id, b"x")
    wait(first.ended)
    wait(second.ended)
    assert service.stores[0] == {b"a-0": b"a0"}
    assert service.stores[1:] == [{b"a-1": b"x", b"b-0": b"x", b"b-1": b"x", b"b-2": b"x"}]
    # each message's ack goes with its job's result, in the same call
    assert [[tag for _, _, tag in acks] for acks in service.acks] == [["a-0"], ["a-1", "b-0", "b-1", "b-2"]]
    assert first.stored == [b"a-0", b"a-1"] and sorted(second.stored) == [b"b-0", b"b-1", b"b-2"]
    assert first.abandoned is None and second.abandoned is None


def test_a_run_whose_completion_fails_is_abandoned_alone_and_its_later_answers_are_ignored() -> None:
    service, finisher = Service(), Finisher()
    broken, healthy = Run(service, "a", 3, fail_on=1), Run(service, "b", 1)
    answer_broken, answer_healthy = watched(finisher, broken, healthy)
    answer_broken(broken.ids[1], b"x")
    wait(broken.ended)
    assert broken.abandoned == "ValueError"
    answer_broken(broken.ids[0], b"late")  # an aborted request is answered after the run was abandoned
    answer_healthy(healthy.ids[0], b"y")
    wait(healthy.ended)
    assert healthy.abandoned is None
    assert all(b"a-0" not in store for store in service.stores)
    assert {b"b-0": b"y"} in service.stores


def test_a_failed_store_abandons_the_runs_it_held_and_later_runs_are_stored() -> None:
    service, finisher = Service(), Finisher()
    service.fail_store = True
    lost = Run(service, "a", 1)
    watched(finisher, lost)[0](lost.ids[0], b"x")
    wait(lost.ended)
    assert lost.abandoned == "ConnectionError" and lost.stored == []
    service.fail_store = False
    later = Run(service, "b", 1)
    watched(finisher, later)[0](later.ids[0], b"y")
    wait(later.ended)
    assert later.abandoned is None and service.stores == [{b"b-0": b"y"}]


def test_runs_still_in_the_engine_when_the_grace_ends_are_abandoned() -> None:
    service, finisher = Service(), Finisher()
    running = Run(service, "a", 2)
    watched(finisher, running)[0](running.ids[0], b"x")
    time.sleep(0.2)
    assert not running.ended.is_set()
    service.grace_expired.set()  # seen within the finisher's check interval, with no job ending meanwhile
    wait(running.ended)
    assert running.abandoned == "worker shutting down"
    assert running.stored == [b"a-0"]


def test_the_runs_that_settle_in_one_turn_settle_inside_one_settling_context() -> None:
    service, turns, current = Service(), [], []

    @contextlib.contextmanager
    def settling() -> Iterator[None]:
        current.append([])
        yield
        turns.append(sorted(current.pop()))

    class Recorded(Run):
        def stored_all(self) -> bool:
            (current[-1] if current else turns).append(self.name)  # a run settled outside the context shows alone
            return super().stored_all()

    finisher = Finisher(settling=settling)
    first, second = Recorded(service, "a", 2), Recorded(service, "b", 1)
    with service.lock:  # as above: the first turn blocks in its store while the rest are answered
        answer_first, answer_second = watched(finisher, first, second)
        answer_first(first.ids[0], b"a0")
        time.sleep(0.2)
        answer_first(first.ids[1], b"a1")
        answer_second(second.ids[0], b"b0")
    wait(first.ended)
    wait(second.ended)
    assert turns == [["a"], ["a", "b"]]


def test_answers_that_come_before_the_run_is_watched_wait_for_it_and_those_of_an_abandoned_run_are_dropped() -> None:
    """The engine may answer a request while its run is still being admitted (a prompt refused as it is sent, a job
    done within the admission): the answer waits until `watch` hands the run over. A run abandoned before that (its
    admission failed) is never watched: its answers, and those of its aborted requests, are dropped."""
    service, finisher = Service(), Finisher()
    early, failed, other = Run(service, "a", 2), Run(service, "b", 1), Run(service, "c", 1)
    answer_early, answer_failed = finisher.sink(early), finisher.sink(failed)
    answer_early(early.ids[0], b"a0")
    answer_failed(failed.ids[0], b"lost")
    failed.abandon("admission failed")
    watched(finisher, other)[0](other.ids[0], b"c0")  # starts the finisher, which takes all three answers
    wait(other.ended)
    time.sleep(0.2)  # more turns: the early answer still waits, nothing of the abandoned run is stored
    assert not early.ended.is_set() and early.stored == []
    finisher.watch(early)
    answer_early(early.ids[1], b"a1")
    wait(early.ended)
    assert early.abandoned is None and early.stored == [b"a-0", b"a-1"]
    assert all(b"b-0" not in store for store in service.stores)
    assert service.stores[0] == {b"c-0": b"c0"}


class Message:
    def __init__(self, acked: list[str], tag: str) -> None:
        self.acked, self.tag = acked, tag

    def ack_log_error(self, *_: Any) -> None:
        self.acked.append(self.tag)


class Request:
    connection_errors = ()

    def __init__(self, acked: list[str], tag: str) -> None:
        self.message, self.acknowledged = Message(acked, tag), False


def test_acks_queued_while_held_wake_the_consumer_loop_once_at_the_end() -> None:
    intake, scheduled, acked = Intake(), [], []
    intake.call_soon = lambda call, *args: scheduled.append((call, args))
    intake.ack_soon([Request(acked, "1")])
    intake.ack_soon([Request(acked, "2")])  # waiting already: the same turn of the loop takes it
    assert len(scheduled) == 1
    call, args = scheduled.pop()
    call(*args)
    assert acked == ["1", "2"]
    with intake.holding_acks():
        intake.ack_soon([Request(acked, "3")])
        intake.ack_soon([], [])  # nothing to ack: nothing scheduled
        intake.ack_soon([Request(acked, "4")])
        assert scheduled == []
    assert len(scheduled) == 1
    call, args = scheduled.pop()
    call(*args)
    assert acked == ["1", "2", "3", "4"]
    with intake.holding_acks():  # held with nothing queued: no turn of the loop either
        pass
    assert scheduled == []


class _Channel:
    do_restore = False  # kombu's QoS asks at exit

    def __init__(self, prefetch: int) -> None:
        self.qos = virtual.QoS(self, prefetch_count=prefetch)


class _Delivered:
    """A message taken by a consumer (`channel`), holding one of its prefetch slots."""

    def __init__(self, channel: _Channel, tag: str) -> None:
        self.channel, self.delivery_tag, self.acknowledged = channel, tag, False
        channel.qos.append(self, tag)


class _ScriptAcked:
    def __init__(self, message: _Delivered) -> None:
        self.message, self.acknowledged = message, False


def test_slots_of_messages_the_store_acked_are_freed_at_the_loops_next_turn_while_the_consumer_can_take() -> None:
    """The script storing a lone job's result acked its message in Redis: only its prefetch slot is left to free. While
    the consumer can take more with the slot held, no turn of the loop is asked for: its next turn frees it (a BLMOVE
    returns within its timeout). A consumer with no room is woken, as is one with acks of its own to send."""
    intake, scheduled, acked = Intake(), [], []
    intake.call_soon = lambda call, *args: scheduled.append((call, args))
    channel = _Channel(prefetch=2)
    first = _ScriptAcked(_Delivered(channel, "1"))
    with intake.holding_acks():
        intake.ack_soon([], [first])
    assert scheduled == [] and not first.acknowledged
    intake._ack_at_turn()  # the loop's next turn, whatever woke it
    assert first.acknowledged and channel.qos.can_consume()
    full = [_ScriptAcked(_Delivered(channel, tag)) for tag in ("2", "3")]
    assert not channel.qos.can_consume()
    intake.ack_soon([], full[:1])
    assert len(scheduled) == 1  # no room: the freed slot lets the consumer take again
    intake.ack_soon([], full[1:])  # a turn is asked for already
    assert len(scheduled) == 1
    call, args = scheduled.pop()
    call(*args)
    assert all(request.acknowledged for request in full)
    intake.ack_soon([Request(acked, "4")], [_ScriptAcked(_Delivered(channel, "5"))])  # an ack to send: woken
    assert len(scheduled) == 1
    call, args = scheduled.pop()
    call(*args)
    assert acked == ["4"]
    intake._ack_at_turn()  # nothing waits: nothing done
    assert scheduled == []


def _service(intake: Intake | None = None, single_job_intake: bool = True) -> Any:
    """A `WorkerService` with no engine (never used here), serving its intake as a started one does; it connects to
    nothing until asked to."""
    from prometheus_client import CollectorRegistry

    from tokenmill.worker.metrics import WorkerMetrics
    from tokenmill.worker.service import WorkerService
    from tokenmill.worker.settings import WorkerSettings

    settings = WorkerSettings(broker_url="redis://127.0.0.1:1/0", model="builtin:tiny",
                              single_job_intake=single_job_intake)
    service = WorkerService(settings, engine=None, metrics=WorkerMetrics(CollectorRegistry()), sink=None, intake=intake)
    service.intake.serve(service)  # as `WorkerService.start` does once the service has started
    return service


def test_the_service_owns_its_intake_and_finisher_and_an_intake_made_before_it_is_served_by_it() -> None:
    """The service makes its intake and finisher, or takes on the intake Celery was handed before it existed (plain
    `celery worker`: the first job builds the service, through the intake's `start_service`). An intake serves one
    service; with `single_job_intake` off it hands every job to the pool."""
    own = _service()
    assert own.intake.enabled is True and own.finisher is not _service().finisher

    built = []
    early = Intake(start_service=lambda: built.append(_service(early)))
    assert early.enabled is None  # not known until the service exists
    assert early._worker_service() is built[0] and built[0].intake is early and early.enabled is True
    assert early._worker_service() is built[0] and len(built) == 1  # built once
    with pytest.raises(RuntimeError):
        _service(early)  # an intake serves one service

    assert _service(single_job_intake=False).intake._worker_service() is None
    orphan = Intake()  # no service and none to start: every job takes the pool path
    assert orphan._worker_service() is None and orphan.enabled is False


def test_a_finisher_thread_that_cannot_start_is_started_by_the_next_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """`watch` raises when no thread can be started (the caller abandons that run) and does not keep the thread that
    never ran: the next run's `watch` starts one, and its jobs are stored."""
    service, finisher = Service(), Finisher()
    start = threading.Thread.start
    failed: list[str] = []

    def start_once_failing(thread: threading.Thread) -> None:
        if thread.name == "tokenmill-finisher" and not failed:
            failed.append(thread.name)
            raise RuntimeError("can't start new thread")
        start(thread)

    monkeypatch.setattr(threading.Thread, "start", start_once_failing)
    first = Run(service, "a", 1)
    with pytest.raises(RuntimeError):
        finisher.watch(first)
    second = Run(service, "b", 1)
    watched(finisher, second)[0](second.ids[0], b"y")
    wait(second.ended)
    assert failed and second.abandoned is None and {b"b-0": b"y"} in service.stores
