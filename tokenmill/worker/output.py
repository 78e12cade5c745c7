"""A finished request, from the engine process to the job's wire result: one type, `EngineOutput`, whose fields named
as `JobResult`'s go into the result as they are.

`output_fields` (engine process) makes its pipe message; `result_wire` (worker) builds `JobResult.to_wire()` directly
as a dict, keys in the contract's order; tests/test_result_wire.py holds it to the validated dump.
See docs/internals/worker.md, section "The engine process"."""

from __future__ import annotations

import operator
import time
from dataclasses import dataclass
from dataclasses import fields as dataclass_fields
from typing import TYPE_CHECKING, Any

from tokenmill.queue.schemas import SCHEMA_VERSION, Job, JobResult
from tokenmill.sampling_params import constraint_problem

if TYPE_CHECKING:
    from tokenmill.engine.llm_engine import RequestOutput
    from tokenmill.worker.admission import Attempt


@dataclass
class EngineOutput:
    """A finished request as the worker receives it. Its fields that `JobResult` declares too (`RESULT_FIELDS`) are the
    result's own, taken as they are; the others make the result's usage and times."""

    request_id: str
    num_prompt_tokens: int
    token_ids: list[int]
    text: str
    finish_reason: str
    first_token_time: float | None
    finished_time: float
    logprobs: list[Any] | None = None
    parsed: Any = None
    constraint_satisfied: bool | None = None
    constraint_error: str | None = None
    constraint_backend: str | None = None
    choice_probabilities: dict[str, float] | None = None
    embedding: list[float] | None = None
    scores: list[dict[str, Any]] | None = None  # a score job's: {"logprob", "is_greedy", "num_tokens"} each


#: `EngineOutput`'s fields a job's result carries as they are, in `JobResult`'s order (one run of its fields, after
#: "status": tests/test_result_wire.py).
RESULT_FIELDS = tuple(name for name in JobResult.model_fields if name in {f.name for f in dataclass_fields(EngineOutput)})
_result_values = operator.attrgetter(*RESULT_FIELDS)
#: The result fields `RequestOutput` has in the same form, sent only when not None (most requests ask for none of them).
_SENT_IF_SET = tuple(name for name in RESULT_FIELDS if name not in ("token_ids", "text", "finish_reason", "scores"))


def output_fields(output: RequestOutput) -> dict[str, Any]:
    """A finished `RequestOutput` as `EngineOutput(**fields)` takes it; fields that default to None there are left out
    when None, for a smaller message."""
    fields = {
        "request_id": output.request_id,
        "num_prompt_tokens": len(output.prompt_token_ids),
        "token_ids": list(output.token_ids),
        "text": output.text,
        "finish_reason": output.finish_reason,
        "first_token_time": output.first_token_time,
        "finished_time": output.finished_time,
    }
    for name in _SENT_IF_SET:
        if (value := getattr(output, name)) is not None:
            fields[name] = value
    if output.scores is not None and output.choice_probabilities is None:  # a score request (choices' are internal)
        fields["scores"] = [{"logprob": score.logprob, "is_greedy": score.is_greedy, "num_tokens": len(score.token_ids)}
                            for score in output.scores]
    return fields


def result_wire(job: Job, run: Attempt, output: EngineOutput, worker: str) -> dict[str, Any]:
    """The `JobResult.to_wire()` of `run` (of `job`) ending with `output`, keys in the contract's order; no list shared
    with the job or the output."""
    status, error = _outcome(job, run, output)
    wire: dict[str, Any] = {"version": SCHEMA_VERSION, "id": job.id, "status": status}
    wire.update(zip(RESULT_FIELDS, _result_values(output)))
    wire["token_ids"] = list(output.token_ids)
    if job.sampling.logprobs is None:  # asked for none: the engine may have computed some for its own use
        wire["logprobs"] = None
    prompt_tokens, completion_tokens = output.num_prompt_tokens, len(output.token_ids)
    return {**wire, "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                              "total_tokens": prompt_tokens + completion_tokens},
            "queued_at": job.submitted_at, "started_at": run.started_at, "first_token_at": output.first_token_time,
            "finished_at": output.finished_time or time.time(), "output_uri": None, "error": error,
            "attempt": run.attempt, "worker": worker, "metadata": dict(job.metadata), "job_hash": run.job_hash}


def _outcome(job: Job, run: Attempt, output: EngineOutput) -> tuple[str, dict[str, Any] | None]:
    """(status, error): succeeded; for a job the engine stopped early `cancelled`, or failed `deadline_exceeded`; for
    a constrained one cut inside its constraint or failing its final check, failed (`constraint_problem`)."""
    if output.finish_reason == "cancelled":
        return "cancelled", {"code": "cancelled", "message": "cancelled while running", "field": None}
    if output.finish_reason == "deadline":
        limit = job.deadline_s or run.time_limit
        return "failed", {"code": "deadline_exceeded", "message": f"still running after its deadline of {limit:g}s",
                          "field": None}
    problem = constraint_problem(job.sampling, output.finish_reason, output.constraint_satisfied,
                                 output.constraint_error)
    return ("succeeded", None) if problem is None else ("failed", dict(zip(("code", "message", "field"), problem)))
