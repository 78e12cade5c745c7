"""Where completions are computed: in this process (`EmbeddedRunner`) or by queue workers (`QueueRunner`).

Both take a lazy iterator of `Unit`s and yield `(unit, Outcome)` as each finishes, pulling new units only
while fewer than `window` are in flight: the input is never read ahead further than that, which is what
keeps a run's memory bounded.
"""

from __future__ import annotations

import itertools
import json
import re
import sys
import time
import uuid
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from tokenmill.apps.options import RunOptions, require_model
from tokenmill.apps.store import Outcome
from tokenmill.errors import InvalidRequestError
from tokenmill.sampling_params import CONSTRAINT_CODES, SamplingParams, constraint_problem

_FIELD = re.compile(r" \(field: ([^()]*)\)\Z")  # the end of an `error_text`
#: Characters of a unit's label (its row id or custom_id) a job carries in its metadata, for the workers' logs.
LABEL_CHARS = 64
#: Rows in flight at most, by mode, where the run's options leave `window` unset.
DEFAULT_WINDOW = {"embedded": 1024, "queue": 4096}
_DRAIN_TIMEOUT = 5.0  # seconds to wait, after Ctrl-C, for the cancelled jobs' results (the rest are collected on resume)


@dataclass
class Unit:
    """One completion to compute: `key` is its checkpoint key; `job_id` its queue id (idempotency key). With `embed`
    (`Embed`'s fields), an embedding instead: `sampling` is empty, `prompt` a text or token ids. With `score` (a
    `Score`'s continuations), those continuations' scores instead, `sampling` empty too."""

    key: str
    prompt: str | list[int] | None
    messages: list[dict[str, str]] | None
    sampling: dict[str, Any]
    job_id: str = ""
    label: str = ""  # the row or request it belongs to, for the worker's logs
    weight: float = 1.0  # the share of its row it stands for (an OpenAI request with n=2 has two units)
    embed: dict[str, Any] | None = None
    score: list[str | list[int]] | None = None


def make_runner(options: RunOptions, run: str) -> EmbeddedRunner | QueueRunner:
    """The runner `options` ask for: the engine here (`llm`, else `model` loaded with `engine_options`), or the
    queue's workers for `run` (the checkpoint's run id; printed, for `tokenmill cancel`). Options naming no engine
    raise as `require_model` does."""
    require_model(options)
    window = options.window or DEFAULT_WINDOW[options.mode]
    if options.mode == "queue":
        from tokenmill.client import Client

        client = Client(options.broker, queue=options.queue, share=run[:12])  # each run its fair share of the queue
        client.ping()  # an unreachable broker is one line before the run is announced
        runner = QueueRunner(client, window, options.rows_per_message, run[:12], options.detach)
        print(f"tokenmill: run {runner.run_id} (tokenmill cancel --run {runner.run_id} stops it)", file=sys.stderr)
        return runner
    llm = options.llm
    if llm is None:
        from tokenmill.engine.llm import LLM

        llm = LLM(options.model, **(options.engine_options or {}))
    return EmbeddedRunner(llm, window)


