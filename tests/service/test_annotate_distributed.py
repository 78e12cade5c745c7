"""`tokenmill annotate` / `batch` across the queue (real redis-server and worker processes), and on S3 (moto's
server). Rows travel as `tokenmill.generate_batch` messages; each row keeps its own job id and result."""

from __future__ import annotations

import io
import json
import signal
import sqlite3
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from openai.types.chat import ChatCompletion
from service_fixtures import S3_BUCKET

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from annotate_helpers import ENGINE, checkpointed, read_jsonl, wait_until, write_jsonl  # noqa: E402

import tokenmill  # noqa: E402
from tokenmill.apps.batch import batch  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
TEMPLATE = "Say: {{ text }}"


@pytest.fixture(scope="module")
def llm():
    import torch

    torch.set_num_threads(1)
    from tokenmill import LLM

    return LLM("builtin:tiny", max_num_seqs=64, **ENGINE)


def checkpoint_keys(state: Path) -> set[str]:
    with sqlite3.connect(state / "checkpoint.sqlite") as db:
        return {key for (key,) in db.execute("SELECT key FROM results")}


def rows(count: int, distinct: int | None = None) -> list[dict]:
    return [{"id": i, "text": f"line {i % (distinct or count)}"} for i in range(count)]


def test_rows_become_grouped_jobs_with_one_result_each_and_match_embedded(llm, tmp_path, redis_server, start_worker,
                                                                           result_log) -> None:
    start_worker(redis_server.url).wait_ready()
    data = rows(90, distinct=60) + [{"id": 90, "other": "no text column"}, {"id": 91, "text": "z" * 5000}]
    src = write_jsonl(tmp_path / "in.jsonl", data)
    options = dict(max_tokens=8, quiet=True, rows_per_message=7)
    summary = tokenmill.annotate(str(src), str(tmp_path / "queue.jsonl"), TEMPLATE, broker=redis_server.url, **options)
    assert (summary.rows, summary.ok, summary.failed, summary.computed, summary.deduplicated) == (92, 90, 2, 61, 30)
    embedded = tokenmill.annotate(str(src), str(tmp_path / "local.jsonl"), TEMPLATE, llm=llm, **options)
    assert embedded.computed == 61
    queue_rows, local_rows = read_jsonl(tmp_path / "queue.jsonl"), read_jsonl(tmp_path / "local.jsonl")
    assert queue_rows == local_rows
    assert "column 'text' is undefined" in queue_rows[90]["error"]
    assert queue_rows[91]["error"].startswith("invalid_request: ") and "(field: prompt" in queue_rows[91]["error"]
    wait_until(lambda: len(result_log.counts) >= 61, 30, "every job's result announced")
    keys = checkpoint_keys(Path(str(tmp_path / "queue.jsonl") + ".tokenmill-state"))
    assert len(keys) == 61 and {result_log.counts.get(key) for key in keys} == {1}  # one result per distinct row
    assert set(result_log.counts) == keys  # the 9 group messages (ceil(61 / 7)) store no result of their own
    assert not [k for k in redis_server.client().keys("celery-task-meta-*") if k.decode().split("-")[-1] not in keys]

    # the same file again: every row comes from the checkpoint, nothing goes to the queue
    again = tokenmill.annotate(str(src), str(tmp_path / "queue.jsonl"), TEMPLATE, broker=redis_server.url, **options)
    assert (again.computed, again.reused) == (0, 91)
    assert read_jsonl(tmp_path / "queue.jsonl") == queue_rows

    # OpenAI batch files through the same queue
    requests = [{"custom_id": f"c{i}", "method": "POST", "url": "/v1/chat/completions",
                 "body": {"model": "tiny", "messages": [{"role": "user", "content": f"hi {i}"}], "max_tokens": 4, "temperature": 0}}
                for i in range(5)]
    requests.append({**requests[0], "custom_id": "lp", "body": {**requests[0]["body"], "logprobs": True}})
    write_jsonl(tmp_path / "req.jsonl", requests)
    result = batch(str(tmp_path / "req.jsonl"), str(tmp_path / "res.jsonl"), broker=redis_server.url, quiet=True)
    assert (result.ok, result.failed) == (6, 0)
    lines = read_jsonl(tmp_path / "res.jsonl")
    expected = llm.chat([[{"role": "user", "content": f"hi {i}"}] for i in range(5)],
                        tokenmill.SamplingParams(max_tokens=4, temperature=0.0), use_tqdm=False)
    assert [ChatCompletion.model_validate(line["response"]["body"]).choices[0].message.content for line in lines] == \
        [o.text for o in expected + expected[:1]]
    logprobs = ChatCompletion.model_validate(lines[5]["response"]["body"]).choices[0].logprobs  # the workers' tokens
    assert [entry.token for entry in logprobs.content] == [llm.tokenizer.decode([i]) for i in expected[0].token_ids]
    assert read_jsonl(tmp_path / "res.errors.jsonl") == []


