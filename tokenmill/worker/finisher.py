"""The one thread that finishes every single job the intake handed to the engine, whichever group admitted it.

Each turn, the jobs that ended since the last one are completed together, and stored with their messages acked in one
script call. A run's state is this thread's alone once `watch` is called; a run whose completion or store fails, or
that outlives the shutdown grace, is abandoned (engine requests aborted, messages requeued). Torch-free.
See docs/internals/worker.md, section "The finisher".
"""

from __future__ import annotations

import contextlib
import functools
import logging
import queue
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from tokenmill.worker.engine_process import Answer

log = logging.getLogger("tokenmill.worker")

#: Seconds between checks of the shutdown grace while no job ends.
CHECK_INTERVAL = 1.0


class Storing(Protocol):
    """What the finisher needs of the worker's service (`tokenmill.worker.service.WorkerService`)."""

    #: Set once the shutdown grace has run out: the runs still in the engine are abandoned.
    grace_expired: threading.Event

    def store_results(self, encoded: dict[bytes, bytes], acks: Sequence[tuple[str, str, str]] = ()) -> None:
        """Store the encoded results (never over a stored one) and ack these messages, in one script call."""


class Finishing(Protocol):
    """What the finisher needs of a run (`tokenmill.worker.intake.IntakeRun`)."""

    service: Storing
    #: Whether answers may still come for the run: True until it ends or is abandoned (then they are dropped).
    accepting: bool

    def finish(self, answers: list[tuple[str, Answer]], turn: dict[object, dict[str, Any]]
               ) -> tuple[dict[bytes, bytes], list[tuple[str, str, str]]]:
        """Complete the jobs of these (engine request id, answer) pairs (`engine_process.Answer`); every result not
        stored yet, encoded by key, and the messages the store acks (`WorkerService.store_results`). `turn`: shared by
        the runs finished in one turn, for what they may make once for all (Celery's meta of a result stored now)."""

    def stored_all(self) -> bool:
        """The encoded results are stored: settle them; whether the run has ended (no job left in the engine)."""

    def abandon(self, reason: str) -> None:
        """Abort the run's jobs still in the engine and requeue every message without a stored result."""


class Finisher:
    """The thread (started by the first `watch`) and the queue of engine answers it takes from. Other threads call
    only `sink`'s callable and `watch`."""

    def __init__(self, settling: Callable[[], contextlib.AbstractContextManager[None]] = contextlib.nullcontext
                 ) -> None:
        """`settling`: a context the runs of a turn settle in (`Intake.holding_acks`)."""
        self._settling = settling
        # (run, engine request id, answer), or (run, None, None) when `watch` hands the run over
        self._resolved: queue.SimpleQueue[tuple[Finishing, str | None, Answer | None]] = queue.SimpleQueue()
        self._runs: set[Finishing] = set()  # runs with jobs in the engine: this thread's only
        self._early: list[tuple[Finishing, str, Answer]] = []  # answers of runs not handed over yet
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def sink(self, run: Finishing) -> Callable[[str, Answer], None]:
        """Where the engine answers `run`'s requests (`EngineProcess.send_many`'s sink); usable before `watch`, for
        which an early answer waits."""
        return functools.partial(self._put, run)

    def watch(self, run: Finishing) -> None:
        """Finish `run`'s jobs as their answers come: the run is this thread's from now on. RuntimeError when no
        finisher thread can be started (the run is then still the caller's)."""
        with self._lock:
            if self._thread is None:  # kept only once started: a start that fails is tried again by the next run
                thread = threading.Thread(target=self._serve, name="tokenmill-finisher", daemon=True)
                thread.start()
                self._thread = thread
        self._resolved.put((run, None, None))

    def _put(self, run: Finishing, request_id: str, answer: Answer) -> None:
        self._resolved.put((run, request_id, answer))

    def _serve(self) -> None:
        while True:
            try:
                self._turn()
            except Exception:  # noqa: BLE001: a bug here must not stop every later job from being stored
                log.exception("single jobs: the finisher's turn failed; abandoning its runs")
                for run in list(self._runs):
                    self._abandon(run, "finisher failed")

    def _turn(self) -> None:
        """Everything answered since the last turn (waiting up to `CHECK_INTERVAL` for the first), per run."""
        resolved = self._take()
        for run, request_id, _ in resolved:
            if request_id is None:
                self._runs.add(run)
        by_run: dict[Finishing, list[tuple[str, Answer]]] = {}
        early, self._early = self._early, []
        for item in (*early, *resolved):
            run, request_id, answer = item
            if request_id is None:
                continue
            if run in self._runs:
                by_run.setdefault(run, []).append((request_id, answer))
            elif run.accepting:  # still being admitted: its `watch` comes next
                self._early.append(item)
            # else the run ended or was abandoned: its aborted requests are answered later
        encoded, acks, finishing, turn = {}, [], [], {}
        for run, answers in by_run.items():
            try:
                results, run_acks = run.finish(answers, turn)
                encoded.update(results)
                acks += run_acks
            except Exception as exc:  # noqa: BLE001: this run's jobs are requeued; the others go on
                log.exception("single jobs: completing a group's jobs failed (%s)", type(exc).__name__)
                self._abandon(run, type(exc).__name__)
            else:
                finishing.append(run)
        if encoded:
            try:
                finishing[0].service.store_results(encoded, acks)
            except Exception as exc:  # noqa: BLE001: Redis down: requeued (their reruns find results stored by now)
                log.warning("single jobs: storing %d results failed (%r); requeueing their groups", len(encoded), exc)
                for run in finishing:
                    self._abandon(run, type(exc).__name__)
                finishing = []
        with self._settling():
            for run in finishing:
                if run.stored_all():
                    self._runs.discard(run)
        for run in [run for run in self._runs if run.service.grace_expired.is_set()]:
            log.warning("single jobs: a group's jobs were not finished when the shutdown grace ran out; requeueing them")
            self._abandon(run, "worker shutting down")

    def _take(self) -> list[tuple[Finishing, str | None, Answer | None]]:
        try:
            taken = [self._resolved.get(timeout=CHECK_INTERVAL)]
        except queue.Empty:
            return []
        while True:
            try:
                taken.append(self._resolved.get_nowait())
            except queue.Empty:
                return taken

    def _abandon(self, run: Finishing, reason: str) -> None:
        self._runs.discard(run)
        try:
            run.abandon(reason)
        except Exception:  # noqa: BLE001
            log.exception("single jobs: abandoning a group failed")
