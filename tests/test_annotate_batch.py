"""`tokenmill batch`: OpenAI Batch API files, checked with the official `openai` SDK's response types."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from annotate_helpers import ENGINE, cli, read_jsonl, write_jsonl
from hypothesis import given, settings
from hypothesis import strategies as st
from openai.types import Completion
from openai.types.chat import ChatCompletion
from openai.types.shared import ErrorObject

from tokenmill.apps.batch import BODY_FIELDS, EMBEDDING_FIELDS, URLS, FileProblem, Parser, Refused, Request, batch
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


def own_text(tokenizer, token_id: int) -> tuple[str, list[int]]:
    """A builtin:tiny token's text (its decode alone) and its own bytes: ids below 256 are one byte each, so a byte of
    a UTF-8 character decodes to U+FFFD yet keeps its byte; the special tokens are their text; an id past the
    tokenizer's vocabulary (the model's is larger) is "" with no bytes."""
    text = tokenizer.decode([token_id])
    return text, [token_id] if token_id < 256 else list(text.encode())


def test_logprobs_give_each_token_s_text_and_own_bytes_in_openai_s_shapes(llm, tmp_path: Path) -> None:
    """Chat `logprobs: true` without and with `top_logprobs`, completions `logprobs: N`: the SDK's types parse them,
    and each token (chosen or alternative) is its text with its own bytes, those the engine generated."""
    requests = [chat("plain", "héllo", temperature=0, logprobs=True, max_tokens=8),
                chat("top", "héllo", temperature=0, logprobs=True, top_logprobs=3, max_tokens=8),
                completion("text", "Once upon", temperature=0, logprobs=2, max_tokens=8)]
    summary = run(llm, write_jsonl(tmp_path / "in.jsonl", requests), tmp_path / "out.jsonl")
    assert (summary.ok, summary.failed) == (3, 0)
    plain, top, text = read_jsonl(tmp_path / "out.jsonl")
    tokenizer = llm.tokenizer
    chat_out = llm.chat([{"role": "user", "content": "héllo"}], SamplingParams(max_tokens=8, temperature=0.0, logprobs=3),
                        use_tqdm=False)[0]
    plain_content = ChatCompletion.model_validate(plain["response"]["body"]).choices[0].logprobs.content
    top_content = ChatCompletion.model_validate(top["response"]["body"]).choices[0].logprobs.content
    assert [entry.top_logprobs for entry in plain_content] == [[]] * len(chat_out.token_ids)
    for entries in (plain_content, top_content):
        assert [(e.token, e.bytes) for e in entries] == [own_text(tokenizer, i) for i in chat_out.token_ids]
        assert [e.logprob for e in entries] == pytest.approx([p["logprob"] for p in chat_out.logprobs], abs=1e-4)
    assert any(b >= 0x80 for e in top_content for b in e.bytes)  # bytes of no whole character among them
    for entry, position in zip(top_content, chat_out.logprobs, strict=True):
        assert [(t.token, t.bytes) for t in entry.top_logprobs] == [own_text(tokenizer, i) for i, _ in position["top_logprobs"]]
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx([lp for _, lp in position["top_logprobs"]], abs=1e-4)

    text_out = llm.generate(["Once upon"], SamplingParams(max_tokens=8, temperature=0.0, logprobs=2), use_tqdm=False)[0]
    logprobs = Completion.model_validate(text["response"]["body"]).choices[0].logprobs
    tokens = [own_text(tokenizer, i)[0] for i in text_out.token_ids]
    assert logprobs.tokens == tokens
    assert logprobs.text_offset == [sum(map(len, tokens[:k])) for k in range(len(tokens))]
    assert logprobs.token_logprobs == pytest.approx([p["logprob"] for p in text_out.logprobs], abs=1e-4)
    for alternatives, position in zip(logprobs.top_logprobs, text_out.logprobs, strict=True):
        expected = {own_text(tokenizer, i)[0]: lp for i, lp in position["top_logprobs"]}
        assert alternatives == pytest.approx(expected, abs=1e-4)


def test_logprob_bytes_of_a_subword_vocabulary_spell_each_token(tmp_path: Path) -> None:
    """A byte-level BPE vocabulary of words (`Ġalpha`) and single bytes: each token's text is its own bytes, decoded."""
    from subword_model import build_subword_model_dir

    from tokenmill import LLM

    from tokenmill.engine.tiny import CHAT_TEMPLATE

    subword = LLM(str(build_subword_model_dir(tmp_path)), **ENGINE)
    subword.tokenizer.chat_template = CHAT_TEMPLATE
    lines = [chat("c", "alpha beta", temperature=1.0, seed=3, logprobs=True, top_logprobs=5, max_tokens=16)]
    run(subword, write_jsonl(tmp_path / "in.jsonl", lines), tmp_path / "out.jsonl")
    choice = ChatCompletion.model_validate(read_jsonl(tmp_path / "out.jsonl")[0]["response"]["body"]).choices[0]
    pairs = [(e.token, e.bytes) for e in choice.logprobs.content]
    pairs += [(t.token, t.bytes) for e in choice.logprobs.content for t in e.top_logprobs]
    assert any(len(token.strip()) > 1 for token, _ in pairs)  # tokens of several characters among them
    assert all(bytes(raw).decode("utf-8", "replace") == token for token, raw in pairs)