class EmbeddedRunner:
    """The engine in this process (`tokenmill.LLM`), fed through `add_request`/`step`."""

    def __init__(self, llm: Any, window: int = 1024) -> None:
        self.llm = llm
        self.engine = llm.engine
        self.window = window
        self._prefix = f"annotate-{uuid.uuid4().hex[:8]}-"
        stats = self.engine.stats()
        self._before = (stats.num_prefix_hit_tokens, stats.num_prompt_tokens)  # the engine may have served before

    def check(self, sampling: dict[str, Any]) -> None:
        """Refuse, before any row runs, sampling the engine would refuse for every row (`InvalidRequestError`)."""
        self.engine.check_choice_budget(SamplingParams.from_dict(sampling))

    def run(self, units: Iterable[Unit]) -> Iterator[tuple[Unit, Outcome]]:
        pending = iter(units)
        inflight: dict[str, Unit] = {}
        counter = 0
        exhausted = False
        try:
            while True:
                while not exhausted and len(inflight) < self.window:
                    unit = next(pending, None)
                    if unit is None:
                        exhausted = True
                        break
                    counter += 1
                    request_id = f"{self._prefix}{counter}"
                    refused = self._add(request_id, unit)
                    if refused is None:
                        inflight[request_id] = unit
                    else:
                        yield unit, refused
                if not inflight:
                    return
                for output in self.engine.step():
                    unit = inflight.pop(output.request_id)
                    yield unit, outcome_from_output(output, SamplingParams.from_dict(unit.sampling))
        finally:
            for request_id in inflight:  # a consumer that stops early must not leave requests running
                self.engine.abort_request(request_id)

    def _add(self, request_id: str, unit: Unit) -> Outcome | None:
        try:
            params = SamplingParams.from_dict(unit.sampling)
            prompt = unit.prompt if unit.messages is None else self.engine.apply_chat_template(unit.messages)
            if unit.embed is not None:
                from tokenmill.engine.pooling import PoolingParams  # torch: only where the engine runs here

                self.engine.add_request(request_id, prompt, pooling=PoolingParams(**unit.embed))
            elif unit.score is not None:
                self.engine.add_score_request(request_id, prompt, unit.score)
            else:
                self.engine.add_request(request_id, prompt, params)
        except InvalidRequestError as exc:
            return Outcome.failed(error_text("invalid_request", exc.message, exc.field))
        except Exception as exc:  # e.g. the chat template cannot render these messages: this unit only
            field = "prompt" if unit.messages is None else "messages"
            return Outcome.failed(error_text("invalid_request", f"{type(exc).__name__}: {exc}", field))
        return None

    def prefix_hit_rate(self) -> float | None:
        stats = self.engine.stats()
        hits, prompt = stats.num_prefix_hit_tokens - self._before[0], stats.num_prompt_tokens - self._before[1]
        return hits / prompt if prompt else None


def error_text(code: str, message: str, field: str | None) -> str:
    """A row's error column: the same text whichever mode computed it (a rerun in the other mode matches)."""
    return f"{code}: {message}" + (f" (field: {field})" if field else "")


def error_parts(text: str) -> tuple[str, str, str | None]:
    """`error_text`'s (code, message, field) again; a text without a code is a `server_error`."""
    code, colon, message = text.partition(": ")
    if not colon:
        return "server_error", text, None
    field = _FIELD.search(message)
    return (code, message[: field.start()], field[1]) if field else (code, message, None)


def outcome_from_output(output: Any, params: SamplingParams) -> Outcome:
    """An engine `RequestOutput` of a request with `params` as an `Outcome`; a constrained completion that is not what
    its constraint asked for keeps its text but carries the error a worker's result would (`constraint_problem`)."""
    if output.finish_reason == "error":
        return Outcome.failed(f"invalid_request: {output.error}")
    parsed = getattr(output, "parsed", None)  # set by structured outputs
    problem = constraint_problem(params, output.finish_reason, output.constraint_satisfied, output.constraint_error)
    return Outcome(
        error=None if problem is None else error_text(*problem),
        text=output.text,
        parsed=None if parsed is None else json.dumps(parsed, ensure_ascii=False),
        finish_reason=output.finish_reason,
        prompt_tokens=len(output.prompt_token_ids),
        completion_tokens=len(output.token_ids),
        logprobs=None if output.logprobs is None else json.dumps(output.logprobs),
        created=int(output.finished_time or time.time()),
        choice_probabilities=_json(getattr(output, "choice_probabilities", None)),
        embedding=_json(getattr(output, "embedding", None)),
        scores=_json(score_fields(output)),
    )


def score_fields(output: Any) -> list[dict[str, Any]] | None:
    """A score request's `RequestOutput.scores` as a result carries them (`ContinuationScore`'s fields); None for
    any other request (a `choice_probabilities` one's scores are its choices', internal)."""
    if getattr(output, "scores", None) is None or getattr(output, "choice_probabilities", None) is not None:
        return None
    return [{"logprob": s.logprob, "is_greedy": s.is_greedy, "num_tokens": len(s.token_ids)} for s in output.scores]


