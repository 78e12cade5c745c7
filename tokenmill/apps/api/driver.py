"""Driving batches: one thread per batch that is not final, in whichever server process holds its lease.

A driver validates the input file by `tokenmill batch`'s own rule (`check_lines`: a file unusable as a whole
fails the batch, naming the lines; a request whose body is refused is only that request's 400 line in the error
file, as OpenAI does), queues its requests as jobs in `tokenmill.generate_batch` group messages
(`QueueRunner.submit`) with ids derived from (batch id, custom_id, choice), collects their results, and writes the
output and error files in input order with `tokenmill batch`'s own line code (`request_line`).

Nothing lives only in memory: the batch object, how many jobs were queued and a cancel request are in Redis
(`records`), results are the queue's. A server killed mid-batch loses its lease; the next server that scans
the active batches (every few seconds, and at start-up) takes the lease and goes on from the record: jobs
already queued are not queued again, results already stored are read, not recomputed.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
import time
import uuid
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

from tokenmill.apps.api.errors import logged_reference
from tokenmill.apps.api.files import FileStore
from tokenmill.apps.api.records import FINAL, OUTPUT_EXPIRES_FIELD, Records, now, refused_key
from tokenmill.apps.api.resources import Connections
from tokenmill.apps.api.settings import ServeSettings
from tokenmill.apps.batch import (FileProblem, Parser, Refused, Request, Source, check_lines, parse_requests,
                                  request_line)
from tokenmill.apps.datasets import MAX_ROW_BYTES, DatasetError
from tokenmill.apps.runners import QueueRunner, Unit, error_text, outcome_from_result
from tokenmill.apps.store import Outcome
from tokenmill.client import Client
from tokenmill.queue.served import not_served, served_models

log = logging.getLogger(__name__)
T = TypeVar("T")
#: Items `Supervisor.expire` claims at a time; it goes on claiming while more are due.
EXPIRE_CHUNK = 100


class Stopped(Exception):
    """The lease was lost, or this server is shutting down: stop driving (someone else goes on)."""


def job_id(batch_id: str, custom_id: str, choice: int) -> str:
    """A request's job id, stable across restarts (so re-queueing is idempotent), in the job id alphabet."""
    digest = hashlib.sha256(custom_id.encode()).hexdigest()[:24]
    return f"{batch_id.replace('_', '.')}.{digest}.{choice}"


def tenant_share(tenant: str) -> str:
    """The fair share of the queue a tenant's jobs wait in: workers take from each tenant's share in turn, so one
    tenant's backlog does not hold another's batches behind it."""
    return "t-" + hashlib.sha256(tenant.encode()).hexdigest()[:16]


def model_label(settings: ServeSettings) -> str:
    """The model label in request keys: the one `tokenmill batch --broker` uses without `--model`, so the same
    input file gives the same line ids and bodies through either."""
    return f"queue:{settings.queue}"


@dataclass
class Plan:
    """A validated batch: its requests in input order (the refused ones too) and each job's unit."""

    requests: list[tuple[int, Request | Refused]]
    units: list[Unit] = field(default_factory=list)
    models: dict[str, str] = field(default_factory=dict)  # job id -> the model its request names

    def __post_init__(self) -> None:
        self.units = [unit for _, request in self.requests for unit in request.units]


class RequestCounts:
    """A plan's completed and failed requests, kept as its jobs' outcomes arrive: each outcome is counted once,
    where counting every request again at each interval cost a 10,000-line batch 11% of the server's CPU."""

    def __init__(self, plan: Plan) -> None:
        self._request_of: dict[str, int] = {}  # job id -> its request's index in `plan.requests`
        self._left: list[int] = []  # per request: its jobs without an outcome yet
        self._ok: list[bool] = []  # per request: every outcome so far succeeded
        self.completed = 0
        self.failed = sum(isinstance(request, Refused) for _, request in plan.requests)  # refused: no job
        for index, (_, request) in enumerate(plan.requests):
            self._left.append(len(request.units))
            self._ok.append(True)
            self._request_of.update((unit.job_id, index) for unit in request.units)

    def add(self, job_id: str, outcome: Outcome) -> None:
        """Count `job_id`'s outcome (once per job: the caller adds each job's first outcome only; an id that is no
        job of the plan counts for nothing, as before)."""
        index = self._request_of.get(job_id)
        if index is None:
            return
        self._ok[index] = self._ok[index] and outcome.ok
        self._left[index] -= 1
        if self._left[index] == 0:
            self.completed += self._ok[index]
            self.failed += not self._ok[index]