def test_kill_9_mid_run_then_rerun_gives_the_uninterrupted_output(llm, tmp_path, redis_server, start_worker) -> None:
    start_worker(redis_server.url).wait_ready()
    src = write_jsonl(tmp_path / "in.jsonl", rows(300))
    out, state = tmp_path / "out.jsonl", tmp_path / "state"
    command = [sys.executable, "-m", "tokenmill.cli", "annotate", str(src), "-o", str(out), "--template", TEMPLATE,
               "--max-tokens", "24", "--broker", redis_server.url, "--window", "16", "--rows-per-message", "4",
               "--state-dir", str(state), "--checkpoint-interval", "0", "--quiet"]
    process = subprocess.Popen(command, env={"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}, stderr=subprocess.PIPE)
    try:
        wait_until(lambda: checkpointed(state) >= 16 or process.poll() is not None, 120, "some rows checkpointed")
        process.send_signal(signal.SIGKILL)
        process.wait(10)
    finally:
        if process.poll() is None:
            process.kill()
    done_before = checkpointed(state)
    assert 16 <= done_before < 300, f"the run was not killed mid-way ({done_before} rows done)"
    # waves of 5 units in groups of 3: full and partial groups, the last wave short or empty
    resumed = tokenmill.annotate(str(src), str(out), TEMPLATE, broker=redis_server.url, max_tokens=24, state_dir=str(state),
                                 window=10, rows_per_message=3, quiet=True)
    assert resumed.reused == done_before and resumed.computed == 300 - done_before and resumed.failed == 0
    reference = tokenmill.annotate(str(src), str(tmp_path / "reference.jsonl"), TEMPLATE, llm=llm, max_tokens=24, quiet=True)
    assert reference.computed == 300
    assert out.read_text() == (tmp_path / "reference.jsonl").read_text()


def test_a_worker_killed_mid_run_costs_only_the_redelivery(tmp_path, redis_server, start_worker, result_log) -> None:
    first = start_worker(redis_server.url, name="first").wait_ready()
    src = write_jsonl(tmp_path / "in.jsonl", rows(120))
    command = [sys.executable, "-m", "tokenmill.cli", "annotate", str(src), "-o", str(tmp_path / "out.jsonl"), "--template",
               TEMPLATE, "--max-tokens", "16", "--broker", redis_server.url, "--rows-per-message", "8",
               "--state-dir", str(tmp_path / "state"), "--quiet"]
    process = subprocess.Popen(command, env={"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}, stderr=subprocess.PIPE)
    try:
        wait_until(lambda: len(result_log.counts) >= 8 or process.poll() is not None, 120, "the first results")
        first.kill()
        start_worker(redis_server.url, name="second").wait_ready()
        assert process.wait(180) == 0, process.stderr.read().decode()[-3000:]
    finally:
        if process.poll() is None:
            process.kill()
    out = read_jsonl(tmp_path / "out.jsonl")
    assert len(out) == 120 and all(r["error"] is None for r in out)
    assert set(result_log.counts.values()) == {1}  # rows redelivered with their group ran again only if unfinished


def test_s3_input_and_output(llm, tmp_path, s3_server) -> None:
    s3 = s3_server.client()
    for shard in range(2):
        buffer = io.BytesIO()
        pq.write_table(pa.Table.from_pylist(rows(10)[shard * 5 : shard * 5 + 5]), buffer)
        s3.put_object(Bucket=S3_BUCKET, Key=f"data/part-{shard}.parquet", Body=buffer.getvalue())
    for name in ("out.parquet", "out.jsonl"):
        summary = tokenmill.annotate(f"s3://{S3_BUCKET}/data/", f"s3://{S3_BUCKET}/results/{name}", TEMPLATE, llm=llm,
                                     max_tokens=5, quiet=True, s3_endpoint_url=s3_server.endpoint,
                                     state_dir=str(tmp_path / name))
        assert (summary.rows, summary.ok) == (10, 10)
    table = pq.read_table(io.BytesIO(s3.get_object(Bucket=S3_BUCKET, Key="results/out.parquet")["Body"].read()))
    lines = [json.loads(x) for x in s3.get_object(Bucket=S3_BUCKET, Key="results/out.jsonl")["Body"].read().splitlines()]
    assert table.column("id").to_pylist() == list(range(10)) == [line["id"] for line in lines]
    assert table.column("annotation").to_pylist() == [line["annotation"] for line in lines]
    local = llm.generate([f"Say: line {i}" for i in range(10)], tokenmill.SamplingParams(max_tokens=5, temperature=0.0),
                         use_tqdm=False)
    assert table.column("annotation").to_pylist() == [o.text for o in local]
    with pytest.raises(tokenmill.apps.datasets.DatasetError, match="no such file"):
        tokenmill.annotate(f"s3://{S3_BUCKET}/missing.jsonl", str(tmp_path / "x.jsonl"), TEMPLATE, llm=llm, quiet=True,
                           s3_endpoint_url=s3_server.endpoint)


def test_probabilities_come_back_from_the_workers_as_they_do_embedded(llm, tmp_path, redis_server,
                                                                       start_worker) -> None:
    """`--probabilities` across the queue: the workers' engine computes each choice's probability, the job's result
    carries it (`JobResult.choice_probabilities`), and the column holds what the embedded engine gives."""
    start_worker(redis_server.url).wait_ready()
    src = write_jsonl(tmp_path / "in.jsonl", rows(6))
    options = dict(choice=["yes", "no", "maybe"], choice_probabilities=True, quiet=True)
    tokenmill.annotate(str(src), str(tmp_path / "queue.jsonl"), TEMPLATE, broker=redis_server.url, **options)
    tokenmill.annotate(str(src), str(tmp_path / "local.jsonl"), TEMPLATE, llm=llm, **options)
    for queued, local in zip(read_jsonl(tmp_path / "queue.jsonl"), read_jsonl(tmp_path / "local.jsonl")):
        assert queued["probabilities"] == pytest.approx(local["probabilities"], rel=1e-5)
        assert queued["annotation"] == local["annotation"] == max(queued["probabilities"],
                                                                   key=queued["probabilities"].get)


def test_logprobs_come_back_from_the_workers_as_they_do_embedded(llm, tmp_path, redis_server, start_worker) -> None:
    """`--logprobs N` across the queue: the workers' engine gives each token's text with its logprob and alternatives,
    the job's result carries them, and the column (JSONL and typed Parquet) holds what the embedded engine gives."""
    start_worker(redis_server.url).wait_ready()
    src = write_jsonl(tmp_path / "in.jsonl", rows(4))
    options = dict(max_tokens=6, logprobs=3, quiet=True)
    for suffix in ("jsonl", "parquet"):
        tokenmill.annotate(str(src), str(tmp_path / f"queue.{suffix}"), TEMPLATE, broker=redis_server.url, **options)
    tokenmill.annotate(str(src), str(tmp_path / "local.jsonl"), TEMPLATE, llm=llm, **options)
    queued_rows = read_jsonl(tmp_path / "queue.jsonl")
    assert [row["logprobs"] for row in pq.read_table(tmp_path / "queue.parquet").to_pylist()] == \
        [row["logprobs"] for row in queued_rows]
    for queued, local in zip(queued_rows, read_jsonl(tmp_path / "local.jsonl"), strict=True):
        assert queued["annotation"] == local["annotation"]
        assert len(queued["logprobs"]) == queued["completion_tokens"]
        for got, want in zip(queued["logprobs"], local["logprobs"], strict=True):
            assert got["token"] == want["token"] and got["logprob"] == pytest.approx(want["logprob"], abs=1e-4)
            assert [t["token"] for t in got["top_logprobs"]] == [t["token"] for t in want["top_logprobs"]]
            assert len(got["top_logprobs"]) == 3


def test_embed_comes_back_from_the_workers_as_it_does_embedded(llm, tmp_path, redis_server, start_worker) -> None:
    """`annotate --embed --broker`: rows travel as embedding jobs in group messages; the workers' vectors (JSONL and
    list<float32> Parquet) are the embedded engine's to 1e-5, with `dimensions`; a row the workers' engine refuses
    has its error and null vector."""
    import numpy as np

    start_worker(redis_server.url).wait_ready()
    src = write_jsonl(tmp_path / "in.jsonl", rows(5) + [{"id": 5, "text": "z" * 5000}])
    for suffix in ("jsonl", "parquet"):
        summary = tokenmill.annotate(str(src), str(tmp_path / f"queue.{suffix}"), TEMPLATE, broker=redis_server.url,
                                     embed=True, dimensions=16, quiet=True, rows_per_message=2)
        assert (summary.ok, summary.failed) == (5, 1)
    tokenmill.annotate(str(src), str(tmp_path / "local.jsonl"), TEMPLATE, llm=llm, embed=True, dimensions=16,
                       quiet=True)
    table = pq.read_table(tmp_path / "queue.parquet")
    assert table.schema.field("embedding").type == pa.list_(pa.float32())
    queued_rows, local_rows = read_jsonl(tmp_path / "queue.jsonl"), read_jsonl(tmp_path / "local.jsonl")
    for got in (queued_rows, table.to_pylist()):
        np.testing.assert_allclose([row["embedding"] for row in got[:5]],
                                   [row["embedding"] for row in local_rows[:5]], atol=1e-5)
        assert [row["prompt_tokens"] for row in got] == [row["prompt_tokens"] for row in local_rows]
        assert got[5]["embedding"] is None and "max_model_len" in got[5]["error"]
    assert {len(row["embedding"]) for row in queued_rows[:5]} == {16}


def test_score_comes_back_from_the_workers_as_it_does_embedded(llm, tmp_path, redis_server, start_worker) -> None:
    """`annotate --score --broker`: rows travel as score jobs in group messages; the workers' scores (JSONL and
    Parquet) are the embedded engine's to 1e-5; a row the workers' engine refuses has its error and null scores."""
    start_worker(redis_server.url).wait_ready()
    src = write_jsonl(tmp_path / "in.jsonl", rows(4) + [{"id": 4, "text": "z" * 5000}])
    continuations = [" yes", " no", " not at all"]
    for suffix in ("jsonl", "parquet"):
        summary = tokenmill.annotate(str(src), str(tmp_path / f"queue.{suffix}"), TEMPLATE, broker=redis_server.url,
                                     score=continuations, quiet=True, rows_per_message=2)
        assert (summary.ok, summary.failed) == (4, 1)
    tokenmill.annotate(str(src), str(tmp_path / "local.jsonl"), TEMPLATE, llm=llm, score=continuations, quiet=True)
    local_rows = read_jsonl(tmp_path / "local.jsonl")
    for got in (read_jsonl(tmp_path / "queue.jsonl"), pq.read_table(tmp_path / "queue.parquet").to_pylist()):
        for row, want in zip(got[:4], local_rows[:4]):
            assert [(s["continuation"], s["num_tokens"], s["is_greedy"]) for s in row["scores"]] == \
                [(s["continuation"], s["num_tokens"], s["is_greedy"]) for s in want["scores"]]
            assert max(abs(s["logprob"] - w["logprob"]) for s, w in zip(row["scores"], want["scores"])) <= 1e-5
        assert [row["prompt_tokens"] for row in got] == [row["prompt_tokens"] for row in local_rows]
        assert got[4]["scores"] is None and "max_model_len" in got[4]["error"]