def refused(line: dict, message: str, param: str, status: int = 400, code: str = "invalid_request") -> dict:
    """The errors-file line of a request refused as given, as OpenAI's batch writes it (but its ids)."""
    return {"custom_id": line["custom_id"], "error": None, "response": {"status_code": status, "body": {"error": {
        "message": message, "type": "invalid_request_error", "param": param, "code": code}}}}


def without_ids(line: dict) -> dict:
    """An errors-file line without its `id` and `request_id` (checked apart: derived from the line)."""
    assert line["id"].startswith("batch_req_") and line["response"]["request_id"].startswith("req_")
    return {**{k: v for k, v in line.items() if k != "id"},
            "response": {k: v for k, v in line["response"].items() if k != "request_id"}}


def test_a_refused_body_is_its_request_s_400_line_and_the_other_requests_run(llm, tmp_path: Path) -> None:
    """As OpenAI's Batch API: a bad parameter value or an unknown parameter fails that request only, with the
    API's 400 error response in the errors file; the 28 other requests run, and their usage adds up."""
    lines = [chat(f"r{i}", f"question {i}", temperature=0) for i in range(30)]
    lines[7]["body"]["max_tokens"] = -1  # line 8
    lines[19]["body"]["tempreature"] = 0.5  # line 20: no such parameter
    src = write_jsonl(tmp_path / "in.jsonl", lines)
    summary = run(llm, src, tmp_path / "out.jsonl")
    assert (summary.rows, summary.ok, summary.failed) == (30, 28, 2)
    errors = read_jsonl(tmp_path / "out.errors.jsonl")
    assert [without_ids(e) for e in errors] == [
        refused(lines[7], "max_tokens: must be >= 1, got -1", "max_tokens"),
        refused(lines[19], "tempreature: unsupported field (supported: " + ", ".join(sorted(BODY_FIELDS)) + ")",
                "tempreature")]
    assert [ErrorObject.model_validate(e["response"]["body"]["error"]).param for e in errors] == ["max_tokens", "tempreature"]
    output = read_jsonl(tmp_path / "out.jsonl")
    ran = [line for i, line in enumerate(lines) if i not in (7, 19)]
    assert [line["custom_id"] for line in output] == [line["custom_id"] for line in ran]
    expected = llm.chat([line["body"]["messages"] for line in ran], SamplingParams(max_tokens=5, temperature=0.0),
                        use_tqdm=False)
    for line, want in zip(output, expected):
        assert line["error"] is None and line["response"]["status_code"] == 200
        usage = ChatCompletion.model_validate(line["response"]["body"]).usage
        assert (usage.prompt_tokens, usage.completion_tokens) == (len(want.prompt_token_ids), len(want.token_ids))
        assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens


