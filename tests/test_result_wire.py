"""The worker builds a job's result as a dict (`tokenmill.worker.output.result_wire`), not through pydantic: it must
be, key for key and in the same order, what validating it as a `JobResult` and dumping that gives, and its bytes for a
fixed job and output are pinned. And a content hash sent in a message's header is taken only in the form of one
(`is_content_hash`; the worker's use of it: tests/service)."""

from __future__ import annotations

import dataclasses
import json
from types import SimpleNamespace
from typing import Any

from hypothesis import assume, given, settings
from hypothesis import strategies as st

from tokenmill.queue import fastjson
from tokenmill.queue.schemas import Job, JobResult, content_hash, is_content_hash
from tokenmill.worker.admission import Attempt
from tokenmill.worker.output import RESULT_FIELDS, EngineOutput, output_fields, result_wire

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**63) | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=8,
)
times = st.none() | st.floats(1e9, 2e9)


@st.composite
def outputs(draw: Any) -> EngineOutput:
    tokens = draw(st.lists(st.integers(0, 50_000), max_size=5))
    return EngineOutput(
        request_id="r1",
        num_prompt_tokens=draw(st.integers(0, 4096)),
        token_ids=tokens,
        text=draw(st.text(max_size=12)),
        finish_reason=draw(st.sampled_from(["stop", "length", "cancelled", "deadline"])),
        logprobs=draw(st.none() | st.lists(st.dictionaries(st.text(max_size=4), st.floats(-50, 0), max_size=2), max_size=3)),
        first_token_time=draw(times),
        finished_time=draw(st.sampled_from([0.0, 1.7e9])),
        parsed=draw(json_values),
        constraint_satisfied=draw(st.none() | st.booleans()),
        constraint_error=draw(st.none() | st.text(max_size=8)),
        constraint_backend=draw(st.none() | st.sampled_from(["xgrammar", "llguidance"])),
        choice_probabilities=draw(st.none() | st.dictionaries(st.text(min_size=1, max_size=6), st.floats(0, 1),
                                                              min_size=1, max_size=3)),
        embedding=draw(st.none() | st.lists(st.floats(-1, 1, width=32), min_size=1, max_size=4)),
    )


@st.composite
def attempts(draw: Any) -> Attempt:
    fields: dict[str, Any] = {"prompt": "hi", "max_tokens": 4}
    if draw(st.booleans()):
        fields["logprobs"] = draw(st.integers(0, 5))
    if draw(st.booleans()):
        fields["deadline_s"] = draw(st.floats(0.1, 100))
    if draw(st.booleans()):
        fields["submitted_at"] = draw(st.floats(1e9, 2e9))
    fields["metadata"] = draw(st.dictionaries(st.text(max_size=4), json_values, max_size=3))
    job = Job.from_wire(fields)
    time_limit = draw(st.none() | st.floats(0.5, 60))
    return Attempt(job, draw(st.floats(1e9, 2e9)), draw(st.integers(0, 9)), time_limit,
                   job_hash=draw(st.sampled_from(["", "a" * 64])))


@settings(max_examples=300, deadline=None)
@given(attempts(), outputs(), st.text(min_size=1, max_size=12))
def test_result_wire_is_the_validated_results_dump(run: Attempt, output: EngineOutput, worker: str) -> None:
    assume(output.finish_reason != "deadline" or run.deadline is not None)  # the engine stops only what has one
    wire = result_wire(run.job, run, output, worker)
    dumped = JobResult.model_validate(wire).to_wire()
    assert wire == dumped
    assert list(wire) == list(dumped)  # the stored JSON is the same to the byte
    # a constrained output cut inside its constraint, or failing its final check, fails (`constraint_problem`)
    cut = "failed" if output.constraint_satisfied is False else "succeeded"
    assert wire["status"] == {"cancelled": "cancelled", "deadline": "failed"}.get(output.finish_reason, cut)
    assert wire["job_hash"] == run.job_hash and is_content_hash(run.job_hash)
    if run.job.sampling.logprobs is None:
        assert wire["logprobs"] is None


@given(outputs())
@settings(max_examples=200, deadline=None)
def test_an_output_crosses_the_engine_pipe_whole(output: EngineOutput) -> None:
    """The engine process leaves None fields out of an output's message (`output_fields`); the worker's
    `EngineOutput` is the same as with every field sent (fails if a None field is dropped that has no default)."""
    fields = dataclasses.asdict(output)
    fields["prompt_token_ids"] = [0] * fields.pop("num_prompt_tokens")
    sent = output_fields(SimpleNamespace(**fields))
    assert EngineOutput(**fastjson.plain_loads(fastjson.dumps(sent, output.logprobs, output.parsed))) == output
    assert all(value is not None for name, value in sent.items() if name in ("logprobs", "parsed"))


def test_the_outputs_result_fields_are_one_run_of_the_contracts() -> None:
    """`EngineOutput`'s fields are the result's own (`RESULT_FIELDS`, one run right after "status", so the wire keeps
    the contract's order) or the four the worker makes usage and times of: a new field must be one or the other."""
    names = list(JobResult.model_fields)
    start = names.index("status") + 1
    assert RESULT_FIELDS == tuple(names[start:start + len(RESULT_FIELDS)])
    own = {field.name for field in dataclasses.fields(EngineOutput)} - set(RESULT_FIELDS)
    assert own == {"request_id", "num_prompt_tokens", "first_token_time", "finished_time"}


