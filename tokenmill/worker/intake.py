"""Single `tokenmill.generate` jobs admitted in groups, without a pool thread each, then finished by the finisher.

`Intake.offer` takes each request Celery's own strategy builds; `job_fields` picks the jobs that stay on the pool path.
Each job ends stored with its message acked, or with its message requeued. Held messages are ordinary unacked kombu
messages (leases renew them, prefetch counts them). `single_job_intake=false` turns the intake off.
See docs/internals/worker.md, section "Single jobs: the intake".
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any, Protocol

from celery import states
from celery.exceptions import Reject
from celery.utils.saferepr import saferepr
from celery.worker.state import task_accepted, task_ready, total_count

from tokenmill.errors import InvalidRequestError
from tokenmill.queue.cancels import result_meta
from tokenmill.queue.names import JOB_HASH_HEADER, message_share
from tokenmill.queue.schemas import is_content_hash, job_payload
from tokenmill.queue.transport import ack_records, acked_by_script, acks_together
from tokenmill.worker.admission import Attempt
from tokenmill.worker.batch_task import BatchRun, JobService
from tokenmill.worker.control import sends_task_events
from tokenmill.worker.finisher import Finisher

if TYPE_CHECKING:
    from concurrent.futures import Future

    from celery.worker.request import Request
    from kombu.asynchronous import Hub

    from tokenmill.queue.schemas import Job
    from tokenmill.worker.engine_process import Answer

log = logging.getLogger("tokenmill.worker")

#: Most single jobs in one group: the service's `CHECK_IN_LIMIT` (not imported: producers must not load the service).
GROUP_LIMIT = 500
#: Message parts only Celery's `trace_task` applies (chords, linked tasks, chains): a job with one takes the pool path.
_TRACED = ("chord", "callbacks", "errbacks", "chain")
#: Largest body of a lone job admitted on the consumer's loop (`Intake._next_group`): it is tokenized there, and a
#: large one would hold up the loop.
LOOP_ADMISSION_MAX_BYTES = 16 * 1024
#: Seconds all of one run's requeue retries may take before the rest are left to the visibility timeout. Per run,
#: not per job: a shutdown with Redis down waits for it.
REQUEUE_SECONDS = 30.0


class IntakeService(JobService, Protocol):
    """What the intake needs of the worker's service (`tokenmill.worker.service.WorkerService`, which owns it)."""

    #: Finishes the jobs of every group the intake admits (the service's one `Finisher`).
    finisher: Finisher

    @property
    def shutting_down(self) -> bool:
        """SIGTERM (or a stop) reached the worker: the consumer's loop has ended or is ending."""


def job_fields(request: Request) -> dict[str, Any] | None:
    """The job a `tokenmill.generate` request carries, as `run_job` reads it; None when it takes the pool path (a
    time limit, a `_TRACED` part, an unreadable body, an `output`, a `deadline_s`, an `id` other than the task id)."""
    if any(request.time_limits) or request.task.time_limit or request.task.soft_time_limit:
        return None
    embed = request.message.payload[2] or {}  # decoded once by kombu, cached
    for name in _TRACED:  # a loop, not `any` over a generator: per message
        if embed.get(name):
            return None
    fields = dict(request.kwargs)
    try:
        payload = job_payload(tuple(request.args), fields)
    except InvalidRequestError:
        return None
    raw = {**payload, **fields}
    if raw.get("output") or raw.get("deadline_s") or raw.setdefault("id", request.id) != request.id:
        return None
    return raw


