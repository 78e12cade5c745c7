"""`tokenmill batch`: OpenAI Batch API files, checked with the official `openai` SDK's response types."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from annotate_helpers import ENGINE, read_jsonl, write_jsonl
from hypothesis import given, settings
from hypothesis import strategies as st
from openai.types import Completion
from openai.types.chat import ChatCompletion

from tokenmill.apps.batch import BODY_FIELDS, URLS, LineError, Parser, batch
from tokenmill.errors import InvalidRequestError
from tokenmill.sampling_params import SamplingParams

STRUCTURED = "json_schema" in {f.name for f in dataclasses.fields(SamplingParams)}


@pytest.fixture(scope="module")
def llm():
    import torch

    torch.set_num_threads(1)
    from tokenmill import LLM

    return LLM("builtin:tiny", **ENGINE)


def chat(custom_id: str, content: str, **body) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": "tiny-chat", "messages": [{"role": "user", "content": content}], "max_tokens": 5, **body}}


def completion(custom_id: str, prompt: str, **body) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/completions",
            "body": {"model": "tiny-text", "prompt": prompt, "max_tokens": 5, **body}}


def run(llm, src: Path, out: Path, **kw):
    return batch(str(src), str(out), llm=llm, quiet=True, **kw)


def test_results_load_with_the_openai_sdk_types(llm, tmp_path: Path) -> None:
    requests = [
        chat("c1", "hello", temperature=0),
        completion("t1", "Once upon", temperature=0, logprobs=2, stop=["\n"]),
        chat("c2", "sample twice", n=2, seed=7, temperature=0.8, top_p=0.9, logprobs=True, top_logprobs=2),
        chat("c3", "hello", temperature=0, max_completion_tokens=5, max_tokens=None),
    ]
    src = write_jsonl(tmp_path / "in.jsonl", requests)
    summary = run(llm, src, tmp_path / "out.jsonl")
    assert (summary.rows, summary.ok, summary.failed) == (4, 4, 0)
    lines = read_jsonl(tmp_path / "out.jsonl")
    assert [line["custom_id"] for line in lines] == ["c1", "t1", "c2", "c3"]
    assert read_jsonl(tmp_path / "out.errors.jsonl") == []
    for line in lines:
        assert line["error"] is None and line["response"]["status_code"] == 200 and line["response"]["request_id"]
    c1 = ChatCompletion.model_validate(lines[0]["response"]["body"])
    expected = llm.chat([{"role": "user", "content": "hello"}], SamplingParams(max_tokens=5, temperature=0.0), use_tqdm=False)[0]
    assert c1.object == "chat.completion" and c1.model == "tiny-chat"
    assert c1.choices[0].message.content == expected.text and c1.choices[0].message.role == "assistant"
    assert c1.choices[0].finish_reason == expected.finish_reason
    assert c1.usage.prompt_tokens == len(expected.prompt_token_ids) and c1.usage.completion_tokens == len(expected.token_ids)
    t1 = Completion.model_validate(lines[1]["response"]["body"])
    assert t1.object == "text_completion" and len(t1.choices[0].logprobs.tokens) == t1.usage.completion_tokens
    assert all(len(top) <= 2 for top in t1.choices[0].logprobs.top_logprobs)
    c2 = ChatCompletion.model_validate(lines[2]["response"]["body"])
    assert [c.index for c in c2.choices] == [0, 1]
    assert c2.usage.completion_tokens == sum(len(c.logprobs.content) for c in c2.choices)
    assert all(len(t.top_logprobs) == 2 for c in c2.choices for t in c.logprobs.content)
    c3 = ChatCompletion.model_validate(lines[3]["response"]["body"])
    assert c3.choices[0].message.content == c1.choices[0].message.content
    assert summary.deduplicated == 1  # c3 asks exactly what c1 asks


def test_malformed_lines_and_unsupported_fields_are_error_lines(llm, tmp_path: Path) -> None:
    lines = [
        json.dumps(chat("ok", "fine")),
        "{not json",
        json.dumps({**chat("u", "x"), "url": "/v1/embeddings"}),
        json.dumps(chat("f", "x", frequency_penalty=0.5)),
        json.dumps({"method": "POST", "url": "/v1/completions", "body": {"prompt": "x"}}),
        json.dumps({**completion("m", "x"), "method": "GET"}),
        json.dumps(completion("long", "z" * 5000)),
        json.dumps(chat("bad", "x", temperature=-1)),
    ]
    src = write_jsonl(tmp_path / "in.jsonl", lines)
    summary = run(llm, src, tmp_path / "out.jsonl", errors=str(tmp_path / "errors.jsonl"))
    assert (summary.ok, summary.failed) == (1, 7)
    assert [line["custom_id"] for line in read_jsonl(tmp_path / "out.jsonl")] == ["ok"]
    errors = read_jsonl(tmp_path / "errors.jsonl")
    assert [e["custom_id"] for e in errors] == [None, "u", "f", None, "m", "long", "bad"]
    assert all(e["response"] is None and set(e["error"]) == {"code", "message"} for e in errors)
    messages = [e["error"]["message"] for e in errors]
    assert errors[0]["error"]["code"] == "invalid_json" and messages[0].startswith("line 2:")
    assert "url: unsupported '/v1/embeddings'" in messages[1]
    assert "body.frequency_penalty: unsupported field" in messages[2]
    assert "custom_id" in messages[3] and "method" in messages[4]
    assert errors[5]["error"]["code"] == "invalid_request" and "prompt" in messages[5]
    assert "body.temperature" in messages[6]


def test_deeply_nested_lines_and_schemas_fail_their_request_only(llm, tmp_path: Path) -> None:
    """A line nested past Python's recursion limit, or a response_format schema nested deeper than MAX_NESTING,
    used to raise RecursionError out of the whole run."""
    deep_schema: dict = {"type": "string"}
    for _ in range(300):
        deep_schema = {"type": "object", "properties": {"a": deep_schema}}
    response_format = {"type": "json_schema", "json_schema": {"name": "deep", "schema": deep_schema}}
    lines = [json.dumps(chat("ok", "fine")), '{"custom_id": "deep", "body": ' + "[" * 100_000 + "]" * 100_000 + "}",
             json.dumps(chat("schema", "x", response_format=response_format))]
    summary = run(llm, write_jsonl(tmp_path / "in.jsonl", lines), tmp_path / "out.jsonl")
    assert (summary.ok, summary.failed) == (1, 2)
    errors = read_jsonl(tmp_path / "out.errors.jsonl")
    assert [(e["custom_id"], e["error"]["code"]) for e in errors] == [(None, "invalid_json"), ("schema", "invalid_request")]
    assert "nests too deeply" in errors[0]["error"]["message"]
    assert "body.json_schema: nests deeper than 64" in errors[1]["error"]["message"]


def test_duplicate_custom_ids_refuse_the_file_with_line_numbers(llm, tmp_path: Path) -> None:
    src = write_jsonl(tmp_path / "in.jsonl", [chat("a", "1"), chat("b", "2"), chat("a", "3"), "", chat("b", "4")])
    with pytest.raises(InvalidRequestError, match=r"'a' on lines 1 and 3; 'b' on lines 2 and 5"):
        run(llm, src, tmp_path / "out.jsonl")
    assert not (tmp_path / "out.jsonl").exists()


def test_rerun_reuses_the_checkpoint_and_gives_the_same_file(llm, tmp_path: Path) -> None:
    src = write_jsonl(tmp_path / "in.jsonl", [chat(f"r{i}", f"row {i}", seed=i) for i in range(12)])
    first = run(llm, src, tmp_path / "out.jsonl")
    before = (tmp_path / "out.jsonl").read_text()
    again = run(llm, src, tmp_path / "out.jsonl")
    assert (first.computed, again.computed, again.reused) == (12, 0, 12)
    assert (tmp_path / "out.jsonl").read_text() == before


def test_response_format_json_schema(llm, tmp_path: Path) -> None:
    """Active once structured outputs are merged; before, the request is an error line naming the field."""
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    fmt = {"type": "json_schema", "json_schema": {"name": "r", "schema": schema, "strict": True}}
    src = write_jsonl(tmp_path / "in.jsonl", [chat("s", "answer", response_format=fmt, max_tokens=24)])
    run(llm, src, tmp_path / "out.jsonl")
    if not STRUCTURED:
        [error] = read_jsonl(tmp_path / "out.errors.jsonl")
        assert "json_schema" in error["error"]["message"]
        return
    [line] = read_jsonl(tmp_path / "out.jsonl")
    body = ChatCompletion.model_validate(line["response"]["body"])
    assert isinstance(json.loads(body.choices[0].message.content)["ok"], bool)


_ANY_JSON = st.recursive(st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=False)
                         | st.text(max_size=8),
                         lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
                         max_leaves=6)


@st.composite
def _request_lines(draw: st.DrawFn) -> bytes:
    """A request line whose url and body fields (any of `BODY_FIELDS`) hold any JSON value."""
    url = draw(st.sampled_from(sorted(URLS)) | _ANY_JSON)
    body: dict = {"messages": [{"role": "user", "content": "hi"}]} if url == "/v1/chat/completions" else {"prompt": "hi"}
    for name in draw(st.lists(st.sampled_from(sorted(BODY_FIELDS)), max_size=4, unique=True)):
        body[name] = draw(_ANY_JSON)
    return json.dumps({"custom_id": "a", "method": "POST", "url": url, "body": body}).encode()


@settings(max_examples=1000, deadline=None)
@given(_request_lines())
def test_a_line_of_any_values_is_a_request_or_a_line_error(raw: bytes) -> None:
    """Whatever values a line's fields hold, parsing it gives a request or that line's error, never an exception that
    would stop the whole batch (`"seed": "7"`, `"stop": 5` and `"url": ["x"]` did)."""
    try:
        Parser("m", 16, logprobs_ok=True).parse(raw)
    except LineError as exc:
        assert exc.code in ("invalid_request", "invalid_json") and exc.custom_id == "a"


def test_a_structured_output_cut_by_max_tokens_answers_as_openai_does(llm, tmp_path: Path) -> None:
    """OpenAI answers a response_format request cut by max_tokens with its partial content and finish_reason "length":
    a response line, not an error line (annotate fails such a row instead)."""
    schema = {"type": "json_schema", "json_schema": {"name": "x", "strict": True, "schema": {
        "type": "object", "properties": {"label": {"type": "string"}}, "required": ["label"],
        "additionalProperties": False}}}
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps(chat("cut", "label it", max_tokens=3, response_format=schema)) + "\n")
    summary = run(llm, src, tmp_path / "out.jsonl")
    (line,) = [json.loads(x) for x in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert summary.failed == 0 and line["error"] is None
    choice = line["response"]["body"]["choices"][0]
    assert choice["finish_reason"] == "length" and line["response"]["body"]["usage"]["completion_tokens"] == 3