class Driver(threading.Thread):
    """Drives one batch from where its record says it is to a final status."""

    def __init__(self, batch_id: str, token: str, settings: ServeSettings, records: Records, store: FileStore,
                 stopping: threading.Event, connections: Connections | None = None) -> None:
        super().__init__(name=f"batch-{batch_id}", daemon=True)
        self.batch_id = batch_id
        self.token = token
        self.settings = settings
        self.records = records
        self.connections = connections or Connections(settings, records.redis)
        self.store = store
        self.stopping = stopping
        self.handing_over = threading.Event()  # set by the supervisor: give the lease back at the next heartbeat
        self.interval = min(1.0, settings.lease_seconds / 3)
        self._renewed = time.monotonic()
        self.parser = Parser(model_label(settings), settings.default_max_tokens)

    def run(self) -> None:
        try:
            self.drive()
            self.records.redis.delete(refused_key(self.batch_id))  # ended: its outcomes are in its files now
        except Stopped:
            log.info("batch %s: handed over", self.batch_id)
        except Exception as exc:  # a bug or a lost Redis must not leave the batch stuck in the active set
            reference = logged_reference(log, exc, "batch %s: failed", self.batch_id)
            try:
                with self.connections.client() as client:
                    client.cancel_run(self.batch_id)  # first: once it reads `failed`, none of its jobs runs any more
                self._fail([{"code": "server_error", "message": f"The server had an error processing this batch "
                             f"(reference {reference}).", "line": None, "param": None}])
                self.records.redis.delete(refused_key(self.batch_id))
            except Exception:
                log.exception("batch %s: could not record the failure", self.batch_id)
        finally:
            self.records.release_lease(self.batch_id, self.token)

    def drive(self) -> None:
        batch = self.records.batch(self.batch_id)
        unvalidated = batch["status"] == "cancelling" and not batch["request_counts"]["total"]
        requests: Iterable[tuple[int, Request | Refused]] | None = None
        if batch["status"] == "validating" or unvalidated:
            # validated even when a cancel came first: then every request is counted and in the error file, and a
            # bad line is reported (the batch ends cancelled with `errors`) instead of dropping out unseen
            batch, requests = self.validate(batch)
            if batch["status"] in FINAL:
                return
        if requests is None:  # validated by an earlier run (this server's before a restart, or another's)
            source = Source(self.store.uri(batch["input_file_id"]), self.store.endpoint, MAX_ROW_BYTES)
            requests = self.beating(parse_requests(source, self.parser))  # a big file takes a while to read again
        plan = Plan(list(requests))
        for _, request in plan.requests:
            for choice, unit in enumerate(request.units):
                unit.job_id = job_id(self.batch_id, request.custom_id, choice)
                plan.models[unit.job_id] = request.model
        with self.connections.client(tenant_share(self.records.tenant_of(self.batch_id))) as client:
            if batch["status"] == "in_progress":
                # a turn of the server's publishers (the lease renewed while it waits); the broker channels are closed
                # after it, not held through the collecting
                with self.connections.publishing(client, self.heartbeat, self.interval):
                    self.publish(client, plan)
            outcomes = self.collect(client, plan)
        self.finish(plan, outcomes)

    # -- validating -----------------------------------------------------------------------------

    def validate(self, batch: dict[str, Any]) -> tuple[dict[str, Any], list[tuple[int, Request | Refused]]]:
        """Check the file (`check_lines`): an unusable one fails the batch with `errors` naming the lines. Returns
        the batch record and the requests with their line numbers, so that they are not parsed again."""
        errors, requests = self._check_lines(batch)
        if errors:
            return self._fail(errors), requests
        total = len(requests)

        def start(b: dict[str, Any]) -> None:
            if b["status"] == "validating":
                b.update(status="in_progress", in_progress_at=now())
            b["request_counts"]["total"] = total

        return self.records.update(self.batch_id, start), requests

    def _check_lines(self, batch: dict[str, Any]) -> tuple[list[dict[str, Any]], list[tuple[int, Request | Refused]]]:
        """What makes the file unusable, as `errors` lists it, and, while nothing does, each line's request."""
        problems: list[dict[str, Any]] = []
        requests: list[tuple[int, Request | Refused]] = []
        source = Source(self.store.uri(batch["input_file_id"]), self.store.endpoint, MAX_ROW_BYTES)
        lines = check_lines(source, problems, batch["endpoint"], self.settings.max_batch_lines)
        try:
            for number, line in self.beating(lines):
                if not problems:
                    requests.append((number, self.parser.request(line)))
        except DatasetError as exc:  # its message names the store's path or bucket: the log's, not the tenant's
            reference = logged_reference(log, exc, "batch %s: input file %s unreadable", self.batch_id,
                                         batch["input_file_id"])
            problems.append(FileProblem("invalid_file", "the input file could not be read (deleted before the batch "
                                        f"read it, or the files store failing; reference {reference})").at(None))
        jobs = sum(len(request.units) for _, request in requests)
        if not problems and jobs > self.settings.max_batch_lines:  # `n` choices are jobs too
            problems.append(FileProblem("too_many_lines", f"the file asks for {jobs} completions (its lines' n "
                                        f"added up), more than {self.settings.max_batch_lines} (TOKENMILL_MAX_BATCH_LINES)"
                                        ).at(None))
        return problems, requests

    def _fail(self, errors: list[dict[str, Any]]) -> dict[str, Any]:
        """Failed with `errors`; a batch asked to cancel meanwhile ends cancelled, with the same `errors`."""
        def fail(b: dict[str, Any]) -> None:
            b["errors"] = {"object": "list", "data": errors}
            if b["status"] == "cancelling":
                b.update(status="cancelled", cancelled_at=now())
            else:
                b.update(status="failed", failed_at=now())

        return self.records.update(self.batch_id, fail)

    # -- queueing and collecting ----------------------------------------------------------------

    def publish(self, client: Client, plan: Plan) -> None:
        """Queue the jobs not queued yet, one group message at a time, recording progress after each. (A server
        killed between sending a group and recording it sends that group again: the workers skip a job whose
        result is stored.)"""
        runner = QueueRunner(client, rows_per_message=self.settings.batch_rows_per_message, run_id=self.batch_id)
        size = self.settings.batch_rows_per_message
        published = int(self.records.field(self.batch_id, "published") or 0)
        for start in range(published, len(plan.units), size):
            if self.records.field(self.batch_id, "cancel"):
                return
            self.heartbeat()
            units, unserved = self._served(plan, plan.units[start : start + size])
            refused = runner.submit(units)[0] if units else []
            failed = {**unserved, **{u.job_id: o.error for u, o in refused}}
            if failed:
                self.records.redis.hset(refused_key(self.batch_id), mapping=failed)
            self.records.set_field(self.batch_id, "published", start + size)

    def _served(self, plan: Plan, units: list[Unit]) -> tuple[list[Unit], dict[str, str]]:
        """The units whose model a live worker on the queue announces, and an error for each of the others
        (never queued: no worker would take them as that model). A line that names no model (the parser's default
        label) goes to whichever worker takes it. With no live worker at all every unit is queued: the jobs wait
        for workers, as any job does (and the completion window still ends the batch)."""
        served = served_models(self.records.redis, self.settings.queue)
        why = {u.job_id: not_served(plan.models[u.job_id], served, self.settings.queue) for u in units
               if plan.models[u.job_id] != self.parser.model}
        unserved = {job: error_text("model_not_found", reason, "model") for job, reason in why.items() if reason}
        return [u for u in units if u.job_id not in unserved], unserved

    def collect(self, client: Client, plan: Plan) -> dict[str, Outcome]:
        """Every job's outcome, counting requests as they finish; a cancel or the deadline cancels the rest."""
        outcomes = self._refused_outcomes()
        published = min(len(plan.units), int(self.records.field(self.batch_id, "published") or 0))
        pending = [u.job_id for u in plan.units[:published] if u.job_id not in outcomes]
        unqueued = [u.job_id for u in plan.units[published:]]  # a cancel came before they were queued
        for job in unqueued:
            outcomes[job] = Outcome.failed("cancelled: never queued")
        counts = RequestCounts(plan)
        for job, outcome in outcomes.items():
            counts.add(job, outcome)
        cancelled = False

        def tick(count: bool = True) -> None:  # each interval: a cancel or the deadline, the lease, the counts
            nonlocal cancelled
            if not cancelled and self._ending():
                client.cancel([job for job in pending if job not in outcomes])
                cancelled = True
            self.heartbeat(force=True)
            if count:
                self._count(counts)

        if pending:
            # not counted yet: the results stored already (a server taking the batch over finds many) come first, and
            # counts written before them went back to the refused lines' alone
            tick(count=False)
            for result in client.as_completed(pending, tick=self.interval):  # one subscription for the whole wait
                if result is None:
                    tick()
                elif result.id not in outcomes:
                    outcomes[result.id] = outcome_from_result(result)
                    counts.add(result.id, outcomes[result.id])
            self.heartbeat(force=True)
            self._count(counts)
        return outcomes

    def _ending(self) -> str | None:
        """`cancel` or `expire` once the batch must stop early (asked to, or past its completion window)."""
        reason = self.records.field(self.batch_id, "cancel")
        if reason is None and now() >= self.records.batch(self.batch_id)["expires_at"]:
            self.records.set_field(self.batch_id, "cancel", "expire")
            reason = "expire"
        return reason

    def _refused_outcomes(self) -> dict[str, Outcome]:
        refused = self.records.redis.hgetall(refused_key(self.batch_id))
        return {k.decode(): Outcome.failed(v.decode()) for k, v in refused.items()}

    def _count(self, counts: RequestCounts) -> None:
        completed, failed = counts.completed, counts.failed

        def count(b: dict[str, Any]) -> None:
            b["request_counts"].update(completed=completed, failed=failed)

        batch = self.records.batch(self.batch_id)
        if (batch["request_counts"]["completed"], batch["request_counts"]["failed"]) != (completed, failed):
            self.records.update(self.batch_id, count)

    # -- finishing ------------------------------------------------------------------------------

    def finish(self, plan: Plan, outcomes: dict[str, Outcome]) -> None:
        """Write the output and error files from the outcomes, in input order, then the final status."""
        reason = self.records.field(self.batch_id, "cancel")
        self.records.update(self.batch_id, lambda b: b.update(status="finalizing", finalizing_at=b.get("finalizing_at") or now())
                            if b["status"] == "in_progress" else None)
        lines: dict[bool, list[bytes]] = {True: [], False: []}
        completed = failed = prompt_tokens = completion_tokens = 0
        for _, request in self.beating(plan.requests):
            got = [_unfinished(outcomes[u.job_id], reason) for u in request.units]
            line, error = request_line(request, got)
            lines[error is None].append(json.dumps(line, ensure_ascii=False).encode() + b"\n")
            completed += error is None
            failed += error is not None
            if error is None:
                prompt_tokens += line["response"]["body"]["usage"]["prompt_tokens"]  # an embeddings line: its inputs'
                completion_tokens += sum(o.completion_tokens for o in got)
        output = self._write_file("output", lines[True])
        errors = self._write_file("errors", lines[False])
        usage = {"input_tokens": prompt_tokens, "input_tokens_details": {"cached_tokens": 0},
                 "output_tokens": completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
                 "total_tokens": prompt_tokens + completion_tokens}
        status, stamp = {"cancel": ("cancelled", "cancelled_at"), "expire": ("expired", "expired_at")}.get(
            reason or "", ("completed", "completed_at"))

        def done(b: dict[str, Any]) -> None:
            b["request_counts"].update(completed=completed, failed=failed)
            b.update(status=status, output_file_id=output, error_file_id=errors, usage=usage)
            b[stamp] = now()

        self.heartbeat(force=True)  # still this server's batch
        self.records.update(self.batch_id, done)

    def _write_file(self, kind: str, lines: list[bytes]) -> str | None:
        """An output file of the batch's tenant (its id derived from the batch: a rerun overwrites it)."""
        if not lines:
            return None
        file_id = f"file-{self.batch_id.removeprefix('batch_')}-{kind}"
        size = self.store.write_lines(file_id, self.beating(lines))
        tenant = self.records.tenant_of(self.batch_id)
        if self.records.file(tenant, file_id) is None:
            expires_in = int(self.records.field(self.batch_id, OUTPUT_EXPIRES_FIELD) or self.settings.file_expires)
            self.records.add_file(tenant, file_object(file_id, f"{self.batch_id}_{kind}.jsonl", size, "batch_output",
                                                      expires_in))
        return file_id

    def beating(self, items: Iterable[T]) -> Iterator[T]:
        """`items`, renewing the lease as they are taken: a big input re-read, or output files written on a slow
        store, outlast a lease (and a lost one stops the writing, the partial file discarded)."""
        for item in items:
            self.heartbeat()
            yield item

    def heartbeat(self, force: bool = False) -> None:
        """Renew the lease (every third of it, or now); raise `Stopped` if it is lost, the server stops or the
        supervisor asks for the driver back (the batch goes on from its record, under the next lease)."""
        if self.stopping.is_set() or self.handing_over.is_set():
            raise Stopped()
        if force or time.monotonic() - self._renewed >= self.interval:
            if not self.records.renew_lease(self.batch_id, self.token, self.settings.lease_seconds):
                raise Stopped()
            self._renewed = time.monotonic()