class Intake:
    """The waiting single-job requests and the group threads that admit them.

    One group is admitted at a time; requests that come meanwhile form the next group, started once the current
    group's jobs are in the engine. A group counts as running (`drain`) until each of its jobs is stored or requeued.
    The owning service binds itself once (`serve`); requests that come before it exists have `start_service` build
    it, once, on a group thread.
    """

    def __init__(self, start_service: Callable[[], object] | None = None) -> None:
        self._start_service = start_service
        self._waiting: list[tuple[Request, dict[str, Any]]] = []
        self._to_ack: list[Request] = []  # requests stored by groups, acked at the loop's next turn
        self._acked: list[Request] = []  # requests acked in Redis with their results, their slots freed at that turn
        self._ack_scheduled = False  # a turn of the loop for `_ack_waiting` is asked for
        self._cond = threading.Condition()
        self._admitting = False
        self._groups = 0  # groups running
        self._threads = _Threads("tokenmill-intake-group")
        self._holding = threading.local()  # `acks`: inside `holding_acks` on this thread
        self.to_pool: Callable[[Request], None] = _unattached  # the consumer's hand-off of a request to its pool
        self._service: IntakeService | None = None
        self.call_soon: Callable[..., object] | None = None
        self.enabled: bool | None = None  # known once the worker's service exists

    def serve(self, service: IntakeService) -> None:
        """Bind the started worker service, once (another one raises RuntimeError); `enabled` becomes its
        `single_job_intake`."""
        if self._service is not None and self._service is not service:
            raise RuntimeError("the intake is served by another worker service already")
        self._service = service
        self.enabled = service.settings.single_job_intake

    def attach(self, on_task_request: Callable[[Request], None], hub: Hub | None) -> None:
        """The consumer's hand-off to its pool and its event loop; called again by a new consumer after a reconnect."""
        self.to_pool = on_task_request
        self.call_soon = hub.call_soon if hub is not None else None
        if hub is not None:
            hub.on_tick.add(self._ack_at_turn)  # a set: the same bound method once, whatever the reconnects

    def offer(self, request: Request) -> None:
        """On the consumer's loop, for each request: queue it for the next group, or hand it to the pool."""
        raw = None if self.enabled is False else job_fields(request)
        if raw is None:
            self.to_pool(request)
            return
        with self._cond:
            self._waiting.append((request, raw))
            if self._admitting:
                return
            self._admitting = True
        self._start_soon()

    def _start_soon(self) -> None:
        """Start the next group on the consumer's loop, after the take being delivered is all waiting: one group."""
        self.soon(self._next_group)

    def soon(self, call: Callable[..., object], *args: Any) -> None:
        """`call(*args)` on the consumer's loop; at once where there is no loop or it has ended (shutting down)."""
        if self._loop_running():
            self.call_soon(call, *args)
        else:
            call(*args)

    def _loop_running(self) -> bool:
        service = self._service
        return self.call_soon is not None and not (service is not None and service.shutting_down)

    def ack_soon(self, requests: list[Request], by_script: list[Request] | None = None) -> None:
        """Ack these requests' messages on the consumer's loop with whatever else waits: one pipeline and one wake-up,
        which lets the loop take more messages as slots free. `by_script`: requests whose messages the result store
        script acked already (`store_results`): only their prefetch slots are freed."""
        if not (requests or by_script):
            return
        with self._cond:
            self._to_ack += requests
            self._acked += by_script or []
        if not getattr(self._holding, "acks", False):
            self._wake_for_acks()

    def _wake_for_acks(self) -> None:
        """Ask the loop for a turn to ack what waits; not when only script-acked slots wait and the consumer has
        room, since its next turn frees them anyway (`_ack_at_turn`)."""
        with self._cond:
            if self._ack_scheduled or not (self._to_ack or self._acked):
                return
            if not self._to_ack and self._loop_running() and _has_room(self._acked[0]):
                return
            self._ack_scheduled = True
        self.soon(self._ack_waiting)

    def _ack_at_turn(self) -> None:
        """On each turn of the consumer's loop (`hub.on_tick`): ack what waits."""
        if self._acked or self._to_ack:
            self._ack_waiting()

    @contextlib.contextmanager
    def holding_acks(self) -> Iterator[None]:
        """Acks this thread queues inside go to the loop together on exit: the finisher's turn wakes it once, not
        once per run."""
        self._holding.acks = True
        try:
            yield
        finally:
            self._holding.acks = False
            self._wake_for_acks()

    def _ack_waiting(self) -> None:
        with self._cond:
            (requests, self._to_ack), (acked, self._acked) = (self._to_ack, []), (self._acked, [])
            self._ack_scheduled = False
        _ack_all(requests)
        for request in acked:
            _acknowledge(request, by_script=True)

    def _next_group(self) -> None:
        """On the consumer's loop: start a group of what waits (up to `GROUP_LIMIT`), or clear `_admitting`.

        A lone small job (`LOOP_ADMISSION_MAX_BYTES`) with no group running is admitted right here, without a group
        thread: the loop is idle then, so this never holds up a take."""
        with self._cond:
            taken, self._waiting = self._waiting[:GROUP_LIMIT], self._waiting[GROUP_LIMIT:]
            if not taken:
                self._admitting = False
                return
            self._groups += 1
            alone = self._groups == 1 and len(taken) == 1 and len(taken[0][0].message.body) <= LOOP_ADMISSION_MAX_BYTES
        if alone and self.enabled is True:  # the service is up; never built here: that loads the model
            try:
                self._run(taken, on_loop=True)
            except Exception:  # noqa: BLE001: as on a group thread; the consumer's loop must go on
                log.exception("single jobs: admitting a job failed")
            return
        try:
            self._threads.run(self._run, taken)
        except RuntimeError:  # no thread to be had: these jobs wait for pool threads instead
            log.exception("single jobs: cannot start a group thread; %d jobs take the pool path", len(taken))
            self._ended()
            for request, _ in taken:
                self.to_pool(request)
            self._next_group()

    def _run(self, taken: list[tuple[Request, dict[str, Any]]], on_loop: bool = False) -> None:
        run = None
        try:
            service = self._worker_service()
            if service is None:
                for request, _ in taken:
                    self.to_pool(request)
                return
            run = IntakeRun(service, self, taken, self._start_soon, self._ended, on_loop)
            run.admit()
        finally:
            if run is None:  # no run reached admission (the intake is off, or setting the run up failed)
                self._ended()
                self._start_soon()

    def _worker_service(self) -> IntakeService | None:
        """The worker's service, built on first use; None when the intake is off or no service can start (the pool
        path then reports that failure job by job)."""
        if self.enabled is None:
            try:
                if self._start_service is None:
                    raise RuntimeError("no worker service serves the intake")
                self._start_service()  # under plain `celery worker`, the first job builds it (loads the model)
                if self._service is None:
                    raise RuntimeError("the worker service started without taking the intake on")
            except Exception:
                log.exception("single jobs: no worker service; every job takes the pool path")
                self.enabled = False
        return self._service if self.enabled else None

    def _ended(self) -> None:
        with self._cond:
            self._groups -= 1
            self._cond.notify_all()

    def drain(self) -> None:
        """Block until every request taken so far is stored or requeued (the shutdown grace bounds each run). Called
        after the consumer's loop has ended: starts any group the loop was to start."""
        while True:
            with self._cond:
                if not (self._waiting or self._groups):
                    return
                if self._groups:
                    self._cond.wait(timeout=1.0)
                    continue
            self._next_group()