def test_what_the_engine_refuses_is_a_400_line_with_the_engine_s_message(llm, tmp_path: Path) -> None:
    lines = [chat("ok", "fine"), completion("long", "z" * 5000), chat("long-chat", "z" * 5000), chat("bad", "x", temperature=-1),
             chat("f", "x", frequency_penalty=0.5), chat("two", "x", max_completion_tokens=0, max_tokens=None)]
    summary = run(llm, write_jsonl(tmp_path / "in.jsonl", lines), tmp_path / "out.jsonl")
    assert (summary.ok, summary.failed) == (1, 5)
    errors = read_jsonl(tmp_path / "out.errors.jsonl")
    assert [(e["custom_id"], e["response"]["status_code"], e["error"]) for e in errors] == [
        (c, 400, None) for c in ("long", "long-chat", "bad", "f", "two")]
    bodies = [ErrorObject.model_validate(e["response"]["body"]["error"]) for e in errors]
    assert [b.param for b in bodies] == ["prompt", "messages", "temperature", "frequency_penalty", "max_completion_tokens"]
    assert {b.type for b in bodies} == {"invalid_request_error"} and {b.code for b in bodies} == {"invalid_request"}
    assert "exceeds max_model_len (4096)" in bodies[0].message and "exceeds max_model_len (4096)" in bodies[1].message
    assert bodies[4].message == "max_completion_tokens: must be >= 1, got 0"


def test_an_unusable_file_is_refused_whole_before_any_request_runs(tmp_path: Path) -> None:
    """What OpenAI fails a batch for at validation refuses the file up front, every such line named: not JSON, a
    line without its four fields or with another method or url, a repeated custom_id, a line over the size limit."""
    good = chat("ok", "fine")
    lines = [json.dumps(good), "{not json", json.dumps({k: v for k, v in chat("m", "x").items() if k != "method"}),
             json.dumps({**chat("g", "x"), "method": "GET"}), json.dumps({**chat("u", "x"), "url": "/v1/responses"}),
             json.dumps({"method": "POST", "url": "/v1/completions", "body": {"prompt": "x"}}), json.dumps(good),
             json.dumps(chat("big", "x" * 5000))]
    src = write_jsonl(tmp_path / "in.jsonl", lines)
    with pytest.raises(InvalidRequestError) as refused_file:
        batch(str(src), str(tmp_path / "out.jsonl"), model="builtin:never-loaded", quiet=True, max_row_bytes=4096)
    message = refused_file.value.message
    assert message.startswith(f"{src} is not a usable batch input file: line 2: the line is not valid JSON")
    for expected in ("line 3: method: missing", "line 4: method: must be POST, got 'GET'",
                     "line 5: url: unsupported '/v1/responses'", "line 6: custom_id: missing",
                     "line 7: custom_id 'ok' already on line 1", "line 8: row: 5", "over the max_row_bytes limit (4096)"):
        assert expected in message
    assert not (tmp_path / "out.jsonl").exists() and not (tmp_path / "out.errors.jsonl").exists()


def test_cli_exit_status_1_with_refused_requests_2_for_an_unusable_file(tmp_path: Path) -> None:
    src = write_jsonl(tmp_path / "in.jsonl", [chat("a", "fine"), chat("b", "x", max_tokens=-1)])
    done = cli("batch", "-i", str(src), "-o", str(tmp_path / "out.jsonl"), "--model", "builtin:tiny",
               "--num-kv-blocks", str(ENGINE["num_kv_blocks"]), "--quiet")
    assert done.returncode == 1, done.stderr
    assert [line["custom_id"] for line in read_jsonl(tmp_path / "out.jsonl")] == ["a"]
    [error] = read_jsonl(tmp_path / "out.errors.jsonl")
    assert error["response"]["status_code"] == 400 and error["response"]["body"]["error"]["param"] == "max_tokens"
    unusable = write_jsonl(tmp_path / "dup.jsonl", [chat("a", "1"), chat("a", "2")])
    done = cli("batch", "-i", str(unusable), "-o", str(tmp_path / "dup-out.jsonl"), "--model", "builtin:tiny")
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert "line 2: custom_id 'a' already on line 1" in done.stderr and not (tmp_path / "dup-out.jsonl").exists()


