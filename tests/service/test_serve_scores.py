"""tokenmill's batch extension through `tokenmill serve`, driven by the official `openai` SDK: choice probabilities
and scores in a `/v1/completions` batch (the very lines `tokenmill batch --broker` writes), against a real server,
redis-server and worker on builtin:tiny; each value the engine's own (`LLM` in this process, to 1e-5)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from openai.types import Completion
from test_serve import lines_of, serve, upload, wait_status, write_jsonl  # noqa: F401 (serve: the fixture)

from tokenmill.apps.batch import batch as run_batch
from tokenmill.sampling_params import SamplingParams

LABELS, PROMPT, CONTINUATIONS = ["yes", "no", "maybe"], "The capital of France is", [" Paris", " Rome and more", [7, 8]]


@pytest.fixture(scope="module")
def llm() -> Any:
    from tokenmill import LLM

    return LLM("builtin:tiny")


def completion_line(custom_id: str, extension: dict[str, Any], **body: Any) -> dict[str, Any]:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/completions",
            "body": {"model": "builtin:tiny", "prompt": PROMPT, "tokenmill": extension, **body}}


def test_choice_probabilities_and_scores_through_serve_are_the_engine_s(
        tmp_path, redis_server, start_worker, serve, llm) -> None:  # noqa: F811 (serve: the fixture)
    """A `/v1/completions` batch with tokenmill's extension: each output line parses as the SDK's `Completion`, is the
    line `tokenmill batch --broker` writes for the same file, and carries the engine's choice probabilities and
    scores in the body's `tokenmill` field; a bad continuation is its line's 400 naming `tokenmill.score[0]`."""
    start_worker(redis_server.url).wait_ready()
    client = serve(redis_server.url).client()
    lines = [completion_line("p", {"choice": LABELS, "choice_probabilities": True}, max_tokens=4),
             completion_line("s", {"score": CONTINUATIONS}), completion_line("bad", {"score": [""]})]
    source = write_jsonl(tmp_path / "extension.jsonl", lines)
    created = client.batches.create(input_file_id=upload(client, source), endpoint="/v1/completions",
                                    completion_window="24h")
    done = wait_status(client, created.id, ("completed", "failed", "cancelled", "expired"), 120)
    assert done.status == "completed", done.errors
    assert (done.request_counts.completed, done.request_counts.failed) == (2, 1)
    output, [error] = lines_of(client, done.output_file_id), lines_of(client, done.error_file_id)
    assert error["response"]["body"]["error"]["param"] == "tokenmill.score[0]"
    bodies = {line["custom_id"]: Completion.model_validate(line["response"]["body"]) for line in output}
    probabilities = bodies["p"].tokenmill["choice_probabilities"]  # an extra field the SDK's type keeps
    expected = llm.generate([PROMPT], SamplingParams(choice=LABELS, choice_probabilities=True), use_tqdm=False)[0]
    assert list(probabilities) == LABELS and bodies["p"].choices[0].text == expected.text
    assert max(abs(probabilities[k] - expected.choice_probabilities[k]) for k in LABELS) <= 1e-5
    scores = bodies["s"].tokenmill["scores"]
    want = llm.score(PROMPT, CONTINUATIONS)
    assert [(s["num_tokens"], s["is_greedy"]) for s in scores] == [(len(w.token_ids), w.is_greedy) for w in want]
    assert max(abs(s["logprob"] - w.logprob) for s, w in zip(scores, want)) <= 1e-5
    run_batch(str(source), str(tmp_path / "broker.jsonl"), broker=redis_server.url, quiet=True)
    broker = [json.loads(line) for line in (tmp_path / "broker.jsonl").read_text().splitlines()]
    assert [line["custom_id"] for line in broker] == [line["custom_id"] for line in output]
    for mine, theirs in zip(output, broker):
        assert mine["response"]["body"]["tokenmill"] == theirs["response"]["body"]["tokenmill"]
        assert mine["response"]["body"]["choices"] == theirs["response"]["body"]["choices"]
