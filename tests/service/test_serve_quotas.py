"""`tokenmill serve`'s per-tenant bounds (issue 57 item 1): queued jobs, queued prompt bytes, stored files and bytes.

A real `tokenmill serve` on a real redis-server, reached through the `openai` SDK; no worker, so a batch ends only when
it is cancelled (or fails validation)."""

from __future__ import annotations

import io
import json
from pathlib import Path

import openai
import pytest
from service_fixtures import RedisServer, create_batch, upload_batch_file, wait_for

from tokenmill.apps.api.quotas import input_usage
from tokenmill.apps.api.records import Records


def _chat(custom_id: str, n: int = 1) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "n": n}}


def _cancelled(client: openai.OpenAI, batch_id: str) -> None:
    client.batches.cancel(batch_id)
    wait_for(lambda: client.batches.retrieve(batch_id).status == "cancelled", 60, f"batch {batch_id} cancelled")


def test_input_usage_counts_choices_inputs_and_line_bytes() -> None:
    chat = json.dumps(_chat("a", n=3)).encode() + b"\n"
    embed = json.dumps({"custom_id": "e", "method": "POST", "url": "/v1/embeddings",
                        "body": {"model": "m", "input": ["x", "y"]}}).encode() + b"\n"
    bad = b"{not json\n"
    assert input_usage(io.BytesIO(chat + b"\n" + embed + bad)) == {
        "jobs": 3 + 2 + 1, "prompt_bytes": 3 * len(chat) + len(embed) + len(bad)}


def test_queued_jobs_are_bounded_per_tenant(start_server, tmp_path: Path) -> None:
    """n counts: two 3-line files of n=2 are 12 jobs, past 10: the second batch is a 429 with Retry-After until the
    first ends; bob's batches are his own; a file past the bound alone is a 400 (waiting cannot help)."""
    server = start_server(**{"max-queued-jobs": 10})
    alice, bob = server.client(), server.client("bob")
    first = upload_batch_file(alice, tmp_path / "a.jsonl", [_chat(f"a{i}", n=2) for i in range(3)])
    second = upload_batch_file(alice, tmp_path / "b.jsonl", [_chat(f"b{i}", n=2) for i in range(3)])
    running = create_batch(alice, first)
    with pytest.raises(openai.RateLimitError) as refused:
        create_batch(alice, second)
    body = refused.value.body
    assert body["code"] == "too_many_queued_jobs" and body["type"] == "requests"
    assert "hold 6 jobs" in body["message"] and "asks for 6" in body["message"] and "10" in body["message"]
    assert "TOKENMILL_MAX_QUEUED_JOBS" in body["message"]
    assert refused.value.response.headers.get("retry-after") == "60"
    create_batch(bob, upload_batch_file(bob, tmp_path / "bob.jsonl", [_chat(f"c{i}", n=2) for i in range(5)]))  # 10: bob's own room
    whole = upload_batch_file(alice, tmp_path / "big.jsonl", [_chat(f"d{i}") for i in range(11)])
    with pytest.raises(openai.BadRequestError) as alone:
        create_batch(alice, whole)
    assert alone.value.body["code"] == "too_many_queued_jobs" and alone.value.body["param"] == "input_file_id"
    assert "retry-after" not in alone.value.response.headers
    _cancelled(alice, running)
    assert create_batch(alice, second)  # the ended batch's jobs no longer count