def test_deeply_nested_lines_and_schemas_are_refused_not_raised(llm, tmp_path: Path) -> None:
    """A line nested past Python's recursion limit makes the file unusable; a response_format schema nested deeper
    than MAX_NESTING is its request's 400. Both used to raise RecursionError out of the whole run."""
    deep_schema: dict = {"type": "string"}
    for _ in range(300):
        deep_schema = {"type": "object", "properties": {"a": deep_schema}}
    response_format = {"type": "json_schema", "json_schema": {"name": "deep", "schema": deep_schema}}
    lines = [json.dumps(chat("ok", "fine")), json.dumps(chat("schema", "x", response_format=response_format))]
    summary = run(llm, write_jsonl(tmp_path / "in.jsonl", lines), tmp_path / "out.jsonl")
    assert (summary.ok, summary.failed) == (1, 1)
    [error] = read_jsonl(tmp_path / "out.errors.jsonl")
    body = error["response"]["body"]["error"]
    assert error["custom_id"] == "schema" and body["param"] == "response_format.json_schema.schema"
    assert body["message"].startswith("response_format.json_schema.schema: nests deeper than 64")
    deep_line = '{"custom_id": "deep", "body": ' + "[" * 100_000 + "]" * 100_000 + "}"
    with pytest.raises(InvalidRequestError, match="line 2: the line nests too deeply to parse"):
        run(llm, write_jsonl(tmp_path / "deep.jsonl", [lines[0], deep_line]), tmp_path / "deep-out.jsonl")


def test_duplicate_custom_ids_refuse_the_file_with_line_numbers(llm, tmp_path: Path) -> None:
    src = write_jsonl(tmp_path / "in.jsonl", [chat("a", "1"), chat("b", "2"), chat("a", "3"), "", chat("b", "4")])
    with pytest.raises(InvalidRequestError, match=r"line 3: custom_id 'a' already on line 1; "
                                                  r"line 5: custom_id 'b' already on line 2$"):
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
        assert "json_schema" in error["response"]["body"]["error"]["message"]
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
    """A request line whose url and body fields (any of `BODY_FIELDS`, or `EMBEDDING_FIELDS` for embeddings) hold any
    JSON value."""
    url = draw(st.sampled_from(sorted(URLS)) | _ANY_JSON)
    body: dict = {"messages": [{"role": "user", "content": "hi"}]} if url == "/v1/chat/completions" else {"prompt": "hi"}
    fields = BODY_FIELDS
    if url == "/v1/embeddings":
        body, fields = {"input": "hi"}, EMBEDDING_FIELDS
    for name in draw(st.lists(st.sampled_from(sorted(fields)), max_size=4, unique=True)):
        body[name] = draw(_ANY_JSON)
    return json.dumps({"custom_id": "a", "method": "POST", "url": url, "body": body}).encode()


@settings(max_examples=1000, deadline=None)
@given(_request_lines())
def test_a_line_of_any_values_is_a_request_a_refused_one_or_a_file_problem(raw: bytes) -> None:
    """Whatever values a line's fields hold, parsing it gives a request, a refused request (its body) or a problem of
    the file (its url), never another exception (`"seed": "7"`, `"stop": 5` and `"url": ["x"]` raised one)."""
    url = json.loads(raw)["url"]
    supported = isinstance(url, str) and url in URLS
    try:
        request = Parser("m", 16).parse(raw)
    except FileProblem as problem:
        assert not supported and (problem.code, problem.param) == ("invalid_request", "url")
    else:
        assert supported and isinstance(request, (Request, Refused)) and request.custom_id == "a"
        assert isinstance(request, Request) or request.param and request.message.startswith(request.param.split(".")[0])


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