def outcome_from_result(result: Any) -> Outcome:
    """A worker's `JobResult` as an `Outcome` (a constrained completion that failed its constraint keeps its text)."""
    error = result.error
    if not result.ok and (error is None or error.code not in CONSTRAINT_CODES):
        return Outcome.failed(error_text(error.code, error.message, error.field) if error else "failed")
    parsed = getattr(result, "parsed", None)
    usage = result.usage
    return Outcome(
        error=None if result.ok else error_text(error.code, error.message, error.field),
        text=result.text,
        parsed=None if parsed is None else json.dumps(parsed, ensure_ascii=False),
        finish_reason=result.finish_reason,
        prompt_tokens=usage.prompt_tokens if usage else 0,
        completion_tokens=usage.completion_tokens if usage else 0,
        logprobs=None if result.logprobs is None else json.dumps(result.logprobs),
        created=int(result.finished_at or time.time()),
        choice_probabilities=_json(getattr(result, "choice_probabilities", None)),
        embedding=_json(getattr(result, "embedding", None)),
        scores=None if getattr(result, "scores", None) is None else _json([s.model_dump() for s in result.scores]),
    )


def _json(value: Any) -> str | None:
    return None if value is None else json.dumps(value, ensure_ascii=False)


class QueueRunner:
    """Units become jobs of `tokenmill.generate_batch` messages (`rows_per_message` jobs each).

    A job keeps its own id and its own result, so idempotency and exactly-one-result hold per row, while the
    broker, Celery and the worker's Python pay their per-message cost once per group. Each group is published
    as soon as it is full, so workers start on the first rows while later ones are still being read and
    rendered. Two waves of `window / 2` units are in flight: workers compute one while this side collects
    the other.
    """

    def __init__(self, client: Any, window: int = 4096, rows_per_message: int = 32, run_id: str | None = None,
                 detach: bool = False) -> None:
        self.client = client
        self.wave = max(1, window // 2)
        self.rows_per_message = rows_per_message
        #: Every job this run queues is listed under it (`tokenmill cancel --run RUN_ID`).
        self.run_id = run_id or uuid.uuid4().hex[:12]
        self.detach = detach
        self.waves: deque[dict[str, Unit]] = deque()  # submitted, results not yet collected


    def check(self, sampling: dict[str, Any]) -> None:
        """Nothing to check here: the workers' engine, whose tokenizer this side lacks, refuses per row."""
    def run(self, units: Iterable[Unit]) -> Iterator[tuple[Unit, Outcome]]:
        pending = iter(units)
        while True:
            submitted: dict[str, Unit] = {}
            self.waves.append(submitted)  # in flight from the first unit on: a Ctrl-C while publishing cancels it
            refused, taken = self.submit(itertools.islice(pending, self.wave), submitted)
            yield from refused
            if not submitted:
                self.waves.pop()
            exhausted = taken < self.wave
            if self.waves and (len(self.waves) >= 2 or exhausted):
                yield from self._collect(self.waves[0])
                self.waves.popleft()
            if exhausted and not self.waves:
                return

    def interrupted(self) -> Iterator[tuple[Unit, Outcome]]:
        """Ctrl-C: cancel the jobs in flight (unless `detach`, or the user answers no), then collect their
        results, `cancelled` or finished meanwhile, so the checkpoint knows them (`--retry-cancelled`)."""
        in_flight = {job_id: unit for wave in self.waves for job_id, unit in wave.items()}
        if not in_flight:
            return
        if self.detach or not _confirm(f"\ncancel the {len(in_flight)} jobs this run has in flight? [Y/n] "):
            print(f"left running; stop them with: tokenmill cancel --run {self.run_id}", file=sys.stderr)
            return
        outcomes = self.client.cancel(list(in_flight))
        print(f"cancelled {sum(o != 'finished' for o in outcomes.values())} jobs of run {self.run_id}", file=sys.stderr)
        try:
            for result in self.client.as_completed(list(in_flight), timeout=_DRAIN_TIMEOUT):
                yield in_flight[result.id], outcome_from_result(result)
        except TimeoutError:
            pass  # a worker that died holding some: their rows run again on resume

    def submit(self, units: Iterable[Unit],
               submitted: dict[str, Unit] | None = None) -> tuple[list[tuple[Unit, Outcome]], int]:
        """Validate each unit as a `Job` (refusals come back, not sent) and publish every full group at once;
        adds the submitted units to `submitted` by job id, returns the refused ones and how many were taken."""
        submitted = {} if submitted is None else submitted
        refused: list[tuple[Unit, Outcome]] = []
        group: list[dict[str, Any]] = []
        taken = 0
        for unit in units:
            taken += 1
            # the label names the row in the workers' logs: cut, so that no user string is copied whole into every job
            fields = {"id": unit.job_id, "sampling": unit.sampling, "metadata": {"row": unit.label[:LABEL_CHARS]}}
            fields.update({"messages": unit.messages} if unit.messages is not None else {"prompt": unit.prompt})
            if unit.embed is not None or unit.score is not None:  # an embedding or score job: no sampling
                fields.update({"embed": unit.embed} if unit.embed is not None else {"score": {"continuations": unit.score}},
                              sampling={})
                if isinstance(unit.prompt, list):  # token ids as such
                    fields["prompt_token_ids"] = fields.pop("prompt")
            try:
                group.append(self.client.prepare(fields))
                submitted[unit.job_id] = unit
            except InvalidRequestError as exc:
                refused.append((unit, Outcome.failed(f"invalid_job: {exc}")))
            if len(group) == self.rows_per_message:
                self._publish(group)
                group = []
        if group:
            self._publish(group)
        return refused, taken

    def _publish(self, group: list[dict[str, Any]]) -> None:
        from tokenmill.queue.names import BATCH_TASK_NAME, JOBS_HEADER, RUN_JOBS_KEY
        from tokenmill.queue.schemas import free_form, message_wire

        run_key = RUN_JOBS_KEY.format(run_id=self.run_id)  # listed before it is queued: a cancel finds every job
        self.client.app.backend.client.pipeline().sadd(run_key, *(job["id"] for job in group)).expire(
            run_key, int(self.client.settings.result_expires)).execute()
        # ignore_result: each job's result is stored under its own id; the group's own would be a wasted key
        self.client.publisher.publish(BATCH_TASK_NAME, uuid.uuid4().hex, [{"jobs": [message_wire(job) for job in group]}],
                                      f"[<{len(group)} jobs>]", {JOBS_HEADER: len(group)},
                                      free_form=tuple(part for job in group for part in free_form(job)), ignore_result=True)

    def _collect(self, submitted: dict[str, Unit]) -> Iterator[tuple[Unit, Outcome]]:
        """Each unit's outcome as its result arrives; a collected unit leaves `submitted` (no longer in flight)."""
        for result in self.client.as_completed(list(submitted)):
            yield submitted.pop(result.id), outcome_from_result(result)

    def prefix_hit_rate(self) -> float | None:
        return None  # the workers' engines know it (their metrics endpoint), not this process


def _confirm(question: str) -> bool:
    """Yes unless someone at a terminal answers no (default yes; no terminal: yes)."""
    if not sys.stdin.isatty():
        return True
    try:
        return input(question).strip().lower() not in ("n", "no")
    except (EOFError, KeyboardInterrupt):
        return True


def sampling_dict(values: dict[str, Any]) -> dict[str, Any]:
    """All sampling fields with defaults filled in, checked by `SamplingParams` itself: the canonical form
    hashed into keys (so `max_tokens=16` and leaving the default give the same key)."""
    return SamplingParams.from_dict(values).to_dict()
