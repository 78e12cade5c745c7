"""Job and JobResult: the wire format, and bad input named by field."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tokenmill.errors import InvalidRequestError
from tokenmill.queue.schemas import SCHEMA_VERSION, Job, JobResult, S3Location
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
