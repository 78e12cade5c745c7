"""Job and JobResult: the wire format, and bad input named by field."""

from __future__ import annotations

import json

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from tokenmill.errors import InvalidRequestError
from tokenmill.queue.schemas import SCHEMA_VERSION, Job, JobResult, S3Location, job_payload
from tokenmill.sampling_params import SamplingParams


def test_flat_and_nested_sampling_give_the_same_job() -> None:
    flat = Job.from_wire({"id": "a", "prompt": "hi", "max_tokens": 7, "temperature": 0.0})
    nested = Job.from_wire({"id": "a", "prompt": "hi", "sampling": {"max_tokens": 7, "temperature": 0.0}})
    assert flat == nested
    assert flat.sampling == SamplingParams(max_tokens=7, temperature=0.0)


def test_wire_round_trip_is_plain_json_and_versioned() -> None:
    job = Job.from_wire({"prompt_token_ids": [1, 2, 3], "seed": 5, "stop": ["x"], "output": "s3://bucket/a/b", "metadata": {"k": [1]}})
    wire = json.loads(json.dumps(job.to_wire()))
    assert wire["version"] == SCHEMA_VERSION
    assert Job.from_wire(wire) == job


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({}, "prompt"),
        ({"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, "messages"),
        ({"prompt": "a", "prompt_token_ids": [1]}, "prompt_token_ids"),
        ({"prompt": ""}, "prompt"),
        ({"prompt": 5}, "prompt"),
        ({"prompt_token_ids": []}, "prompt_token_ids"),
        ({"prompt_token_ids": [1, -2]}, "prompt_token_ids[1]"),
        ({"prompt_token_ids": [1, True]}, "prompt_token_ids[1]"),
        ({"messages": [{"role": "user"}]}, "messages[0].content"),
        ({"prompt": "a", "max_tokens": 0}, "max_tokens"),
        ({"prompt": "a", "temperature": float("nan")}, "temperature"),
        ({"prompt": "a", "top_p": 1.5}, "top_p"),
        ({"prompt": "a", "sampling": {"top_k": "3"}}, "top_k"),
        ({"prompt": "a", "sampling": {"bogus": 1}}, "bogus"),
        ({"prompt": "a", "bogus": 1}, "bogus"),
        ({"prompt": "a", "output": "http://bucket/x"}, "output"),
        ({"prompt": "a", "output": "s3://UPPER/x"}, "output"),
        ({"prompt": "a", "id": "has space"}, "id"),
        ({"prompt": "a", "version": 99}, "version"),
    ],
)
def test_bad_job_names_the_field(fields: dict, field: str) -> None:
    with pytest.raises(InvalidRequestError) as caught:
        Job.from_wire(fields)
    assert caught.value.field == field


@pytest.mark.parametrize(
    ("args", "fields", "payload", "rest"),
    [
        (({"prompt": "hi"},), {}, {"prompt": "hi"}, {}),  # the client's way: one positional job
        ((), {"job": {"prompt": "hi"}, "max_tokens": 3}, {"prompt": "hi"}, {"max_tokens": 3}),  # `job=`, fields beside it
        ((), {"prompt": "hi"}, {}, {"prompt": "hi"}),  # keyword fields only
        ((None,), {}, {}, {}),
    ],
)
def test_job_payload_reads_each_way_a_producer_may_send_a_job(args: tuple, fields: dict, payload: dict, rest: dict) -> None:
    fields = dict(fields)
    assert job_payload(args, fields) == payload
    assert fields == rest  # `job` popped, the other fields left for the job


@pytest.mark.parametrize(
    ("args", "fields", "message"),
    [
        (({"prompt": "a"}, {"prompt": "b"}), {}, "expected one job object, got 2"),
        (({"prompt": "a"},), {"job": {"prompt": "b"}}, "expected one job object, got 2"),
        (("hi",), {}, "must be an object of job fields, got str"),
    ],
)
def test_job_payload_refuses_a_call_that_is_not_one_job_object(args: tuple, fields: dict, message: str) -> None:
    with pytest.raises(InvalidRequestError) as raised:
        job_payload(args, dict(fields))
    assert raised.value.field == "job" and message in raised.value.message


def test_s3_location_key_and_uri() -> None:
    assert S3Location.parse("s3://my-bucket/runs/7/").uri_for("job1") == "s3://my-bucket/runs/7/job1.json"
    assert S3Location.parse("s3://my-bucket").key_for("job1") == "job1.json"


def test_result_stub_drops_payload_keeps_the_rest() -> None:
    result = JobResult(id="j", status="succeeded", text="long text", token_ids=[1, 2], finish_reason="stop", attempt=1)
    stub = result.stub("s3://b/j.json")
    assert (stub.text, stub.token_ids, stub.output_uri) == (None, None, "s3://b/j.json")
    assert (stub.status, stub.finish_reason, stub.attempt) == ("succeeded", "stop", 1)


