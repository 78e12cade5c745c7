"""Embeddings through `tokenmill serve`, driven by the official `openai` SDK: `/v1/embeddings` batches (the very lines
`tokenmill batch --broker` writes) and `POST /v1/embeddings`, against a real server, redis-server and worker on
builtin:tiny; each vector the engine's own (`LLM.embed` in this process, to 1e-5)."""

from __future__ import annotations

import base64
import json
from typing import Any

import numpy as np
import openai
import pytest
from openai.types import CreateEmbeddingResponse
from test_serve import lines_of, serve, upload, wait_status, write_jsonl  # noqa: F401 (serve: the fixture)

from tokenmill.apps.batch import batch as run_batch

TEXTS = ["the first text", "a second, longer text to embed", "é"]


@pytest.fixture(scope="module")
def llm() -> Any:
    from tokenmill import LLM

    return LLM("builtin:tiny")


def embedding_line(custom_id: str, input: Any, **body: Any) -> dict[str, Any]:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/embeddings",
            "body": {"model": "builtin:tiny", "input": input, **body}}


def as_floats(body: dict[str, Any]) -> CreateEmbeddingResponse:
    """A response body as the SDK's type, its base64 vectors decoded as the SDK does (float32, little-endian)."""
    data = [{**item, "embedding": np.frombuffer(base64.b64decode(item["embedding"]), dtype="<f4").tolist()}
            if isinstance(item["embedding"], str) else item for item in body["data"]]
    return CreateEmbeddingResponse.model_validate({**body, "data": data})


def close(got: list[list[float]], expected: list[list[float]]) -> None:
    assert [len(vector) for vector in got] == [len(vector) for vector in expected]
    np.testing.assert_allclose(np.array(got), np.array(expected), atol=1e-5, rtol=0)


def test_an_embeddings_batch_through_serve_is_tokenmill_batch_s_and_the_engine_s(
        tmp_path, redis_server, start_worker, serve, llm) -> None:  # noqa: F811 (serve: the fixture)
    """A batch with endpoint "/v1/embeddings": its output lines parse as the SDK's `CreateEmbeddingResponse`, are the
    lines `tokenmill batch --broker` writes for the same file, and hold `LLM.embed`'s vectors; `dimensions`, base64
    and token-id inputs included; a refused body is its line's 400 naming the field."""
    start_worker(redis_server.url).wait_ready()
    client = serve(redis_server.url).client()
    lines = [embedding_line("one", TEXTS[0]), embedding_line("many", TEXTS, dimensions=8),
             embedding_line("b64", [TEXTS[1], [5, 6, 7]], encoding_format="base64"),
             embedding_line("bad", "x", dimensions=0)]
    source = write_jsonl(tmp_path / "embeddings.jsonl", lines)
    created = client.batches.create(input_file_id=upload(client, source), endpoint="/v1/embeddings",
                                    completion_window="24h")
    done = wait_status(client, created.id, ("completed", "failed", "cancelled", "expired"), 120)
    assert done.status == "completed", done.errors
    assert (done.request_counts.completed, done.request_counts.failed) == (3, 1)
    output, [error] = lines_of(client, done.output_file_id), lines_of(client, done.error_file_id)
    assert (error["custom_id"], error["response"]["status_code"]) == ("bad", 400)
    assert error["response"]["body"]["error"]["param"] == "dimensions"
    bodies = {line["custom_id"]: as_floats(line["response"]["body"]) for line in output}
    assert isinstance(output[2]["response"]["body"]["data"][0]["embedding"], str)
    close([d.embedding for d in bodies["one"].data], [llm.embed(TEXTS[:1])[0].embedding])
    close([d.embedding for d in bodies["many"].data], [o.embedding for o in llm.embed(TEXTS, dimensions=8)])
    close([d.embedding for d in bodies["b64"].data], [o.embedding for o in llm.embed([TEXTS[1], [5, 6, 7]])])
    assert [d.index for d in bodies["many"].data] == [0, 1, 2] and bodies["many"].model == "builtin:tiny"
    assert bodies["many"].usage.prompt_tokens == sum(o.num_prompt_tokens for o in llm.embed(TEXTS))
    assert done.usage.input_tokens == sum(body.usage.prompt_tokens for body in bodies.values())
    run_batch(str(source), str(tmp_path / "broker.jsonl"), broker=redis_server.url, quiet=True)
    broker = [json.loads(line) for line in (tmp_path / "broker.jsonl").read_text().splitlines()]
    assert [line["custom_id"] for line in broker] == [line["custom_id"] for line in output]
    for mine, theirs in zip(output, broker):
        assert mine["response"]["body"]["usage"] == theirs["response"]["body"]["usage"]
        got, want = as_floats(mine["response"]["body"]), as_floats(theirs["response"]["body"])
        close([d.embedding for d in got.data], [d.embedding for d in want.data])