def test_logprobs_without_token_texts_are_that_lines_error_not_the_batchs() -> None:
    """A worker older than the formatter sends logprobs without token texts: that request's line is an error naming
    the cause; the other lines (and the batch) are unaffected."""
    from tokenmill.apps.batch import Parser, request_line
    from tokenmill.apps.store import Outcome

    parser = Parser("queue:tokenmill", None)
    line = json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/chat/completions",
                       "body": {"model": "m", "messages": [{"role": "user", "content": "hi"}], "logprobs": True}})
    request = parser.parse(line.encode())
    old = Outcome(text="x", finish_reason="stop", logprobs=json.dumps([{"token_id": 5, "logprob": -0.1,
                                                                         "top_logprobs": []}]))
    written, error = request_line(request, [old])
    assert written["error"]["code"] == "logprobs_unavailable" and written["response"] is None and "upgrade" in error
    new = dataclasses.replace(old, logprobs=json.dumps([{"token_id": 5, "logprob": -0.1, "top_logprobs": [],
                                                          "token": "x", "bytes": [120], "top_tokens": []}]))
    written, error = request_line(request, [new])
    assert error is None and written["response"]["body"]["choices"][0]["logprobs"]["content"][0]["token"] == "x"


def embeddings(custom_id: str, input, **body) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/embeddings",
            "body": {"model": "tiny-embed", "input": input, **body}}


def test_embeddings_lines_load_as_the_sdk_s_embedding_responses(llm, tmp_path: Path) -> None:
    """`/v1/embeddings` lines: a string, a list of strings, token ids; `dimensions`; `encoding_format` float or
    base64 (little-endian float32, as the SDK decodes it); each vector the engine's own (`LLM.embed`), usage its
    inputs' prompt tokens. A bad `dimensions`, `encoding_format` or `input`, and an input the engine refuses, are
    their lines' 400s naming the body's field."""
    import base64

    import numpy as np
    from openai.types import CreateEmbeddingResponse

    lines = [embeddings("one", "hello there"), embeddings("two", ["a first", "a second"], dimensions=8),
             embeddings("b64", ["a first", [5, 6, 7]], encoding_format="base64", user="u"),
             embeddings("dim0", "x", dimensions=0), embeddings("fmt", "x", encoding_format="int8"),
             embeddings("empty", ""), embeddings("long", "z" * 5000), embeddings("extra", "x", max_tokens=3)]
    summary = run(llm, write_jsonl(tmp_path / "in.jsonl", lines), tmp_path / "out.jsonl")
    assert (summary.ok, summary.failed) == (3, 5)
    raw = {line["custom_id"]: line["response"]["body"] for line in read_jsonl(tmp_path / "out.jsonl")}
    decoded = [np.frombuffer(base64.b64decode(d["embedding"]), dtype="<f4") for d in raw["b64"]["data"]]
    for item, vector in zip(raw["b64"]["data"], decoded):  # the SDK's type holds floats: it decodes base64 so
        item["embedding"] = vector.tolist()
    bodies = {custom_id: CreateEmbeddingResponse.model_validate(body) for custom_id, body in raw.items()}
    expected = {text: out for text, out in zip(["hello there", "a first", "a second"],
                                               llm.embed(["hello there", "a first", "a second"]))}
    cut = llm.embed(["a first", "a second"], dimensions=8)
    tokens = llm.embed([[5, 6, 7]])[0]
    assert bodies["one"].model == "tiny-embed" and bodies["one"].object == "list"
    assert [d.index for d in bodies["two"].data] == [0, 1] and {d.object for d in bodies["two"].data} == {"embedding"}
    np.testing.assert_allclose(bodies["one"].data[0].embedding, expected["hello there"].embedding, atol=1e-5)
    np.testing.assert_allclose([d.embedding for d in bodies["two"].data], [o.embedding for o in cut], atol=1e-5)
    np.testing.assert_allclose(decoded, [expected["a first"].embedding, tokens.embedding], atol=1e-5)
    assert bodies["two"].usage.prompt_tokens == bodies["two"].usage.total_tokens == sum(o.num_prompt_tokens for o in cut)
    assert bodies["b64"].usage.prompt_tokens == expected["a first"].num_prompt_tokens + 3
    errors = read_jsonl(tmp_path / "out.errors.jsonl")
    params = {e["custom_id"]: ErrorObject.model_validate(e["response"]["body"]["error"]).param for e in errors}
    assert params == {"dim0": "dimensions", "fmt": "encoding_format", "empty": "input[0]", "long": "input",
                      "extra": "max_tokens"}
    assert {e["response"]["status_code"] for e in errors} == {400}