def test_result_wire_does_not_share_the_jobs_lists() -> None:
    job = Job.from_wire({"prompt": "hi", "metadata": {"k": 1}})
    output = EngineOutput("r1", 3, [1, 2], "ab", "stop", first_token_time=1.0, finished_time=2.0)
    wire = result_wire(job, Attempt(job, 1.0, 1), output, "w")
    wire["metadata"]["k"] = 2
    wire["token_ids"].append(3)
    assert job.metadata == {"k": 1} and output.token_ids == [1, 2]


def test_content_hash_form() -> None:
    job = Job.from_wire({"prompt": "hi"})
    assert is_content_hash(job.content_hash()) and job.content_hash() == content_hash(job.to_wire())
    for value in (None, 1, "", "A" * 64, "a" * 63, "a" * 65, "g" * 64, "a" * 64 + "\n", b"a" * 64):
        assert not is_content_hash(value), value


def test_a_choice_cut_by_max_tokens_fails_its_job_with_the_text_kept() -> None:
    job = Job.from_wire({"prompt": "hi", "max_tokens": 4, "choice": ["positive", "negative"]})
    run = Attempt(job, 1.7e9, 1)
    cut = EngineOutput(request_id="r1", num_prompt_tokens=2, token_ids=[110, 101, 103, 97], text="nega",
                       finish_reason="length", first_token_time=None, finished_time=1.7e9, constraint_satisfied=False)
    wire = result_wire(job, run, cut, "w1")
    assert wire["status"] == "failed" and wire["text"] == "nega" and wire["token_ids"] == [110, 101, 103, 97]
    assert wire["error"] == {"code": "constraint_incomplete", "message": "max_tokens 4 reached inside the choice",
                             "field": "max_tokens"}
    assert JobResult.model_validate(wire).to_wire() == wire
    whole = dataclasses.replace(cut, text="negative", finish_reason="stop", constraint_satisfied=True)
    assert result_wire(job, run, whole, "w1")["status"] == "succeeded"


def test_a_score_job_s_wire_is_its_validated_dump() -> None:
    """A score job's result (`scores`, each {"logprob", "is_greedy", "num_tokens"}) in the order `JobResult` dumps."""
    job = Job.from_wire({"prompt": "hi", "score": {"continuations": [" a", [3, 4]]}})
    scores = [{"logprob": -1.25, "is_greedy": True, "num_tokens": 1}, {"logprob": -7.5, "is_greedy": False, "num_tokens": 2}]
    output = EngineOutput("r1", 3, [], "", "stop", first_token_time=1.0, finished_time=2.0, scores=scores)
    wire = result_wire(job, Attempt(job, 1.0, 1), output, "w")
    dumped = JobResult.model_validate(wire).to_wire()
    assert wire == dumped and list(wire) == list(dumped) and wire["scores"] == scores


PINNED = [
    ('{"version":1,"id":"j1","status":"succeeded","text":"ab","token_ids":[7,8],"finish_reason":"length",'
     '"logprobs":[{"7":-0.5},{"8":-1.0}],"parsed":null,"constraint_satisfied":null,"constraint_error":null,'
     '"constraint_backend":null,"choice_probabilities":null,"embedding":null,"scores":null,'
     '"usage":{"prompt_tokens":3,"completion_tokens":2,"total_tokens":5},"queued_at":1.5,"started_at":2.0,'
     '"first_token_at":2.25,"finished_at":2.5,"output_uri":null,"error":null,"attempt":3,"worker":"w1",'
     '"metadata":{"k":[1]},"job_hash":"' + "a" * 64 + '"}'),
    ('{"version":1,"id":"j3","status":"failed","text":"y","token_ids":[1],"finish_reason":"length","logprobs":null,'
     '"parsed":null,"constraint_satisfied":false,"constraint_error":null,"constraint_backend":"xgrammar",'
     '"choice_probabilities":{"yes":0.75,"no":0.25},"embedding":null,"scores":null,'
     '"usage":{"prompt_tokens":2,"completion_tokens":1,"total_tokens":3},"queued_at":null,"started_at":2.0,'
     '"first_token_at":2.1,"finished_at":2.2,"output_uri":null,'
     '"error":{"code":"constraint_incomplete","message":"max_tokens 4 reached inside the choice","field":"max_tokens"},'
     '"attempt":2,"worker":"w1","metadata":{},"job_hash":"' + "c" * 64 + '"}'),
]


def test_the_wire_is_pinned() -> None:
    """A succeeded and a failed result, to the byte: fails on any change of a key, its place or its value."""
    job = Job.from_wire({"id": "j1", "prompt": "hi", "max_tokens": 4, "logprobs": 1, "submitted_at": 1.5,
                         "metadata": {"k": [1]}})
    output = EngineOutput("j1#0", 3, [7, 8], "ab", "length", first_token_time=2.25, finished_time=2.5,
                          logprobs=[{"7": -0.5}, {"8": -1.0}])
    succeeded = result_wire(job, Attempt(job, 2.0, 3, job_hash="a" * 64), output, "w1")
    job = Job.from_wire({"id": "j3", "prompt": "hi", "choice": ["yes", "no"]})
    output = EngineOutput("j3#2", 2, [1], "y", "length", 2.1, 2.2, constraint_satisfied=False,
                          constraint_backend="xgrammar", choice_probabilities={"yes": 0.75, "no": 0.25})
    failed = result_wire(job, Attempt(job, 2.0, 2, job_hash="c" * 64), output, "w1")
    assert [json.dumps(wire, separators=(",", ":")) for wire in (succeeded, failed)] == PINNED
