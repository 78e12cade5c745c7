"""`tokenmill serve` driven only through the official `openai` SDK: the server is a real subprocess
(`python -m tokenmill.cli serve`), with a real redis-server and real worker processes on builtin:tiny."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from openai import OpenAI
from openai.types.chat import ChatCompletion
from openai.types.shared import ErrorObject
from service_fixtures import KEYS, REPO, S3_BUCKET, Server, engine_pid, free_port, queued, stopped, wait_for

from tokenmill.apps.api.records import refused_key
from tokenmill.apps.batch import batch as run_batch
from tokenmill.queue.names import CANCEL_KEY

@pytest.fixture
def serve(tmp_path: Path) -> Iterator[Callable[..., Server]]:
    """`serve(broker_url, **flags)` starts a server (all share one files directory); all are killed at teardown."""
    servers: list[Server] = []

    def start(broker_url: str, **flags: Any) -> Server:
        server = Server(broker_url, tmp_path / "files", tmp_path / f"serve-{len(servers)}.log", **flags)
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.close()


def chat_line(custom_id: str, content: str, max_tokens: int = 6, model: str = "builtin:tiny", **body: Any) -> dict[str, Any]:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
                     "temperature": 0, **body}}


def write_jsonl(path: Path, lines: list[Any]) -> Path:
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return path


def upload(client: OpenAI, path: Path) -> str:
    with open(path, "rb") as handle:
        return client.files.create(file=handle, purpose="batch").id


def wait_status(client: OpenAI, batch_id: str, statuses: tuple[str, ...], timeout: float, seen: list[str] | None = None):
    def check():
        found = client.batches.retrieve(batch_id)
        if seen is not None and (not seen or seen[-1] != found.status):
            seen.append(found.status)
        return found if found.status in statuses else None

    return wait_for(check, timeout, f"batch {batch_id} to be {' or '.join(statuses)}", interval=0.1)


def lines_of(client: OpenAI, file_id: str | None) -> list[dict[str, Any]]:
    return [json.loads(line) for line in client.files.content(file_id).text.splitlines()] if file_id else []


def without_created(line: dict[str, Any]) -> dict[str, Any]:
    """A result line without the time it finished (which differs between two runs)."""
    if line.get("response"):
        line = json.loads(json.dumps(line))
        del line["response"]["body"]["created"]
    return line


def test_upload_create_poll_download_matches_tokenmill_batch(tmp_path, redis_server, start_worker, serve,
                                                              result_log) -> None:
    start_worker(redis_server.url).wait_ready()
    server = serve(redis_server.url)
    client = server.client()
    assert [m.id for m in client.models.list()] == ["builtin:tiny"]
    greedy = [chat_line(f"req-{i}", f"hello {i}") for i in range(12)]
    # sampled: each line's seed fixes its tokens, through either path; `n` 2 draws two choices from one seed
    seeded = [chat_line(f"seed-{i}", f"hello {i}", max_tokens=8, temperature=0.9, seed=100 + i) for i in range(4)]
    seeded.append(chat_line("two", "hello 0", max_tokens=8, temperature=1.0, seed=7, n=2))
    lines = greedy + seeded + [chat_line("too-long", "z" * 5000)]
    source = write_jsonl(tmp_path / "requests.jsonl", lines)
    file_id = upload(client, source)
    assert client.files.retrieve(file_id).bytes == source.stat().st_size
    assert file_id in [f.id for f in client.files.list()]
    created = client.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h",
                                    metadata={"run": "test"})
    assert created.status == "validating" and created.metadata == {"run": "test"}
    seen: list[str] = []
    done = wait_status(client, created.id, ("completed", "failed"), 120, seen)
    assert done.status == "completed", done.errors
    assert seen[-1] == "completed" and "validating" not in seen[1:]
    assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (18, 17, 1)
    assert done.in_progress_at and done.finalizing_at and done.completed_at and done.created_at <= done.completed_at
    assert done.output_file_id and done.error_file_id
    output, errors = lines_of(client, done.output_file_id), lines_of(client, done.error_file_id)
    assert [line["custom_id"] for line in output] == [line["custom_id"] for line in greedy + seeded]  # input order
    texts = {line["custom_id"]: [c["message"]["content"] for c in line["response"]["body"]["choices"]]
             for line in output}
    assert all(texts[f"seed-{i}"] != texts[f"req-{i}"] for i in range(4))  # sampled, not greedy
    assert len(texts["two"]) == 2 and texts["two"][0] != texts["two"][1]
    assert done.usage.output_tokens == sum(line["response"]["body"]["usage"]["completion_tokens"] for line in output)
    assert done.usage.input_tokens == sum(line["response"]["body"]["usage"]["prompt_tokens"] for line in output)
    [error] = errors  # refused by the worker's engine: the API's 400, with the engine's message
    assert (error["custom_id"], error["response"]["status_code"], error["error"]) == ("too-long", 400, None)
    refusal = ErrorObject.model_validate(error["response"]["body"]["error"])
    assert (refusal.type, refusal.code, refusal.param) == ("invalid_request_error", "invalid_request", "messages")
    assert "exceeds max_model_len (4096)" in refusal.message

    # `tokenmill batch --broker` on the same file and workers writes the same lines (but the time they finished)
    run_batch(str(source), str(tmp_path / "cli.jsonl"), broker=redis_server.url, quiet=True)
    cli_output = [json.loads(line) for line in (tmp_path / "cli.jsonl").read_text().splitlines()]
    cli_errors = [json.loads(line) for line in (tmp_path / "cli.errors.jsonl").read_text().splitlines()]
    assert [without_created(line) for line in output] == [without_created(line) for line in cli_output]
    assert errors == cli_errors
    wait_for(lambda: len(result_log.counts) >= 38, 30, "every job's result announced")
    assert set(result_log.counts.values()) == {1}  # 19 jobs each way (n 2: two), each result stored once

    client.files.delete(file_id)
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(file_id)


def test_a_refused_body_fails_its_request_only_and_an_unusable_file_fails_the_batch(tmp_path, redis_server, start_worker,
                                                                                   serve) -> None:
    """As OpenAI's Batch API: a bad parameter value or an unknown parameter is that request's 400 line in the error
    file and the batch completes; a repeated custom_id or another url fails the whole batch at validation."""
    start_worker(redis_server.url).wait_ready()
    client = serve(redis_server.url).client()
    lines = [chat_line(f"r{i}", f"question {i}") for i in range(30)]
    lines[7]["body"]["max_tokens"] = -1  # line 8
    lines[19]["body"]["tempreature"] = 0.5  # line 20: no such parameter
    source = write_jsonl(tmp_path / "requests.jsonl", lines)
    batch = client.batches.create(input_file_id=upload(client, source), endpoint="/v1/chat/completions",
                                  completion_window="24h")
    done = wait_status(client, batch.id, ("completed", "failed", "cancelled", "expired"), 120)
    assert done.status == "completed" and done.errors is None
    assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (30, 28, 2)
    errors, output = lines_of(client, done.error_file_id), lines_of(client, done.output_file_id)
    for error, (line, message) in zip(errors, [(lines[7], "max_tokens: must be >= 1, got -1"),
                                               (lines[19], "tempreature: unsupported field (supported: ")], strict=True):
        assert set(error) == {"id", "custom_id", "response", "error"} and error["id"].startswith("batch_req_")
        assert (error["custom_id"], error["error"], error["response"]["status_code"]) == (line["custom_id"], None, 400)
        assert set(error["response"]) == {"status_code", "request_id", "body"}
        assert error["response"]["request_id"].startswith("req_") and set(error["response"]["body"]) == {"error"}
        refusal = error["response"]["body"]["error"]
        assert set(refusal) == {"message", "type", "param", "code"} and refusal["message"].startswith(message)
        assert (refusal["type"], refusal["code"]) == ("invalid_request_error", "invalid_request")
    assert [e["response"]["body"]["error"]["param"] for e in errors] == ["max_tokens", "tempreature"]
    assert [line["custom_id"] for line in output] == [f"r{i}" for i in range(30) if i not in (7, 19)]
    usages = [ChatCompletion.model_validate(line["response"]["body"]).usage for line in output]
    assert all(u.prompt_tokens > 0 and 0 < u.completion_tokens <= 6 for u in usages)
    assert all(u.total_tokens == u.prompt_tokens + u.completion_tokens for u in usages)
    assert (done.usage.input_tokens, done.usage.output_tokens, done.usage.total_tokens) == (
        sum(u.prompt_tokens for u in usages), sum(u.completion_tokens for u in usages), sum(u.total_tokens for u in usages))
    # `tokenmill batch --broker` on the same file: the same refusals (one rule for both)
    summary = run_batch(str(source), str(tmp_path / "cli.jsonl"), broker=redis_server.url, quiet=True)
    assert (summary.ok, summary.failed) == (28, 2)
    assert [json.loads(line) for line in (tmp_path / "cli.errors.jsonl").read_text().splitlines()] == errors

    unusable = [chat_line("a", "hi"), chat_line("b", "hi"), chat_line("a", "again"),
                {**chat_line("c", "hi"), "url": "/v1/completions", "body": {"model": "builtin:tiny", "prompt": "hi"}}]
    batch = client.batches.create(input_file_id=upload(client, write_jsonl(tmp_path / "unusable.jsonl", unusable)),
                                  endpoint="/v1/chat/completions", completion_window="24h")
    failed = wait_status(client, batch.id, ("failed", "completed", "in_progress"), 30)
    assert failed.status == "failed" and failed.output_file_id is None and failed.error_file_id is None
    assert [(e.line, e.code, e.param) for e in failed.errors.data] == [
        (3, "duplicate_custom_id", "custom_id"), (4, "mismatched_endpoint", "url")]
    assert failed.request_counts.total == 0


def test_a_second_tenant_gets_404_and_no_key_gets_401(tmp_path, redis_server, serve) -> None:
    server = serve(redis_server.url)
    alice, bob = server.client("alice"), server.client("bob")
    file_id = upload(alice, write_jsonl(tmp_path / "in.jsonl", [chat_line("a", "hi")]))
    batch = alice.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h")
    for call in (lambda: bob.files.retrieve(file_id), lambda: bob.files.content(file_id),
                 lambda: bob.files.delete(file_id), lambda: bob.batches.retrieve(batch.id),
                 lambda: bob.batches.cancel(batch.id),
                 lambda: bob.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions",
                                            completion_window="24h")):
        with pytest.raises(openai.NotFoundError):
            call()
    assert list(bob.files.list()) == [] and list(bob.batches.list()) == []
    assert [b.id for b in alice.batches.list()] == [batch.id]
    assert alice.files.retrieve(file_id).id == file_id
    stranger = OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="sk-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        stranger.files.list()


def test_the_server_refuses_to_start_without_a_key(tmp_path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TOKENMILL_")}
    done = subprocess.run([sys.executable, "-m", "tokenmill.cli", "serve", "--port", str(free_port())],
                          capture_output=True, text=True, timeout=60, env={**env, "PYTHONPATH": str(REPO)})
    assert done.returncode == 2 and "--insecure-no-auth" in done.stderr
    keys = tmp_path / "keys"
    keys.write_text("carol sk-carol-plain\n")  # a key, not its hash: a key file never holds a key
    done = subprocess.run([sys.executable, "-m", "tokenmill.cli", "serve", "--port", str(free_port()),
                           "--api-keys-file", str(keys)],
                          capture_output=True, text=True, timeout=60, env={**env, "PYTHONPATH": str(REPO)})
    assert done.returncode == 2 and f"{keys}:1: expected 'TENANT sha256:<64 hex digits>'" in done.stderr


def test_keys_from_a_file_of_their_hashes(tmp_path, redis_server, serve) -> None:
    def sha256(key: str) -> str:
        return hashlib.sha256(key.encode()).hexdigest()

    keys = write_jsonl(tmp_path / "keys", ["# tenant sha256:<hex of the key>", f"carol sha256:{sha256('sk-carol')}",
                                           "", f"dave {sha256('sk-dave').upper()}  # bare hex too"])
    server = serve(redis_server.url, **{"api-keys": None, "api-keys-file": keys})
    carol, dave = server.client(key="sk-carol"), server.client(key="sk-dave")
    file_id = upload(carol, write_jsonl(tmp_path / "in.jsonl", [chat_line("a", "hi")]))
    assert [f.id for f in carol.files.list()] == [file_id] and list(dave.files.list()) == []
    with pytest.raises(openai.NotFoundError):
        dave.files.retrieve(file_id)  # each key its file's tenant
    for wrong in (KEYS["alice"], sha256("sk-carol"), "sk-carol2"):  # not in the file; the hash is not the key
        with pytest.raises(openai.AuthenticationError):
            server.client(key=wrong).models.list()


def listening_addresses(port: int) -> set[str]:
    """The local addresses (as /proc/net/tcp* writes them) of the sockets listening on `port`."""
    found = set()
    for table in (Path("/proc/net/tcp"), Path("/proc/net/tcp6")):
        for row in table.read_text().splitlines()[1:] if table.exists() else []:
            local, state = row.split()[1], row.split()[3]
            address, _, hex_port = local.rpartition(":")
            if state == "0A" and int(hex_port, 16) == port:  # 0A: LISTEN
                found.add(address)
    return found


def test_insecure_no_auth_serves_without_a_key_on_loopback_only(tmp_path, redis_server, serve) -> None:
    server = serve(redis_server.url, **{"api-keys": None, "insecure-no-auth": True})
    with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/v1/models", timeout=10) as answer:
        assert answer.status == 200 and json.load(answer) == {"object": "list", "data": []}  # no Authorization
    first, second = server.client(key="anything"), server.client(key="something else")
    file_id = upload(first, write_jsonl(tmp_path / "in.jsonl", [chat_line("a", "hi")]))
    assert [f.id for f in second.files.list()] == [file_id]  # one tenant for everyone
    assert listening_addresses(server.port) == {"0100007F"}  # 127.0.0.1, no other address


def test_malformed_uploads_fail_validation_naming_the_lines(tmp_path, redis_server, serve) -> None:
    server = serve(redis_server.url, **{"max-upload-bytes": 4096, "max-batch-lines": 5})
    client = server.client()
    bad = [chat_line("ok", "hi"), "{not json", {"method": "POST", "url": "/v1/chat/completions", "body": {}},
           {**chat_line("url", "hi"), "url": "/v1/completions", "body": {"prompt": "x"}}, chat_line("ok", "again")]
    batch = client.batches.create(input_file_id=upload(client, write_jsonl(tmp_path / "bad.jsonl", bad)),
                                  endpoint="/v1/chat/completions", completion_window="24h")
    failed = wait_status(client, batch.id, ("failed", "completed", "in_progress"), 30)
    assert failed.status == "failed" and failed.failed_at and failed.output_file_id is None
    assert [(e.line, e.code) for e in failed.errors.data] == [
        (2, "invalid_json"), (3, "invalid_request"), (4, "mismatched_endpoint"), (5, "duplicate_custom_id")]
    assert "custom_id" in failed.errors.data[1].message

    many = upload(client, write_jsonl(tmp_path / "many.jsonl", [chat_line(f"c{i}", "hi") for i in range(6)]))
    batch = client.batches.create(input_file_id=many, endpoint="/v1/chat/completions", completion_window="24h")
    failed = wait_status(client, batch.id, ("failed", "completed", "in_progress"), 30)
    assert failed.status == "failed" and [(e.line, e.code) for e in failed.errors.data] == [(6, "too_many_lines")]

    with pytest.raises(openai.BadRequestError) as refused:
        client.batches.create(input_file_id=many, endpoint="/v1/responses", completion_window="24h")
    assert refused.value.status_code == 400
    assert set(refused.value.response.json()["error"]) == {"message", "type", "param", "code"}
    assert refused.value.response.json()["error"]["param"] == "endpoint"
    with pytest.raises(openai.NotFoundError):
        client.batches.create(input_file_id="file-doesnotexist", endpoint="/v1/chat/completions",
                              completion_window="24h")
    with pytest.raises(openai.APIStatusError) as too_big:
        upload(client, write_jsonl(tmp_path / "big.jsonl", [chat_line(f"c{i}", "x" * 500) for i in range(10)]))
    assert too_big.value.status_code == 413 and too_big.value.response.json()["error"]["code"] == "file_too_large"


def test_pagination_over_150_batches(tmp_path, redis_server, serve) -> None:
    server = serve(redis_server.url, **{"rate-burst": 1000})  # 150 creates at once: past the default burst
    client = server.client()
    file_id = upload(client, write_jsonl(tmp_path / "empty.jsonl", ["{not json"]))  # each batch fails at once
    ids = [client.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions",
                                 completion_window="24h").id for _ in range(150)]
    first = client.batches.list(limit=20)
    assert [b.id for b in first.data] == ids[::-1][:20] and first.has_more
    assert [b.id for b in client.batches.list(limit=100, after=ids[50]).data] == ids[:50][::-1]
    assert [b.id for b in client.batches.list(limit=20)] == ids[::-1]  # the SDK follows `after` over 8 pages
    last = client.batches.list(limit=10, after=ids[10])
    assert [b.id for b in last.data] == ids[:10][::-1] and not last.has_more


def test_files_listed_by_purpose_come_in_full_pages(tmp_path, redis_server, serve) -> None:
    server = serve(redis_server.url)  # no worker: the batch expires, writing an error file (purpose batch_output)
    client = server.client()
    source = write_jsonl(tmp_path / "in.jsonl", [chat_line("a", "hi")])
    inputs = [upload(client, source) for _ in range(3)]
    batch = client.batches.create(input_file_id=inputs[0], endpoint="/v1/chat/completions", completion_window="1s")
    output = wait_status(client, batch.id, ("expired", "completed", "failed"), 30).error_file_id
    inputs += [upload(client, source) for _ in range(2)]  # newest first: 2 inputs, the output, 3 inputs
    newest = inputs[::-1]
    pages = [client.files.list(purpose="batch", limit=2, **cursor) for cursor in
             ({}, {"after": newest[1]}, {"after": newest[3]})]
    assert [[f.id for f in page.data] for page in pages] == [newest[:2], newest[2:4], newest[4:]]
    assert [page.has_more for page in pages] == [True, True, False]
    assert [f.id for f in client.files.list(purpose="batch", limit=2)] == newest  # the SDK follows `after`
    assert [f.id for f in client.files.list(purpose="batch", limit=1, order="asc")] == inputs
    only = client.files.list(purpose="batch_output", limit=1)
    assert [f.id for f in only.data] == [output] and not only.has_more
    assert [f.id for f in client.files.list(purpose="batch_output", after=newest[0]).data] == [output]
    assert [f.id for f in client.files.list(purpose="batch_output", after=output).data] == []
    everything = client.files.list(limit=3)
    assert [f.id for f in everything.data] == newest[:2] + [output] and everything.has_more


def outcome_ids(client: OpenAI, batch: Any) -> tuple[list[str], list[dict[str, Any]]]:
    return [line["custom_id"] for line in lines_of(client, batch.output_file_id)], lines_of(client, batch.error_file_id)


def test_cancel_mid_run_keeps_the_finished_lines(tmp_path, redis_server, start_worker, serve, result_log) -> None:
    worker = start_worker(redis_server.url, max_num_seqs=8).wait_ready()
    server = serve(redis_server.url)
    client = server.client()
    source = write_jsonl(tmp_path / "in.jsonl", [chat_line(f"r{i}", f"count {i}", max_tokens=48) for i in range(200)])
    batch = client.batches.create(input_file_id=upload(client, source), endpoint="/v1/chat/completions",
                                  completion_window="24h")
    # Frozen once a few results are stored, until the server has cancelled the jobs: its counts and its cancel
    # check each trail by up to a second, and a loaded run finished 185 lines in that time.
    wait_for(lambda: len(result_log.counts) >= 3, 120, "some requests done")
    with stopped(engine_pid(worker.process.pid)):
        wait_for(lambda: client.batches.retrieve(batch.id).request_counts.completed >= 3, 30, "counted by the server")
        cancelling = client.batches.cancel(batch.id)
        assert cancelling.status == "cancelling" and cancelling.cancelling_at
        broker = redis_server.client()
        wait_for(lambda: next(broker.scan_iter(CANCEL_KEY.format(job_id="*")), None), 30, "the jobs cancelled")
    done = wait_status(client, batch.id, ("cancelled", "completed"), 60)
    assert done.status == "cancelled" and done.cancelled_at
    finished, errors = outcome_ids(client, done)
    assert 3 <= len(finished) < 150
    assert {e["error"]["code"] for e in errors} == {"batch_cancelled"}
    assert sorted(finished + [e["custom_id"] for e in errors]) == sorted(f"r{i}" for i in range(200))
    counts = done.request_counts
    assert (counts.total, counts.completed, counts.failed) == (200, len(finished), len(errors))
    assert client.batches.cancel(batch.id).status == "cancelled"  # cancelling again changes nothing


def test_a_batch_cancelled_before_any_server_drives_it_is_validated_first(tmp_path, redis_server, serve) -> None:
    """The cancel lands before a driver reads the batch: made certain by giving the server a Redis user that may
    not SET for a while, so no server can take the batch's lease until the test allows it again. The file is
    still validated: every request is counted and in the error file, and a bad line is reported, not dropped."""
    broker = redis_server.client()
    broker.execute_command("ACL", "SETUSER", "serve", "on", ">pw", "~*", "&*", "+@all")
    server = serve(f"redis://serve:pw@127.0.0.1:{redis_server.port}/0")
    client = server.client()
    good = upload(client, write_jsonl(tmp_path / "good.jsonl", [chat_line(f"r{i}", "hi") for i in range(5)]))
    bad = upload(client, write_jsonl(tmp_path / "bad.jsonl", [chat_line("a", "hi"), "{not json", chat_line("a", "hi")]))
    broker.execute_command("ACL", "SETUSER", "serve", "-set")  # from now no lease can be taken
    ids = []
    for file_id in (good, bad):
        batch = client.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h")
        assert client.batches.cancel(batch.id).status == "cancelling"
        ids.append(batch.id)
    assert [client.batches.retrieve(i).status for i in ids] == ["cancelling", "cancelling"]
    broker.execute_command("ACL", "SETUSER", "serve", "+set")
    final = ("cancelled", "completed", "failed", "expired")
    done = wait_status(client, ids[0], final, 30)
    assert done.status == "cancelled" and done.cancelled_at and done.in_progress_at is None
    assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (5, 0, 5)
    finished, errors = outcome_ids(client, done)
    assert finished == [] and done.output_file_id is None
    assert [(e["custom_id"], e["error"]["code"]) for e in errors] == [(f"r{i}", "batch_cancelled") for i in range(5)]
    invalid = wait_status(client, ids[1], final, 30)
    assert invalid.status == "cancelled" and invalid.output_file_id is None and invalid.error_file_id is None
    assert [(e.line, e.code) for e in invalid.errors.data] == [(2, "invalid_json"), (3, "duplicate_custom_id")]


def test_a_batch_past_its_completion_window_expires_with_what_finished(tmp_path, redis_server, serve) -> None:
    server = serve(redis_server.url)  # no worker: nothing finishes
    client = server.client()
    source = write_jsonl(tmp_path / "in.jsonl", [chat_line(f"r{i}", "hi") for i in range(5)])
    batch = client.batches.create(input_file_id=upload(client, source), endpoint="/v1/chat/completions",
                                  completion_window="2s")
    assert batch.expires_at == batch.created_at + 2
    done = wait_status(client, batch.id, ("expired", "completed", "failed"), 30)
    assert done.status == "expired" and done.expired_at and done.output_file_id is None
    _, errors = outcome_ids(client, done)
    assert [(e["custom_id"], e["error"]["code"]) for e in errors] == [(f"r{i}", "batch_expired") for i in range(5)]


def test_a_running_batch_expires_mid_run_keeping_the_finished_lines(tmp_path, redis_server, start_worker, serve,
                                                                   result_log) -> None:
    worker = start_worker(redis_server.url, max_num_seqs=8).wait_ready()
    server = serve(redis_server.url)
    client = server.client()
    ids = [f"r{i}" for i in range(200)]
    source = write_jsonl(tmp_path / "in.jsonl", [chat_line(i, f"count {i}", max_tokens=48) for i in ids])
    batch = client.batches.create(input_file_id=upload(client, source), endpoint="/v1/chat/completions",
                                  completion_window="15s")
    # Frozen once a few results are stored, past the window, until the server has cancelled the rest: so the
    # window ends mid-run however fast or slow the machine is.
    wait_for(lambda: len(result_log.counts) >= 3, 120, "some requests done")
    with stopped(engine_pid(worker.process.pid)):
        assert client.batches.retrieve(batch.id).status == "in_progress"
        broker = redis_server.client()
        wait_for(lambda: next(broker.scan_iter(CANCEL_KEY.format(job_id="*")), None), 60, "the jobs cancelled")
    done = wait_status(client, batch.id, ("expired", "completed", "cancelled", "failed"), 60)
    assert done.status == "expired" and done.expired_at >= batch.expires_at and done.cancelled_at is None
    finished, errors = outcome_ids(client, done)
    assert 3 <= len(finished) < 200
    assert {e["error"]["code"] for e in errors} == {"batch_expired"} and all(e["response"] is None for e in errors)
    assert sorted(finished + [e["custom_id"] for e in errors]) == sorted(ids)
    assert finished == [i for i in ids if i in set(finished)]  # input order
    counts = done.request_counts
    assert (counts.total, counts.completed, counts.failed) == (200, len(finished), len(errors))
    output = lines_of(client, done.output_file_id)
    assert done.usage.output_tokens == sum(line["response"]["body"]["usage"]["completion_tokens"] for line in output)


def test_server_kill_9_mid_batch_another_server_finishes_it_running_nothing_twice(tmp_path, redis_server, start_worker,
                                                                                  serve, result_log) -> None:
    worker = start_worker(redis_server.url, max_num_seqs=8).wait_ready()
    first = serve(redis_server.url)
    second = serve(redis_server.url)  # a second process on another port serves the same batches
    client = first.client()
    source = write_jsonl(tmp_path / "in.jsonl", [chat_line(f"r{i}", f"count {i}", max_tokens=32) for i in range(160)])
    batch = client.batches.create(input_file_id=upload(client, source), endpoint="/v1/chat/completions",
                                  completion_window="24h")
    # Frozen once a few results are stored: the server's counts trail by up to a second, and in a second one
    # worker finishes all 160 lines.
    wait_for(lambda: len(result_log.counts) >= 3, 120, "some requests done")
    with stopped(engine_pid(worker.process.pid)):
        wait_for(lambda: client.batches.retrieve(batch.id).request_counts.completed >= 3, 30, "counted by the server")
        counted = client.batches.retrieve(batch.id).request_counts.completed
        first.kill()
        seen, until = [], time.monotonic() + 8  # the second server takes the batch over meanwhile
        while time.monotonic() < until:
            seen.append(second.client().batches.retrieve(batch.id).request_counts.completed)
            time.sleep(0.05)
        assert min(seen) >= counted, seen  # a takeover counts from the results stored, never from 0 again
        during = second.client().batches.retrieve(batch.id)
        assert during.status == "in_progress" and during.request_counts.completed < 160
        third = serve(redis_server.url, port=first.port)  # and a restart on the old port
    done = wait_status(third.client(), batch.id, ("completed", "failed", "cancelled"), 180)
    assert done.status == "completed" and done.request_counts.completed == 160
    finished, errors = outcome_ids(third.client(), done)
    assert finished == [f"r{i}" for i in range(160)] and errors == []
    wait_for(lambda: len(result_log.counts) >= 160, 30, "every job's result announced")
    assert len(result_log.counts) == 160 and set(result_log.counts.values()) == {1}  # each job stored once


def test_lines_naming_a_model_no_worker_serves_error_and_the_batch_completes(tmp_path, redis_server, start_worker,
                                                                           serve) -> None:
    worker = start_worker(redis_server.url).wait_ready()
    server = serve(redis_server.url)
    client = server.client()
    assert [m.id for m in client.models.list()] == ["builtin:tiny"]  # what the live worker announces
    unnamed = chat_line("e", "no model named")
    del unnamed["body"]["model"]  # any worker's model
    lines = [chat_line("a", "hi"), chat_line("b", "hi", model="gpt-4o"), chat_line("c", "hello"),
             chat_line("d", "hey", model="builtin:huge"), unnamed]
    batch = client.batches.create(input_file_id=upload(client, write_jsonl(tmp_path / "in.jsonl", lines)),
                                  endpoint="/v1/chat/completions", completion_window="24h")
    done = wait_status(client, batch.id, ("completed", "failed", "cancelled", "expired"), 120)
    assert done.status == "completed"
    assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (5, 3, 2)
    finished, errors = outcome_ids(client, done)
    assert finished == ["a", "c", "e"]
    refusals = [ErrorObject.model_validate(e["response"]["body"]["error"]) for e in errors]  # OpenAI's 404 for it
    assert [(e["custom_id"], e["response"]["status_code"], e["error"]) for e in errors] == [("b", 404, None), ("d", 404, None)]
    assert {(r.code, r.param, r.type) for r in refusals} == {("model_not_found", "model", "invalid_request_error")}
    assert "'gpt-4o'" in refusals[0].message and "builtin:tiny" in refusals[0].message
    refused = refused_key(batch.id)  # the lines never queued, kept while the batch ran: gone once it ended
    wait_for(lambda: not redis_server.client().exists(refused), 10, f"{refused} deleted")
    assert worker.terminate() == 0  # a worker that stops withdraws its model
    assert list(client.models.list()) == []


def test_worker_kill_9_mid_batch_the_batch_completes_each_result_stored_once(tmp_path, redis_server, start_worker,
                                                                             serve, result_log) -> None:
    doomed = start_worker(redis_server.url, name="doomed", max_num_seqs=8).wait_ready()
    server = serve(redis_server.url)
    client = server.client()
    source = write_jsonl(tmp_path / "in.jsonl", [chat_line(f"r{i}", f"count {i}", max_tokens=32) for i in range(120)])
    batch = client.batches.create(input_file_id=upload(client, source), endpoint="/v1/chat/completions",
                                  completion_window="24h")
    broker = redis_server.client()
    wait_for(lambda: next(broker.scan_iter("tokenmill:deliveries:*"), None), 120, "the doomed worker to take a group")
    engine = engine_pid(doomed.process.pid)
    os.kill(engine, signal.SIGSTOP)  # the group it holds cannot finish before the kill, however slow the machine
    start_worker(redis_server.url, name="survivor", max_num_seqs=8).wait_ready()
    doomed.kill_with_children()  # kill -9 of the whole worker, its engine process too
    done = wait_status(client, batch.id, ("completed", "failed", "cancelled", "expired"), 240)
    assert done.status == "completed" and done.request_counts.completed == 120
    finished, errors = outcome_ids(client, done)
    assert finished == [f"r{i}" for i in range(120)] and errors == []
    wait_for(lambda: len(result_log.counts) >= 120, 30, "every job's result announced")
    assert len(result_log.counts) == 120 and set(result_log.counts.values()) == {1}  # each job stored once
    results = [json.loads(broker.get(f"celery-task-meta-{job}"))["result"] for job in result_log.counts]
    assert any(r["attempt"] >= 2 and r["worker"].startswith("survivor@") for r in results)  # the frozen group


def test_files_in_s3(tmp_path, redis_server, start_worker, s3_server, serve) -> None:
    start_worker(redis_server.url).wait_ready()
    server = serve(redis_server.url, **{"files-dir": f"s3://{S3_BUCKET}/serve", "s3-endpoint-url": s3_server.endpoint})
    client = server.client()
    source = write_jsonl(tmp_path / "in.jsonl", [chat_line(f"r{i}", f"hi {i}") for i in range(4)] +
                         [chat_line("x", "hi", model="nope")])
    file_id = upload(client, source)
    s3 = s3_server.client()
    assert s3.get_object(Bucket=S3_BUCKET, Key=f"serve/{file_id}")["Body"].read() == source.read_bytes()
    assert client.files.content(file_id).content == source.read_bytes()
    batch = client.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h")
    done = wait_status(client, batch.id, ("completed", "failed", "cancelled", "expired"), 120)
    assert done.status == "completed", done.errors
    finished, errors = outcome_ids(client, done)
    assert finished == [f"r{i}" for i in range(4)] and [e["custom_id"] for e in errors] == ["x"]
    keys = {o["Key"] for o in s3.list_objects_v2(Bucket=S3_BUCKET, Prefix="serve/")["Contents"]}
    assert keys == {f"serve/{file_id}", f"serve/{done.output_file_id}", f"serve/{done.error_file_id}"}
    assert s3.get_object(Bucket=S3_BUCKET, Key=f"serve/{done.output_file_id}")["Body"].read() == \
        client.files.content(done.output_file_id).content
    assert not (tmp_path / "files").exists()  # nothing kept on local disk
    client.files.delete(file_id)
    assert f"serve/{file_id}" not in {o["Key"] for o in s3.list_objects_v2(Bucket=S3_BUCKET, Prefix="serve/")["Contents"]}
    with pytest.raises(openai.NotFoundError):
        client.files.content(file_id)


class Receiver:
    """A real HTTP endpoint that records each webhook delivery (headers, body, whether its signature verifies
    with the `standardwebhooks` library) and answers 500 to the first; the second waits until `release` is
    set, so a test can kill the server while that delivery is in flight."""

    def __init__(self, secret: str) -> None:
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        from standardwebhooks.webhooks import Webhook

        self.deliveries: list[dict[str, Any]] = []
        self.release = threading.Event()
        receiver, verifier = self, Webhook(secret)

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                try:
                    verifier.verify(body, dict(self.headers.items()))
                    verified = True
                except Exception:
                    verified = False
                receiver.deliveries.append({"at": time.time(), "id": self.headers["webhook-id"], "verified": verified,
                                            "body": json.loads(body)})
                number = len(receiver.deliveries)
                if number == 2:
                    receiver.release.wait(30)
                self.send_response(500 if number <= 2 else 200)
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}/hooks"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.release.set()
        self.server.shutdown()


def test_webhooks_are_signed_retried_and_delivered_after_a_server_kill(tmp_path, redis_server, serve) -> None:
    secret = "whsec_" + base64.b64encode(b"0123456789abcdef0123456789abcdef").decode()
    receiver = Receiver(secret)
    try:
        hooks = {"env": {"TOKENMILL_WEBHOOK_SECRET": secret}, "webhook-url": receiver.url, "webhook-timeout": 2}
        first = serve(redis_server.url, **hooks)
        client = first.client()
        bad = upload(client, write_jsonl(tmp_path / "bad.jsonl", ["{not json"]))
        batch = client.batches.create(input_file_id=bad, endpoint="/v1/chat/completions", completion_window="24h")
        assert wait_status(client, batch.id, ("completed", "failed"), 30).status == "failed"
        wait_for(lambda: len(receiver.deliveries) >= 2, 30, "a retry after the first delivery failed")
        first.kill()  # while the second delivery is in flight
        receiver.release.set()
        second = serve(redis_server.url, **hooks)  # any server picks the event up
        wait_for(lambda: len(receiver.deliveries) >= 3, 60, "the delivery by the second server")
        waiting = upload(second.client(), write_jsonl(tmp_path / "in.jsonl", [chat_line("a", "hi")]))
        cancelled = second.client().batches.create(input_file_id=waiting, endpoint="/v1/chat/completions",
                                                   completion_window="24h")  # no worker: it waits
        wait_status(second.client(), cancelled.id, ("in_progress",), 30)
        second.client().batches.cancel(cancelled.id)
        wait_for(lambda: len(receiver.deliveries) >= 4, 30, "the cancelled batch's event")
        time.sleep(3)
    finally:
        receiver.close()
    deliveries = receiver.deliveries
    assert all(d["verified"] for d in deliveries)
    assert len({d["id"] for d in deliveries[:3]}) == 1 and deliveries[3]["id"] != deliveries[0]["id"]
    assert deliveries[1]["at"] - deliveries[0]["at"] >= 0.9  # backed off
    assert [(d["body"]["type"], d["body"]["data"]["id"]) for d in deliveries] == [
        ("batch.failed", batch.id)] * 3 + [("batch.cancelled", cancelled.id)]
    assert len(deliveries) == 4  # each delivered, none again after a 2xx
    assert deliveries[0]["body"]["object"] == "event" and deliveries[0]["body"]["id"] == deliveries[0]["id"]


def test_a_worker_announcement_lapses_without_renewal(redis_server) -> None:
    """A killed worker never withdraws its model: its entry stops counting once its time is up, and is dropped."""
    from tokenmill.queue.served import SERVED_KEY, announce, served_models

    redis = redis_server.client()
    announce(redis, "a@host", "m1", ["tokenmill"], ttl=0.5)
    announce(redis, "b@host", "m2", ["other"], ttl=30)
    seconds, micros = redis.time()
    until = json.loads(redis.hget(SERVED_KEY, "b@host"))["until"]
    assert abs(until - (seconds + micros / 1e6 + 30)) < 2  # Redis's clock, not this host's
    assert served_models(redis, "tokenmill") == {"m1": ["a@host"]}
    assert served_models(redis, "other") == {"m2": ["b@host"]}
    time.sleep(0.6)
    assert served_models(redis, "tokenmill") == {}
    assert redis.hkeys(SERVED_KEY) == [b"b@host"]


def test_a_stopped_announcer_stays_withdrawn(redis_server) -> None:
    """The renewal thread withdraws as it ends, so no renewal in flight can put a stopped worker back."""
    from tokenmill.queue.served import SERVED_KEY, Announcer, served_models

    redis = redis_server.client()
    announcer = Announcer(redis, "w@host", "m1", ["tokenmill"], ttl=0.3)
    announcer.start()
    wait_for(lambda: served_models(redis, "tokenmill"), 10, "the announcement")
    announcer.stop()
    assert not announcer.is_alive()
    time.sleep(0.3)  # three renewal periods
    assert redis.hkeys(SERVED_KEY) == []


def test_the_driver_renews_its_lease_while_it_writes_the_files_and_stops_if_it_lost_it(tmp_path, redis_server) -> None:
    """A driver (in this process, on the real Redis) finishing a batch onto a slow file store: the write outlasts
    the lease twice over, yet no rival can take the lease meanwhile; and a driver whose lease was taken stops
    before it writes a file or a final status. (A real server's finish takes a big batch to be this slow.)"""
    from tokenmill.apps.api.app import CreateBatch, new_batch
    from tokenmill.apps.api.driver import Driver, Stopped
    from tokenmill.apps.api.files import DirectoryStore
    from tokenmill.apps.api.records import Records, lease_key
    from tokenmill.apps.api.settings import ServeSettings

    class SlowStore(DirectoryStore):
        def write_lines(self, file_id: str, lines: Any) -> int:  # 50 ms a line: 40 lines take 2 s
            return super().write_lines(file_id, (time.sleep(0.05) or line for line in lines))

    settings = ServeSettings(broker_url=redis_server.url, lease_seconds=1, files_dir=str(tmp_path / "files"))
    records, store = Records(settings.backend_url), SlowStore(settings.files_dir)

    def cancelled_batch() -> str:
        """A batch of 40 lines cancelled before it ran: driving it validates the file and writes 40 error lines."""
        store.write_lines("file-input", [json.dumps(chat_line(f"r{i}", "hi")).encode() + b"\n" for i in range(40)])
        batch = new_batch(CreateBatch(input_file_id="file-input", endpoint="/v1/chat/completions",
                                       completion_window="24h"), 86400)
        records.add_batch("alice", batch)
        records.set_field(batch["id"], "cancel", "cancel")
        records.update(batch["id"], lambda b: b.update(status="cancelling"))
        return batch["id"]

    def drive(batch_id: str, token: str, during: Callable[[], Any]) -> tuple[list[Any], list[BaseException]]:
        assert records.take_lease(batch_id, token, settings.lease_seconds)
        driver, raised = Driver(batch_id, token, settings, records, store, threading.Event()), []
        thread = threading.Thread(target=lambda: raised.extend(_raised(driver.drive)))
        thread.start()
        seen = []
        while thread.is_alive():
            seen.append(during())
            time.sleep(0.05)
        return seen, raised

    renewed = cancelled_batch()
    began = time.monotonic()
    taken, raised = drive(renewed, "driver", lambda: records.take_lease(renewed, "rival", settings.lease_seconds))
    assert time.monotonic() - began >= 2 * settings.lease_seconds and raised == []
    assert not any(taken)  # no rival got the lease
    done = records.batch(renewed)
    assert done["status"] == "cancelled" and done["request_counts"] == {"total": 40, "completed": 0, "failed": 40}
    assert len(b"".join(store.chunks(done["error_file_id"])).splitlines()) == 40

    stolen = cancelled_batch()
    began = time.monotonic()
    _, raised = drive(stolen, "driver", lambda: records.redis.set(lease_key(stolen), "rival", px=60_000)
                      if time.monotonic() - began > 0.3 else None)  # a rival takes it over mid-write
    assert [type(e) for e in raised] == [Stopped] and time.monotonic() - began < 2
    assert records.batch(stolen)["status"] == "cancelling"
    assert sorted(p.name for p in (tmp_path / "files").iterdir()) == sorted(
        ["file-input", f"file-{renewed.removeprefix('batch_')}-errors"])  # no file, not even a partial one


def _raised(call: Callable[[], Any]) -> list[BaseException]:
    try:
        call()
    except BaseException as exc:
        return [exc]
    return []


def _chunked_upload(port: int, authorization: str | None, megabytes: int) -> tuple[str, int]:
    """A chunked `POST /v1/files` (no Content-Length to check first) of up to `megabytes` MiB, sent a MiB at a time
    until the server answers: its status line, and how many MiB had been sent by then."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        head = ("--B\r\nContent-Disposition: form-data; name=\"purpose\"\r\n\r\nbatch\r\n--B\r\nContent-Disposition: "
                "form-data; name=\"file\"; filename=\"a.jsonl\"\r\nContent-Type: application/octet-stream\r\n\r\n")
        sock.sendall(("POST /v1/files HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n"
                      "Content-Type: multipart/form-data; boundary=B\r\n"
                      + (f"Authorization: {authorization}\r\n" if authorization else "") + "\r\n").encode())
        block = b"A" * (1 << 20)
        sent = 0
        try:
            for piece in [head.encode()] + [block] * megabytes + [b"\r\n--B--\r\n"]:
                if select.select([sock], [], [], 0.05)[0]:
                    break
                sock.sendall(b"%x\r\n%s\r\n" % (len(piece), piece))
                sent += piece is block
            else:
                sock.sendall(b"0\r\n\r\n")
        except OSError:  # the server answered and closed while this was sending
            pass
        return sock.recv(4096).split(b"\r\n", 1)[0].decode(), sent


def test_an_upload_is_refused_before_its_body_is_read(tmp_path, redis_server, serve) -> None:
    """Without a key, or past the upload limit, a `POST /v1/files` is answered as soon as that is known: the key
    before any of the body is read, the size once the limit is passed, whatever the body's length (a chunked request
    has no Content-Length), so nobody can fill the server's disk with uploads it refuses."""
    server = serve(redis_server.url, **{"max-upload-bytes": 4096})
    status, sent = _chunked_upload(server.port, None, 64)
    assert status.endswith("401 Unauthorized") and sent <= 2, (status, sent)
    status, sent = _chunked_upload(server.port, "Bearer wrong-key", 64)
    assert status.endswith("401 Unauthorized") and sent <= 2, (status, sent)
    status, sent = _chunked_upload(server.port, f"Bearer {KEYS['alice']}", 64)
    assert status.endswith("413 Request Entity Too Large") and sent <= 2, (status, sent)
    client = server.client()
    with pytest.raises(openai.APIStatusError) as too_big:  # any other body is cut at 1 MiB
        client.batches.create(input_file_id="file-x", endpoint="/v1/chat/completions", completion_window="24h",
                              metadata={"padding": "x" * (2 << 20)})
    assert too_big.value.status_code == 413 and too_big.value.response.json()["error"]["code"] == "request_too_large"
    uploaded = upload(client, write_jsonl(tmp_path / "small.jsonl", [chat_line("a", "hi")]))  # under the limit: taken
    assert client.files.retrieve(uploaded).bytes > 0