def test_embeddings_base64_is_the_engine_s_encoding() -> None:
    from tokenmill.apps.batch import float32_base64
    from tokenmill.engine.pooling import encode_base64

    vector = [0.1, -2.5, 3.0e-8, 1.0 / 3.0]
    assert float32_base64(vector) == encode_base64(vector)


def test_the_tokenmill_extension_answers_choice_probabilities_and_scores(llm, tmp_path: Path) -> None:
    """A body's `tokenmill` extension: `{"choice", "choice_probabilities": true}` answers the body's
    `tokenmill.choice_probabilities` (the engine's, to 1e-5; the text its most probable choice), `{"score":
    [continuations]}` the body's `tokenmill.scores` (`LLM.score`'s, to 1e-5), on completions and chat completions;
    the SDK's types still load each body. A bad extension field, sampling beside a score, and a continuation the engine
    refuses are their lines' 400s naming `tokenmill.<field>`."""
    labels, continuations = ["yes", "no", "maybe"], [" Paris", " Rome and more", [7, 8, 9]]
    lines = [completion("p", "Is it fine?", tokenmill={"choice": labels, "choice_probabilities": True}),
             chat("pc", "Is it fine?", tokenmill={"choice": labels, "choice_probabilities": True}),
             {**completion("s", "The capital of France is", tokenmill={"score": continuations}),},
             {**chat("sc", "The capital of France is", tokenmill={"score": [" Paris"]})},
             completion("bad", "x", tokenmill={"choices": labels}), completion("sampled", "x", tokenmill={"score": ["a"]}),
             completion("huge", "x", tokenmill={"score": [[10**9]]})]
    for line in lines[2:4] + lines[-1:]:
        del line["body"]["max_tokens"]
    summary = run(llm, write_jsonl(tmp_path / "in.jsonl", lines), tmp_path / "out.jsonl")
    assert (summary.ok, summary.failed) == (4, 3)
    raw = {line["custom_id"]: line["response"]["body"] for line in read_jsonl(tmp_path / "out.jsonl")}
    errors = {line["custom_id"]: line["response"]["body"]["error"] for line in read_jsonl(tmp_path / "out.errors.jsonl")}
    assert {k: e["param"] for k, e in errors.items()} == {"bad": "tokenmill.choices", "sampled": "max_tokens",
                                                          "huge": "tokenmill.score[0]"}
    Completion.model_validate(raw["p"]), Completion.model_validate(raw["s"])
    ChatCompletion.model_validate(raw["pc"]), ChatCompletion.model_validate(raw["sc"])
    params = SamplingParams(choice=labels, choice_probabilities=True)
    text_out = llm.generate(["Is it fine?"], params, use_tqdm=False)[0]
    got = raw["p"]["tokenmill"]["choice_probabilities"]
    assert list(got) == labels and raw["p"]["choices"][0]["text"] == text_out.text
    assert max(abs(got[k] - text_out.choice_probabilities[k]) for k in labels) <= 1e-5
    chat_out = llm.chat([[{"role": "user", "content": "Is it fine?"}]], params, use_tqdm=False)[0]
    got = raw["pc"]["tokenmill"]["choice_probabilities"]
    assert max(abs(got[k] - chat_out.choice_probabilities[k]) for k in labels) <= 1e-5
    expected = llm.score("The capital of France is", continuations)
    scores = raw["s"]["tokenmill"]["scores"]
    assert [(s["num_tokens"], s["is_greedy"]) for s in scores] == [(len(e.token_ids), e.is_greedy) for e in expected]
    assert max(abs(s["logprob"] - e.logprob) for s, e in zip(scores, expected)) <= 1e-5
    assert raw["s"]["choices"][0]["text"] == "" and raw["s"]["usage"]["completion_tokens"] == 0
    prompt = llm.engine.apply_chat_template([{"role": "user", "content": "The capital of France is"}])
    assert abs(raw["sc"]["tokenmill"]["scores"][0]["logprob"] - llm.score(prompt, [" Paris"])[0].logprob) <= 1e-5
    assert "tokenmill" not in raw["p"]["choices"][0]