def _unfinished(outcome: Outcome, reason: str | None) -> Outcome:
    """A request cut short by a cancel or the deadline: OpenAI's codes for it in the error file."""
    if not outcome.cancelled or reason is None:
        return outcome
    if reason == "expire":
        return Outcome.failed("batch_expired: this request could not be executed before the completion window expired")
    return Outcome.failed("batch_cancelled: this request was not finished before the batch was cancelled")


def file_object(file_id: str, filename: str, size: int, purpose: str, expires_in: int) -> dict[str, Any]:
    """A `FileObject` as the SDK's type has it, expiring `expires_in` seconds from now (`Records.due`)."""
    created = now()
    return {"id": file_id, "object": "file", "bytes": size, "created_at": created, "filename": filename,
            "purpose": purpose, "status": "processed", "expires_at": created + expires_in, "status_details": None}


class Supervisor(threading.Thread):
    """Scans the active batches (at start-up, every third of a lease, and when poked) and drives those whose lease it
    can take, at most `max_drivers` at once (a thread and a queue client each): past that, the others wait in the
    active set for a free driver here or on another server. Drivers go to the tenants in turn, each tenant's oldest
    batch first, and a tenant with batches waiting and no driver here gets one back from the tenant holding the most
    (that batch goes on later from its record), so that one tenant's many batches cannot keep another's waiting."""

    def __init__(self, settings: ServeSettings, records: Records, store: FileStore,
                 connections: Connections | None = None) -> None:
        super().__init__(name="batch-supervisor", daemon=True)
        self.settings = settings
        self.records = records
        self.store = store
        self.connections = connections or Connections(settings, records.redis)
        self.stopping = threading.Event()
        self.poked = threading.Event()
        self.token = uuid.uuid4().hex
        self.drivers: dict[str, Driver] = {}

    def run(self) -> None:
        while not self.stopping.is_set():
            try:
                self.adopt()
                self.expire()
            except Exception:
                log.exception("scanning the active batches failed; trying again")
            self.poked.wait(min(2.0, self.settings.lease_seconds / 3))
            self.poked.clear()

    def adopt(self) -> None:
        self.drivers = {k: d for k, d in self.drivers.items() if d.is_alive()}
        by_tenant = self.records.active_by_tenant()
        if len(self.drivers) >= self.settings.max_drivers:
            self._hand_one_back(by_tenant)
        for batch_id in in_turns(by_tenant):
            if len(self.drivers) >= self.settings.max_drivers or self.stopping.is_set():
                return
            if batch_id in self.drivers:
                continue
            token = f"{self.token}:{uuid.uuid4().hex[:8]}"
            if self.records.take_lease(batch_id, token, self.settings.lease_seconds):
                driver = Driver(batch_id, token, self.settings, self.records, self.store, self.stopping,
                                self.connections)
                self.drivers[batch_id] = driver
                driver.start()

    def expire(self) -> None:
        """Delete everything due now (`Records.due`, `EXPIRE_CHUNK` at a time): a file's record, index entry and stored
        bytes, unless a batch still running reads it (then it is due again later); a final batch's record."""
        at = time.time()
        while not self.stopping.is_set():
            due = self.records.due(at, EXPIRE_CHUNK)
            if not due:
                return
            inputs = self.records.active_inputs()
            for kind, item_id, tenant in due:
                if kind == "file" and item_id in inputs:
                    self.records.expire_later(kind, item_id, tenant, self.settings.lease_seconds * 10)
                elif kind == "file":
                    self.records.delete_file(tenant, item_id)
                    self.store.delete(item_id)
                else:
                    self.records.forget_batch(tenant, item_id)
            if len(due) < EXPIRE_CHUNK:
                return

    def _hand_one_back(self, by_tenant: dict[str, list[str]]) -> None:
        """All drivers busy: if a tenant has batches waiting and none driven here, ask the newest driver of the tenant
        holding the most (more than one) to hand its batch back; the next scans give the freed driver to the waiting
        tenant (`in_turns`)."""
        held = {tenant: [b for b in batches if b in self.drivers] for tenant, batches in by_tenant.items()}
        if not any(batches and not held[tenant] for tenant, batches in by_tenant.items()):
            return
        tenant = max(held, key=lambda t: len(held[t]))
        if len(held[tenant]) > 1 and not any(self.drivers[b].handing_over.is_set() for b in held[tenant]):
            self.drivers[held[tenant][-1]].handing_over.set()

    def stop(self, timeout: float = 10.0) -> None:
        self.stopping.set()
        self.poked.set()
        for driver in list(self.drivers.values()):
            driver.join(timeout)


def in_turns(by_tenant: dict[str, list[str]]) -> Iterator[str]:
    """Every tenant's first batch, then every tenant's second, and so on (tenants in name order)."""
    queues = [batches for _, batches in sorted(by_tenant.items())]
    for depth in range(max(map(len, queues), default=0)):
        yield from (batches[depth] for batches in queues if depth < len(batches))