def test_a_batch_that_fails_on_the_server_cancels_the_jobs_it_queued(tmp_path, redis_server, serve) -> None:
    """A batch ended `failed` by the server (here: its input file deleted while it ran, then read again by the
    server taking it over) cancels the jobs it had queued: no worker runs them for a batch that has ended."""
    first = serve(redis_server.url)
    client = first.client()
    file_id = upload(client, write_jsonl(tmp_path / "in.jsonl", [chat_line(f"r{i}", "hi") for i in range(5)]))
    batch = client.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h")
    broker = redis_server.client()
    wait_for(lambda: client.batches.retrieve(batch.id).status == "in_progress" and queued(broker), 30,
             "the jobs queued (no worker takes them)")
    client.files.delete(file_id)
    first.kill()
    second = serve(redis_server.url)
    done = wait_status(second.client(), batch.id, ("failed", "completed", "cancelled", "expired"), 60)
    assert done.status == "failed" and done.errors.data[0].code == "server_error"
    message = done.errors.data[0].message  # a reference for the tenant, the details in the server's log only
    assert message.startswith("The server had an error processing this batch (reference ") and "Error" not in message
    assert f"(reference {message.rsplit(' ', 1)[1].rstrip(').')})" in second.log_path.read_text()
    assert len(list(broker.scan_iter(CANCEL_KEY.format(job_id="*")))) == 5