@given(st.text(min_size=1, max_size=200), st.integers(1, 4096), st.floats(0, 5), st.integers(0, 2**31))
def test_any_valid_job_survives_the_wire(prompt: str, max_tokens: int, temperature: float, seed: int) -> None:
    job = Job.from_wire({"prompt": prompt, "max_tokens": max_tokens, "temperature": temperature, "seed": seed})
    assert Job.from_wire(json.loads(json.dumps(job.to_wire()))) == job


def _shortest_json(value: object) -> str:
    """`value` as the shortest JSON a producer could send: raw UTF-8, no spaces, floats in whichever of their
    round-tripping forms is shortest (`1e15`, not `1000000000000000.0`)."""
    if isinstance(value, float):
        forms = [repr(value)] + [f"{value:.{digits}e}" for digits in range(17)]
        return min((f for f in forms if float(f) == value), key=len).replace("e+", "e").replace("e0", "e")
    if isinstance(value, list):
        return "[" + ",".join(_shortest_json(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ",".join(json.dumps(k, ensure_ascii=False) + ":" + _shortest_json(v) for k, v in value.items()) + "}"
    return json.dumps(value, ensure_ascii=False)


_json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12)


@given(st.dictionaries(st.text(max_size=8), _json_values, max_size=5))
@example({"k": "\x7f" * 200})  # DEL, sent raw, comes back as \u007f: 6x
@example({"k": [1e15, -5e15, 1e-7]})
def test_a_job_reencoded_is_at_most_reencoded_growth_times_its_source(wire: dict) -> None:
    """The bound behind `check_size(..., source=)`'s shortcut: whatever text a producer sent, the encoding
    `check_size` measures is at most `REENCODED_GROWTH` times as long."""
    from tokenmill.queue.schemas import REENCODED_GROWTH

    source = _shortest_json(wire).encode()
    assert json.loads(source) == wire
    measured = len(json.dumps(json.loads(source), separators=(",", ":"), default=str).encode())
    assert measured <= REENCODED_GROWTH * max(len(source), 1)


def test_check_size_with_a_source_still_refuses_what_it_must() -> None:
    from tokenmill.queue.schemas import check_size
    from tokenmill.sampling_params import MAX_NESTING

    small = {"prompt": "hi", "metadata": {"a": [1, 2]}}
    source = json.dumps(small).encode()
    check_size(small, 1 << 20, source)  # small and shallow: passes without being encoded
    deep: object = 1
    for _ in range(MAX_NESTING + 1):
        deep = [deep]
    nested = {"prompt": "hi", "metadata": {"a": deep}}
    with pytest.raises(InvalidRequestError) as caught:  # too many brackets for the shortcut
        check_size(nested, 1 << 20, json.dumps(nested).encode())
    assert caught.value.field == "metadata"
    big = {"prompt": "x" * 5000}
    with pytest.raises(InvalidRequestError) as caught:  # too long for the shortcut: measured, refused
        check_size(big, 4096, json.dumps(big).encode())
    assert caught.value.field == "prompt"


@given(st.fixed_dictionaries({}, optional={
    "max_tokens": st.integers(1, 4096), "temperature": st.sampled_from([0, 0.0, 0.7, 1, 1.0]),
    "top_k": st.sampled_from([-1, 0, 5]), "min_p": st.sampled_from([0, 0.0, 0.1]), "seed": st.none() | st.integers(0, 9),
    "stop": st.sampled_from([[], ["x"]]), "ignore_eos": st.booleans(), "json_object": st.booleans(),
    "logprobs": st.none() | st.integers(0, 3)}), st.sampled_from([{}, {"row": 1}]))
def test_a_jobs_message_holds_what_is_not_a_default_and_parses_to_the_same_job(sampling: dict, metadata: dict) -> None:
    """What a job's message carries (`message_wire`) gives a worker the same job, and so the same content hash; a
    sampling value is left out only where it is its field's default, of its type."""
    from tokenmill.queue.schemas import content_hash, message_wire

    job = Job.from_wire({"id": "j-1", "prompt": "hi", "sampling": sampling, "metadata": metadata})
    wire = job.to_wire()
    sent = json.loads(json.dumps(message_wire(wire)))
    assert Job.from_wire(sent) == job
    assert Job.from_wire(sent).content_hash() == content_hash(wire) == job.content_hash()
    defaults = SamplingParams().to_dict()
    assert sent["sampling"] == {name: value for name, value in wire["sampling"].items()
                                if type(value) is not type(defaults[name]) or value != defaults[name]}
    assert SamplingParams.from_dict(sent["sampling"]) == job.sampling  # as the engine process gets a request's too
    assert {**sent, "sampling": None} == {**wire, "sampling": None}  # only sampling values are left out


def test_a_default_jobs_message_has_no_sampling_values() -> None:
    from tokenmill.queue.schemas import message_wire

    assert message_wire(Job.from_wire({"prompt": "hi"}).to_wire())["sampling"] == {}
    assert message_wire(Job.from_wire({"prompt": "hi", "temperature": 0}).to_wire())["sampling"] == {"temperature": 0.0}


def test_an_embedding_job_is_checked_and_survives_the_wire() -> None:
    """`embed`: its options checked here, torch-free, named by field (the engine's pooling modes, a positive
    `dimensions`, a boolean `normalize`); a sampling parameter beside it refused; its message and content hash carry
    it (the same prompt as a completion is another job); a result's `embedding` is dropped from its S3 stub."""
    from typing import get_args

    from tokenmill.engine.pooling import POOLING_MODES
    from tokenmill.queue.schemas import PoolingMode, content_hash, message_wire

    assert get_args(PoolingMode) == POOLING_MODES
    job = Job.from_wire({"id": "e", "prompt": "hi", "embed": {"dimensions": 8, "pooling": "mean"}})
    assert job.embed.dimensions == 8 and job.embed.normalize is None
    assert Job.from_wire(json.loads(json.dumps(message_wire(job.to_wire())))) == job
    assert job.content_hash() != Job.from_wire({"id": "e", "prompt": "hi"}).content_hash()
    assert content_hash(Job.from_wire({"id": "e", "prompt": "hi", "embed": {}}).to_wire()) != job.content_hash()
    for embed, field in (({"dimensions": 0}, "embed.dimensions"), ({"dimensions": "8"}, "embed.dimensions"),
                         ({"pooling": "max"}, "embed.pooling"), ({"normalize": 1}, "embed.normalize"),
                         ({"x": 1}, "embed.x"), (True, "embed")):
        with pytest.raises(InvalidRequestError) as caught:
            Job.from_wire({"prompt": "hi", "embed": embed})
        assert caught.value.field == field
    for sampling in ({"max_tokens": 5}, {"sampling": {"temperature": 0.5}}):
        with pytest.raises(InvalidRequestError) as caught:
            Job.from_wire({"prompt": "hi", "embed": {}, **sampling})
        assert "embedding job" in caught.value.message
    result = JobResult(id="e", status="succeeded", text="", embedding=[0.5, -0.5])
    assert result.stub("s3://b/e.json").embedding is None


def test_a_score_job_is_checked_and_survives_the_wire() -> None:
    """`score`: its continuations checked here, torch-free, named by field (a non-empty list of non-empty strings or
    token id lists); a sampling parameter or `embed` beside it refused; its message and content hash carry it; a
    result's `scores` parse and are dropped from its S3 stub."""
    from tokenmill.queue.schemas import MAX_CONTINUATIONS, ContinuationScore, message_wire

    job = Job.from_wire({"id": "s", "prompt": "The capital of France is", "score": {"continuations": [" Paris", [5, 6]]}})
    assert job.score.continuations == [" Paris", [5, 6]]
    assert Job.from_wire(json.loads(json.dumps(message_wire(job.to_wire())))) == job
    assert job.content_hash() != Job.from_wire({"id": "s", "prompt": "The capital of France is"}).content_hash()
    for score, field in (({"continuations": []}, "score.continuations"), ({"continuations": [""]}, "score.continuations[0]"),
                         ({"continuations": [[]]}, "score.continuations[0]"),
                         ({"continuations": ["a", [-1]]}, "score.continuations[1]"),
                         ({"continuations": ["a"] * (MAX_CONTINUATIONS + 1)}, "score.continuations"),
                         ({"continuations": ["a"], "x": 1}, "score.x"), ({}, "score.continuations"), ([], "score")):
        with pytest.raises(InvalidRequestError) as caught:
            Job.from_wire({"prompt": "hi", "score": score})
        assert caught.value.field.startswith(field), (score, caught.value.field)
    for extra in ({"max_tokens": 5}, {"embed": {}}):
        with pytest.raises(InvalidRequestError) as caught:
            Job.from_wire({"prompt": "hi", "score": {"continuations": ["a"]}, **extra})
        assert caught.value.field == next(iter(extra)) if "max_tokens" in extra else caught.value.field == "score"
    scores = [ContinuationScore(logprob=-1.5, is_greedy=False, num_tokens=2)]
    result = JobResult.model_validate(JobResult(id="s", status="succeeded", text="", scores=scores).to_wire())
    assert result.scores == scores and result.stub("s3://b/s.json").scores is None
