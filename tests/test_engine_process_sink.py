"""`EngineProcess.send_many`: every request is answered exactly once, through its sink (the single-job intake's way to
its finisher, with no future per job): a prompt refused before sending at once, an aborted request with
`CancelledError` (and never again once the engine ends it), the rest with the engine's output. A real engine process on
builtin:tiny; the futures of `submit_many` are built on the same sinks (tests/service/test_service_crash.py)."""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
import time
from concurrent.futures import CancelledError
from typing import Any

from tokenmill import LLM
from tokenmill.errors import InvalidRequestError
from tokenmill.sampling_params import SamplingParams
from tokenmill.worker.engine_process import EngineOutput, EngineProcess


def test_each_request_is_answered_once_through_its_sink() -> None:
    answers: list[tuple[str, Any, str]] = []  # (request id, answer, the thread that answered)
    answered = threading.Condition()

    def sink(request_id: str, answer: Any) -> None:
        with answered:
            answers.append((request_id, answer, threading.current_thread().name))
            answered.notify_all()

    engine = EngineProcess("builtin:tiny", {"max_model_len": 64})
    engine.start(timeout=300)
    try:
        (process,) = multiprocessing.active_children()
        os.kill(process.pid, signal.SIGSTOP)  # nothing can finish before the abort below
        params = SamplingParams(max_tokens=4, ignore_eos=True, temperature=0.0)
        engine.send_many([("kept", params, "a prompt the engine runs", None, None),
                          ("too-long", params, "x" * 100_000, None, None),
                          ("aborted", params, "a prompt aborted before it runs", None, None)], sink)
        # the refusal came before `send_many` returned, on the caller's thread
        assert [(request_id, type(answer)) for request_id, answer, _ in answers] == [("too-long", InvalidRequestError)]
        engine.abort("aborted")
        assert [(request_id, type(answer)) for request_id, answer, _ in answers[1:]] == [("aborted", CancelledError)]
        os.kill(process.pid, signal.SIGCONT)
        with answered:
            assert answered.wait_for(lambda: any(request_id == "kept" for request_id, _, _ in answers), timeout=60)
        time.sleep(0.5)  # time for a stray answer (the aborted request's, had the engine run it) to come
        assert sorted(request_id for request_id, _, _ in answers) == ["aborted", "kept", "too-long"]
        (kept,) = [(answer, thread) for request_id, answer, thread in answers if request_id == "kept"]
        assert isinstance(kept[0], EngineOutput) and kept[1] == "tokenmill-engine-reader"
        expected = LLM("builtin:tiny", max_model_len=64).generate(["a prompt the engine runs"], params, use_tqdm=False)[0]
        assert kept[0].token_ids == expected.token_ids and len(kept[0].token_ids) == 4
    finally:
        engine.stop()


def test_a_request_whose_write_fails_is_not_left_pending() -> None:
    """`send_many` raising on the write (the pipe broken) answers none of its requests and keeps none pending: the caller
    has the error, and a run that is then abandoned is not held in memory by a sink nobody will call."""
    answers: list[str] = []
    engine = EngineProcess("builtin:tiny", {"max_model_len": 64})
    engine._conn.close()  # the pipe gone: the write raises, as to an engine process that died
    try:
        engine.send_many([("a", SamplingParams(max_tokens=2), [5, 6, 7], None, None)], lambda request_id, _: answers.append(request_id))
    except OSError:
        pass
    else:
        raise AssertionError("send_many wrote to a closed pipe")
    assert answers == [] and not engine._pending


def test_a_cancel_or_abort_on_a_broken_pipe_does_not_raise() -> None:
    """The engine process gone (the reader's `_lost` deals with that): a cancel is dropped, an abort still answers its
    request, and neither raises into the loops that cancel or requeue many jobs in a row."""
    answers: list[tuple[str, Any]] = []
    engine = EngineProcess("builtin:tiny", {"max_model_len": 64})
    engine._pending["a"] = lambda request_id, answer: answers.append((request_id, answer))
    engine._conn.close()
    engine.cancel("a", "cancelled")
    engine.abort("a")
    assert [(request_id, type(answer)) for request_id, answer in answers] == [("a", CancelledError)]


def test_a_request_sent_to_an_abandoned_engine_waits_for_the_exit() -> None:
    """After `abandon` (the watchdog's, before the worker hands its jobs back and exits), a request sent is neither
    answered nor refused: an `EngineFailure` would end its job with a failed result."""
    engine = EngineProcess("builtin:tiny", {"max_model_len": 64})
    engine.start(timeout=300)
    engine.abandon()
    outcome: list[Any] = []

    def send() -> None:
        try:
            engine.send_many([("late", SamplingParams(max_tokens=2), [5, 6, 7], None, None)], lambda *answer: outcome.append(answer))
            outcome.append("returned")
        except Exception as exc:
            outcome.append(exc)

    thread = threading.Thread(target=send, daemon=True)
    thread.start()
    thread.join(1.0)
    assert thread.is_alive() and outcome == []
    assert not multiprocessing.active_children(), "the abandoned engine process is gone"