def floats_apart(value: Any) -> tuple[Any, list[float]]:
    """`value` with each float replaced by None, and its floats in order."""
    floats: list[float] = []

    def walk(item: Any) -> Any:
        if isinstance(item, float):
            floats.append(item)
            return None
        if isinstance(item, dict):
            return {key: walk(v) for key, v in item.items()}
        return [walk(v) for v in item] if isinstance(item, list) else item

    return walk(value), floats


def test_logprobs_through_serve_in_openai_s_shapes_as_tokenmill_batch_writes_them(tmp_path, redis_server, start_worker,
                                                                                   serve) -> None:
    """Chat `logprobs: true` without and with `top_logprobs`, and completions `logprobs: N`, through the SDK: the
    output lines parse as the SDK's types, each token with its text and own bytes from the workers, the very lines
    `tokenmill batch --broker` writes and the tokens the embedded engine gives."""
    from openai.types import Completion

    start_worker(redis_server.url).wait_ready()
    client = serve(redis_server.url).client()
    chats = [chat_line("plain", "héllo", logprobs=True), chat_line("top", "héllo", logprobs=True, top_logprobs=3)]
    texts = [{"custom_id": "text", "method": "POST", "url": "/v1/completions", "body": {
        "model": "builtin:tiny", "prompt": "Once upon", "max_tokens": 6, "temperature": 0, "logprobs": 2}}]
    for name, endpoint, lines in (("chat", "/v1/chat/completions", chats), ("text", "/v1/completions", texts)):
        source = write_jsonl(tmp_path / f"{name}.jsonl", lines)
        created = client.batches.create(input_file_id=upload(client, source), endpoint=endpoint, completion_window="24h")
        done = wait_status(client, created.id, ("completed", "failed", "cancelled", "expired"), 120)
        assert done.status == "completed" and (done.request_counts.completed, done.error_file_id) == (len(lines), None)
        output = lines_of(client, done.output_file_id)
        run_batch(str(source), str(tmp_path / f"{name}-broker.jsonl"), broker=redis_server.url, quiet=True)
        broker_lines = [json.loads(line) for line in (tmp_path / f"{name}-broker.jsonl").read_text().splitlines()]
        # the same lines but the time they finished; logprobs to float rounding (the runs batch and cache differently)
        got, want = floats_apart([without_created(line) for line in output]), floats_apart(
            [without_created(line) for line in broker_lines])
        assert got[0] == want[0] and got[1] == pytest.approx(want[1], abs=1e-4)
        run_batch(str(source), str(tmp_path / f"{name}-embedded.jsonl"), model="builtin:tiny", quiet=True,
                  engine_options={"num_kv_blocks": 512})
        embedded = [json.loads(line) for line in (tmp_path / f"{name}-embedded.jsonl").read_text().splitlines()]
        for line, local in zip(output, embedded, strict=True):
            body, want = line["response"]["body"], local["response"]["body"]
            if name == "chat":
                got = ChatCompletion.model_validate(body).choices[0].logprobs.content
                expected = ChatCompletion.model_validate(want).choices[0].logprobs.content
                assert [(e.token, e.bytes, [(t.token, t.bytes) for t in e.top_logprobs]) for e in got] == \
                    [(e.token, e.bytes, [(t.token, t.bytes) for t in e.top_logprobs]) for e in expected]
                assert [e.logprob for e in got] == pytest.approx([e.logprob for e in expected], abs=1e-4)
                assert len(got) == 6 and {len(e.top_logprobs) for e in got} == {3 if line["custom_id"] == "top" else 0}
                assert any(b >= 0x80 for e in got for b in e.bytes)  # a byte of a UTF-8 character keeps its byte
            else:
                got = Completion.model_validate(body).choices[0].logprobs
                expected = Completion.model_validate(want).choices[0].logprobs
                assert (got.tokens, got.text_offset) == (expected.tokens, expected.text_offset) and len(got.tokens) == 6
                assert got.token_logprobs == pytest.approx(expected.token_logprobs, abs=1e-4)
                assert [sorted(top) for top in got.top_logprobs] == [sorted(top) for top in expected.top_logprobs]