def test_post_embeddings_answers_as_openai_through_the_queue(tmp_path, redis_server, start_worker, serve,  # noqa: F811
                                                             llm) -> None:
    """`client.embeddings.create(...)`: the SDK's default base64 and `encoding_format="float"`, `dimensions`, token
    ids; a bad body is a 400 naming its field, a model no worker serves a 404; past TOKENMILL_EMBEDDINGS_TIMEOUT a 504
    in OpenAI's shape, its jobs cancelled (not left on the queue)."""
    start_worker(redis_server.url).wait_ready()
    client = serve(redis_server.url).client()
    got = client.embeddings.create(model="builtin:tiny", input=TEXTS)
    close([d.embedding for d in got.data], [o.embedding for o in llm.embed(TEXTS)])
    assert [d.index for d in got.data] == [0, 1, 2] and got.model == "builtin:tiny"
    assert got.usage.prompt_tokens == got.usage.total_tokens == sum(o.num_prompt_tokens for o in llm.embed(TEXTS))
    cut = client.embeddings.create(model="builtin:tiny", input=TEXTS[0], dimensions=8, encoding_format="float")
    close([cut.data[0].embedding], [llm.embed(TEXTS[:1], dimensions=8)[0].embedding])
    tokens = client.embeddings.create(model="builtin:tiny", input=[[5, 6, 7], [8, 9]])
    close([d.embedding for d in tokens.data], [o.embedding for o in llm.embed([[5, 6, 7], [8, 9]])])
    for fields, param in (({"dimensions": 0}, "dimensions"), ({"input": ""}, "input[0]"),
                          ({"input": "z" * 5000}, "input"), ({"encoding_format": "int8"}, "encoding_format")):
        with pytest.raises(openai.BadRequestError) as refused:
            client.embeddings.create(**{"model": "builtin:tiny", "input": "x", **fields})
        assert refused.value.body["param"] == param, refused.value.body
    with pytest.raises(openai.NotFoundError) as missing:
        client.embeddings.create(model="no-such-model", input="x")
    assert missing.value.body["code"] == "model_not_found"
    idle = serve(redis_server.url, env={"TOKENMILL_EMBEDDINGS_TIMEOUT": "1", "TOKENMILL_QUEUE": "unserved"}).client()
    with pytest.raises(openai.InternalServerError) as late:
        idle.embeddings.create(model="builtin:tiny", input=TEXTS)
    assert late.value.status_code == 504 and late.value.body["code"] == "timeout"
    broker = redis_server.client()  # the request's jobs wait for no worker, each with its `cancelled` result stored
    stored = [json.loads(broker.get(key)) for key in broker.scan_iter("celery-task-meta-*")]
    cancelled = [meta["result"] for meta in stored if meta["status"] == "REVOKED"]
    assert len(cancelled) == len(TEXTS) and {r["status"] for r in cancelled} == {"cancelled"}


def test_one_tenant_s_waiting_embeddings_requests_are_bounded(tmp_path, redis_server, serve) -> None:  # noqa: F811
    """With no worker the requests wait: a tenant's second waiting request is a 429 at once
    (TOKENMILL_MAX_EMBEDDING_REQUESTS 1), while another tenant's request still waits its turn (a 504 here)."""
    import threading
    import time

    server = serve(redis_server.url, **{"max-embedding-requests": 1, "embeddings-timeout": 4})
    alice, bob = server.client("alice"), server.client("bob")
    first: list[BaseException] = []
    waiting = threading.Thread(target=lambda: _expect_error(alice, first))
    waiting.start()
    time.sleep(1.0)  # alice's first request is waiting for its jobs
    started = time.monotonic()
    with pytest.raises(openai.RateLimitError) as refused:
        alice.embeddings.create(model="builtin:tiny", input="again")
    assert time.monotonic() - started < 2.0 and refused.value.code == "too_many_requests"
    with pytest.raises(openai.APIStatusError) as timed_out:
        bob.embeddings.create(model="builtin:tiny", input="bob's")
    assert timed_out.value.status_code == 504
    waiting.join(30)
    assert len(first) == 1 and getattr(first[0], "status_code", None) == 504


def _expect_error(client: openai.OpenAI, errors: list[BaseException]) -> None:
    try:
        client.embeddings.create(model="builtin:tiny", input="first")
    except openai.APIError as exc:
        errors.append(exc)


def test_waiting_embeddings_requests_are_bounded_in_all_too() -> None:
    """Past half the request threads waiting in all, another tenant's request is a 429 too, so that waiting
    embeddings never hold every thread the other routes need; a slot given back is taken again."""
    from tokenmill.apps.api.embeddings import Waiting
    from tokenmill.apps.api.errors import APIError

    waiting = Waiting(limit=4, total=2)
    with waiting.slot("alice"), waiting.slot("bob"):
        with pytest.raises(APIError) as refused, waiting.slot("carol"):
            pass
        assert refused.value.status == 429 and "half of TOKENMILL_REQUEST_THREADS" in str(refused.value)
    with waiting.slot("carol"), waiting.slot("carol"):
        pass