class _Threads:
    """Daemon threads running one call at a time, kept once idle for the next. Daemons: an admission stuck on a dead
    engine must not hold the process at exit."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._calls: queue.SimpleQueue[tuple[Callable[..., object], tuple[Any, ...]]] = queue.SimpleQueue()
        self._idle = 0
        self._lock = threading.Lock()

    def run(self, call: Callable[..., object], *args: Any) -> None:
        """`call(*args)` on an idle thread, else on a new one (RuntimeError when none can be started)."""
        with self._lock:
            start = self._idle == 0
            self._idle -= not start
        if start:  # before the call is queued: a thread that cannot start leaves nothing behind
            threading.Thread(target=self._serve, name=self._name, daemon=True).start()
        self._calls.put((call, args))

    def _serve(self) -> None:
        while True:
            call, args = self._calls.get()
            try:
                call(*args)
            except Exception:  # noqa: BLE001: the call reports its own failures; the thread stays for the next
                log.exception("single jobs: a group thread's call failed")
            with self._lock:
                self._idle += 1


def _unattached(request: Request) -> None:
    raise RuntimeError("the intake is not attached to a Celery consumer")


class IntakeRun(BatchRun):
    """One group of single jobs: admitted with `BatchRun`'s steps (`admit`), then finished by the service's
    `Finisher`. Each job's message is acked only once its result is stored."""

    service: IntakeService

    def __init__(self, service: IntakeService, intake: Intake, taken: list[tuple[Request, dict[str, Any]]],
                 admitted: Callable[[], object], ended: Callable[[], object], on_loop: bool = False) -> None:
        super().__init__(service, "single jobs", taken[0][0].task.backend)
        self.intake = intake
        # admitted on the consumer's loop: its engine message is queued, never waited for (the loop must not block
        # on the engine's pipe); a group thread waits for the write
        self.on_loop = on_loop
        self.requests: dict[str, Request] = {}
        self.raw: list[dict[str, Any]] = []
        self.to_pool = intake.to_pool
        # each called once: when the jobs are in the engine (or the run ended before); when each is stored or requeued
        self._on_admitted: Callable[[], object] | None = admitted
        self._on_ended: Callable[[], object] | None = ended
        self.done: dict[str, dict[str, Any]] = {}  # job id -> final result
        self._acked_by_store: dict[str, tuple[str, str, str]] = {}  # job id -> its message's ack, in the next store
        self.in_engine: dict[str, Attempt] = {}  # engine request id -> its Attempt
        self.accepting = True  # `Finishing.accepting`: until the run ends or is abandoned
        for request, raw in taken:
            if request.id in self.requests:  # the same job twice in one take: the pool path waits for this run
                self.to_pool(request)
                continue
            self.requests[request.id] = request
            self.raw.append(raw)

    def admit(self) -> None:
        """Parse, claim, check in, store the results known already, and hand the rest to the engine and the finisher.
        Any failure requeues the unfinished jobs' messages."""
        try:
            _accept(self.requests.values())
            jobs, self.done = self._parse(self.raw)
            todo = self._check_in(self._claim(jobs), self.done)
            self._store(self.done)
            if todo:
                self._send(todo)
        except Exception as exc:
            log.exception("single jobs: admitting a group failed (%s); requeueing its %d unfinished jobs",
                          type(exc).__name__, len(self.requests))
            self.abandon(type(exc).__name__)
            return
        finally:
            self._admitted()
        if not self.in_engine:
            self._end()
            return
        try:
            self.service.finisher.watch(self)
        except RuntimeError:  # no finisher thread to be had
            log.exception("single jobs: cannot start the finisher; requeueing a group's %d jobs", len(self.requests))
            self.abandon("no finisher thread")

    def _send(self, runs: list[Attempt]) -> None:
        """Hand `runs` to the engine in one message; their answers wait in the finisher's queue until `watch`, by
        which time `in_engine` is complete."""
        submitted = self.service.submit_many(runs, self.service.finisher.sink(self), wait=not self.on_loop)
        self.in_engine = {request_id: run for run, (_, request_id) in zip(runs, submitted)}
        self.service.metrics.jobs_in_flight.inc(len(runs))

    def finish(self, answers: list[tuple[str, Answer]], turn: dict[object, dict[str, Any]]
               ) -> tuple[dict[bytes, bytes], list[tuple[str, str, str]]]:
        """`Finishing.finish`. Celery's result meta is made once per turn and backend (`turn`), not once per run."""
        left_engine = 0
        try:
            for request_id, answer in answers:
                attempt = self.in_engine.pop(request_id)
                left_engine += 1
                self.done[attempt.job.id] = self._complete(attempt, answer)
        finally:
            self.service.metrics.jobs_in_flight.dec(left_engine)
        new = self.unstored(self.done)
        held = [job_id for job_id in new if job_id in self.requests]
        records = ack_records([self.requests[job_id].message for job_id in held])
        self._acked_by_store = {job_id: record for job_id, record in zip(held, records) if record is not None}
        meta = turn.get(self.backend)
        if meta is None and new:
            meta = turn[self.backend] = result_meta(self.backend, states.SUCCESS)
        return self.encode(self.done, new, meta), list(self._acked_by_store.values())

    def stored_all(self) -> bool:
        """`Finishing.stored_all`: the results are in Redis; once no job is left in the engine, the run ends."""
        self.stored(self.done)
        if self.in_engine:
            return False
        self._end()
        return True

    def abandon(self, reason: str) -> None:
        """`Finishing.abandon`: abort what is in the engine, requeue every message without a stored result, and end."""
        self.accepting = False  # before the aborts: their answers are dropped
        for request_id in self.in_engine:
            self.service.engine.abort(request_id)
        self.service.metrics.jobs_in_flight.dec(len(self.in_engine))
        self.in_engine = {}
        # a delivery of one of these jobs waiting on this run is requeued too
        self._release_mine(self.done, Reject(f"single jobs: {reason}", requeue=True))
        self._requeue_then_end(reason)

    def _end(self) -> None:
        """End the run; every job should be stored, found stored or handed on by now, and any left is requeued."""
        self.accepting = False
        self._release_mine(self.done)
        if self.requests:
            log.error("single jobs: %d jobs ended without a stored result; requeueing them", len(self.requests))
            self._requeue_then_end("no result")
        else:
            self._ended()

    def _requeue_then_end(self, reason: str) -> None:
        """`_requeue_rest` on a thread of its own (its retries must not hold up the finisher), then end the run."""

        def requeue() -> None:
            try:
                self._requeue_rest(reason)
            finally:
                self._ended()

        try:
            threading.Thread(target=requeue, name="tokenmill-requeue", daemon=True).start()
        except RuntimeError:  # no thread to be had: requeue on this one rather than never end the run
            requeue()

    def _ended(self) -> None:
        ended, self._on_ended = self._on_ended, None
        if ended is not None:
            ended()

    def _admitted(self) -> None:
        """The run's jobs are in the engine (or none was left to run): the intake may start its next group."""
        admitted, self._on_admitted = self._on_admitted, None
        if admitted is not None:
            admitted()

    def source(self, job_id: str) -> bytes | None:
        body = self.requests[job_id].message.body  # the message's JSON (kombu decoded the transport's base64)
        return body if isinstance(body, bytes) else None

    def attempt(self, job: Job) -> Attempt:
        headers = self.requests[job.id].message.headers  # a dict: the guard checked it
        sent = headers.get(JOB_HASH_HEADER)
        return Attempt(job, self.started_at, 0, self.time_limit, sent if is_content_hash(sent) else "",
                       message_share(headers))

    def joined(self, running: list[tuple[Job, Future]]) -> None:
        for job, _ in running:  # the pool path waits for that run (and names a conflict)
            self.to_pool(self.requests.pop(job.id))

    def settled(self, job_ids: list[str], results: dict[str, dict[str, Any]]) -> None:
        acked, self._acked_by_store = self._acked_by_store, {}
        settled = [job_id for job_id in job_ids if job_id in self.requests]
        self.intake.ack_soon([self.requests[job_id] for job_id in settled if job_id not in acked],
                             [self.requests[job_id] for job_id in settled if job_id in acked])
        requests = [(self.requests.pop(job_id), results.get(job_id)) for job_id in settled]
        now = time.time()
        for request, result in requests:
            # not `successful=True`: Celery reads `successful_requests` only for active requests, and this one stops
            # being active here
            task_ready(request)
            if _sends_task_events(request):  # the result's repr is costly: only for an event that is sent
                request.send_event("task-succeeded", result=saferepr(result, request.task.resultrepr_maxsize),
                                   runtime=now - (request.time_start or now))

    def _requeue_rest(self, reason: str) -> None:
        """Requeue the unfinished jobs' messages at the head of their queues, retrying until `REQUEUE_SECONDS`;
        those left are released (`_release`) for the visibility timeout to requeue."""
        deadline = time.monotonic() + REQUEUE_SECONDS
        left = []
        for request in self.requests.values():
            while not request.acknowledged and time.monotonic() < deadline:  # Celery marks it once the reject went
                try:
                    request.reject(requeue=True)
                except Exception as exc:  # noqa: BLE001: Redis down; the message stays held and renewed meanwhile
                    log.warning("job %s: requeue failed (%r); trying again", request.id, exc)
                    time.sleep(max(0.0, min(1.0, deadline - time.monotonic())))
            if not request.acknowledged:
                left.append(request)
            task_ready(request)
        if left:
            log.warning("single jobs: %d messages not requeued within %.0fs; the visibility timeout requeues them",
                        len(left), REQUEUE_SECONDS)
            self.intake.soon(_release, left)
        log.info("single jobs: %d requeued (%s)", len(self.requests) - len(left), reason)
        self.requests.clear()