def test_queued_prompt_bytes_are_bounded_per_tenant(start_server, tmp_path: Path) -> None:
    """Each line's bytes, once per choice: a file of n=2 counts twice its size."""
    once = tmp_path / "once.jsonl"
    once.write_text("".join(json.dumps(_chat(f"a{i}")) + "\n" for i in range(5)))
    twice = [_chat(f"b{i}", n=2) for i in range(2)]
    size = len("".join(json.dumps(line) + "\n" for line in twice))
    limit = once.stat().st_size + 2 * size - 1  # both fit if n were not counted
    server = start_server(**{"max-queued-prompt-bytes": limit})
    alice, bob = server.client(), server.client("bob")
    running = create_batch(alice, alice.files.create(file=once.open("rb"), purpose="batch").id)
    second = upload_batch_file(alice, tmp_path / "twice.jsonl", twice)
    with pytest.raises(openai.RateLimitError) as refused:
        create_batch(alice, second)
    assert refused.value.body["code"] == "too_many_queued_prompt_bytes"
    message = refused.value.body["message"]
    assert f"hold {once.stat().st_size} prompt bytes and this file asks for {2 * size}," in message
    assert refused.value.response.headers.get("retry-after") == "60"
    create_batch(bob, upload_batch_file(bob, tmp_path / "bob.jsonl", twice))
    big = upload_batch_file(alice, tmp_path / "big.jsonl", [_chat(f"c{i}") for i in range(limit // 100)])
    with pytest.raises(openai.BadRequestError) as alone:
        create_batch(alice, big)
    assert alone.value.body["code"] == "too_many_queued_prompt_bytes"
    _cancelled(alice, running)
    assert create_batch(alice, second)


def test_stored_files_and_bytes_are_bounded_per_tenant(start_server, tmp_path: Path) -> None:
    """An upload past either bound is a 400 before it is stored; bob's files are his own; a delete frees room."""
    server = start_server(**{"max-stored-files": 3, "max-stored-bytes": 1000})
    alice, bob = server.client(), server.client("bob")
    big, small = tmp_path / "big.jsonl", tmp_path / "small.jsonl"
    big.write_bytes(b"x" * 400)
    small.write_bytes(b"x" * 10)

    def refused(path: Path) -> dict:
        with pytest.raises(openai.BadRequestError) as caught:
            alice.files.create(file=path.open("rb"), purpose="batch")
        return caught.value.body

    kept = [alice.files.create(file=big.open("rb"), purpose="batch").id for _ in range(2)]
    stored = sorted(p.name for p in (tmp_path / "files").iterdir())
    over_bytes = refused(big)  # 1200 bytes
    assert over_bytes["code"] == "file_storage_limit_exceeded" and over_bytes["param"] == "file"
    assert "stores 2 files of 800 bytes" in over_bytes["message"]
    assert "TOKENMILL_MAX_STORED_BYTES" in over_bytes["message"]
    kept.append(alice.files.create(file=small.open("rb"), purpose="batch").id)
    assert refused(small)["code"] == "file_storage_limit_exceeded"  # a fourth file
    assert len(alice.files.list().data) == 3
    assert sorted(p.name for p in (tmp_path / "files").iterdir()) == sorted(stored + [kept[2]])  # nothing more stored
    assert bob.files.create(file=big.open("rb"), purpose="batch").id
    alice.files.delete(kept[0])
    assert alice.files.create(file=big.open("rb"), purpose="batch").id


def test_expired_files_free_their_room(start_server, tmp_path: Path) -> None:
    server = start_server(**{"max-stored-files": 1, "file-expires": 2})
    client = server.client()
    path = tmp_path / "in.jsonl"
    path.write_bytes(b"x" * 10)
    client.files.create(file=path.open("rb"), purpose="batch")
    with pytest.raises(openai.BadRequestError):
        client.files.create(file=path.open("rb"), purpose="batch")
    wait_for(lambda: not client.files.list().data, 30, "the file to expire")
    assert client.files.create(file=path.open("rb"), purpose="batch").id


def test_stored_totals_count_each_file_once(redis_server: RedisServer) -> None:
    """An output file written again by a driver that reran, or a file deleted by a client and by its expiry at once,
    changes the totals once."""
    records = Records(redis_server.url)
    file = {"id": "file-x", "bytes": 7, "expires_at": 0}
    records.add_file("alice", file)
    records.add_file("alice", file)
    assert records.stored("alice") == {"files": 1, "bytes": 7} and records.stored("bob") == {"files": 0, "bytes": 0}
    records.delete_file("alice", "file-x")
    records.delete_file("alice", "file-x")
    assert records.stored("alice") == {"files": 0, "bytes": 0}