def _release(requests: list[Request]) -> None:
    """Drop these messages' local records, leaving them unacked in Redis: their slots free and their leases lapse,
    so the visibility timeout requeues them."""
    for request in requests:
        if not request.acknowledged:
            acked_by_script(request.message)
            request.acknowledged = True


def _sends_task_events(request: Request) -> bool:
    """Whether `Request.send_event` would send a task event: asked first, so no event is built only to be dropped."""
    return request.task.send_events and sends_task_events(request.eventer)


def _has_room(request: Request) -> bool:
    """Whether the consumer that delivered `request` can take more with its slot still held; a hint, read from
    another thread."""
    qos = getattr(getattr(request.message, "channel", None), "qos", None)
    return qos is not None and bool(qos.can_consume())


def _ack_all(requests: list[Request]) -> None:
    with acks_together():
        for request in requests:
            _acknowledge(request)


def _acknowledge(request: Request, by_script: bool = False) -> None:
    """`Request.acknowledge` in the calling thread, so acks can share a round trip (`acks_together`). `by_script`:
    the store script acked the message in Redis already; only its slot is freed."""
    if not request.acknowledged:
        if by_script:
            acked_by_script(request.message)
        else:
            request.message.ack_log_error(log, request.connection_errors)
        request.acknowledged = True


def _accept(requests: Iterable[Request]) -> None:
    """What Celery's pool does as a job starts: `active` in `celery inspect`, the `task-started` event. The per-name
    `total` count is added once per group (`_counted_below`)."""
    now, pid, accepted = time.time(), os.getpid(), Counter()
    for request in requests:
        request.time_start = now
        request.worker_pid = pid
        task_accepted(request, add_to_total_count=_counted_below)
        accepted[request.name] += 1
        if _sends_task_events(request):
            request.send_event("task-started")
    total_count.update(accepted)


def _counted_below(count: dict[str, int]) -> None:
    """Skips `task_accepted`'s per-job count: `_accept` adds the group's at once."""
