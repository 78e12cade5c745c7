"""`tokenmill serve`'s bounds on what a tenant keeps and reads back: batch records, stored files at batch create,
results outliving the completion window, no internal path and no user string whole in an error.

A real `tokenmill serve` on a real redis-server, reached through the `openai` SDK; no worker, so a batch ends only when
it is cancelled (or fails validation)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import openai
import pytest
from service_fixtures import REPO, RedisServer, create_batch, free_port, upload_batch_file, wait_for

from tokenmill.apps.api.driver import EXPIRE_CHUNK, Supervisor
from tokenmill.apps.api.files import DirectoryStore
from tokenmill.apps.api.records import EXPIRING, Records
from tokenmill.apps.api.settings import RESULT_MARGIN, ServeSettings
from tokenmill.apps.batch import QUOTED_CHARS

FINAL = ("completed", "failed", "cancelled", "expired")


def _chat(custom_id: str, max_tokens: int = 1) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": max_tokens}}


def _final(client: openai.OpenAI, batch_id: str) -> object:
    return wait_for(lambda: (b := client.batches.retrieve(batch_id)).status in FINAL and b, 60,
                    f"batch {batch_id} final")


def test_results_outlive_the_longest_completion_window() -> None:
    """A batch re-driven (restart, takeover, hand-back) reads its finished jobs' stored results: with the shipped
    defaults they outlive any window a batch may ask for, and a configuration where they would not is refused."""
    defaults = ServeSettings()
    assert defaults.max_completion_window + RESULT_MARGIN <= defaults.result_expires
    with pytest.raises(ValueError, match="TOKENMILL_MAX_COMPLETION_WINDOW .* TOKENMILL_RESULT_EXPIRES"):
        ServeSettings(result_expires=3600, max_completion_window=7200)
    with pytest.raises(ValueError, match="TOKENMILL_MAX_COMPLETION_WINDOW .* TOKENMILL_RESULT_EXPIRES"):
        ServeSettings(result_expires=86400, max_completion_window=86400)  # no margin for a batch finalized late


def test_serve_refuses_to_start_when_results_expire_before_the_window(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TOKENMILL_")}
    env.update(PYTHONPATH=str(REPO), TOKENMILL_RESULT_EXPIRES="3600")
    done = subprocess.run([sys.executable, "-m", "tokenmill.cli", "serve", "--port", str(free_port()),
                           "--api-keys", "alice=sk-alice-key", "--max-completion-window", "7200"],
                          cwd=REPO, capture_output=True, text=True, timeout=60, env=env)
    named = [line for line in done.stderr.splitlines()
             if "TOKENMILL_MAX_COMPLETION_WINDOW (7200)" in line and "TOKENMILL_RESULT_EXPIRES (3600)" in line]
    assert done.returncode == 2 and named and "lower the window, or raise" in named[0], done.stderr


@pytest.mark.parametrize("bound", ["files", "bytes"])
def test_a_batch_is_refused_while_its_tenant_is_at_its_stored_quota(start_server, tmp_path: Path, bound: str) -> None:
    """A batch's output and error files are its tenant's stored files: once a batch's error file takes alice to the
    bound, creating another is the upload's 400 (`file_storage_limit_exceeded`); bob's room is his own."""
    size = len("".join(json.dumps(_chat(f"a{i}", max_tokens=-1)) + "\n" for i in range(10)))
    flags = {"max-stored-files": 2} if bound == "files" else {"max-stored-bytes": size + 100}
    server = start_server(**flags)
    alice, bob = server.client(), server.client("bob")
    file_id = upload_batch_file(alice, tmp_path / "a.jsonl", [_chat(f"a{i}", max_tokens=-1) for i in range(10)])
    assert _final(alice, create_batch(alice, file_id)).error_file_id  # refused lines: the error file, no worker needed
    with pytest.raises(openai.BadRequestError) as refused:
        create_batch(alice, file_id)
    body = refused.value.body
    assert body["code"] == "file_storage_limit_exceeded" and body["type"] == "invalid_request_error"
    assert "TOKENMILL_MAX_STORED_FILES" in body["message"] and "output files" in body["message"]
    with pytest.raises(openai.BadRequestError) as upload:  # the same answer as an upload past the quota
        upload_batch_file(alice, tmp_path / "b.jsonl", [_chat("b")])
    assert upload.value.body["code"] == body["code"] and upload.value.status_code == refused.value.status_code
    create_batch(bob, upload_batch_file(bob, tmp_path / "bob.jsonl", [_chat("b")]))


def test_batch_records_are_bounded_per_tenant(start_server, tmp_path: Path) -> None:
    """Final batches' records count too (each is kept TOKENMILL_BATCH_EXPIRES): past the bound a create is a 429."""
    server = start_server(env={"TOKENMILL_MAX_BATCH_RECORDS": "3"})
    alice, bob = server.client(), server.client("bob")
    file_id = upload_batch_file(alice, tmp_path / "a.jsonl", [_chat("a")])
    for _ in range(3):
        batch = create_batch(alice, file_id)
        alice.batches.cancel(batch)
        _final(alice, batch)
    with pytest.raises(openai.RateLimitError) as refused:
        create_batch(alice, file_id)
    body = refused.value.body
    assert body["code"] == "too_many_batch_records" and body["type"] == "requests" and body["param"] is None
    assert "has 3 batch records" in body["message"] and "TOKENMILL_MAX_BATCH_RECORDS" in body["message"]
    assert len(alice.batches.list().data) == 3
    create_batch(bob, upload_batch_file(bob, tmp_path / "bob.jsonl", [_chat("b")]))


def test_expire_deletes_everything_due_in_one_scan(redis_server: RedisServer, tmp_path: Path) -> None:
    """More than one chunk due at once (a burst of expiries) is deleted by one scan, not one chunk a scan."""
    settings = ServeSettings(broker_url=redis_server.url, files_dir=str(tmp_path / "files"))
    records = Records(redis_server.url)
    count = 2 * EXPIRE_CHUNK + 50
    for i in range(count):
        records.set_field(f"batch_{i}", "tenant", "alice")
        records.expire_later("batch", f"batch_{i}", "alice", -1)
    Supervisor(settings, records, DirectoryStore(settings.files_dir)).expire()
    assert records.redis.zcard(EXPIRING) == 0
    assert not list(records.redis.scan_iter("tokenmill:api:batch:*"))


def test_a_deleted_input_file_fails_its_batch_without_naming_the_store(start_server, tmp_path: Path) -> None:
    """The input deleted before the driver reads it (OpenAI lets a file in use be deleted): the batch fails with a
    message and a reference; the store's path is in the server's log under that reference, never in `errors`."""
    server = start_server(**{"max-drivers": 1})
    alice = server.client()
    stuck = create_batch(alice, upload_batch_file(alice, tmp_path / "a.jsonl", [_chat("a")]))  # no worker: holds the one driver
    wait_for(lambda: alice.batches.retrieve(stuck).status == "in_progress", 30, "first batch driven")
    second_file = upload_batch_file(alice, tmp_path / "b.jsonl", [_chat("b")])
    second = create_batch(alice, second_file)
    alice.files.delete(second_file)
    alice.batches.cancel(stuck)
    done = _final(alice, second)
    error = done.errors.data[0]
    store = str(tmp_path / "files")
    assert done.status == "failed" and error.code == "invalid_file", done
    assert store not in error.message and second_file not in error.message
    assert error.message.startswith("the input file could not be read") and "reference " in error.message
    reference = error.message.rsplit("reference ", 1)[1].rstrip(").")
    logged = [line for line in server.log_path.read_text().splitlines() if f"(reference {reference})" in line]
    assert logged and second_file in logged[0]
    assert store in server.log_path.read_text()  # the details: the log's


_LONG = "x" * 100_000
_BATCH = {"endpoint": "/v1/chat/completions", "completion_window": "24h"}
#: Each field a user sets that an error quotes: the request that makes the error (a path kept under the request
#: line's limit).
_QUOTING = {
    "endpoint": lambda c, f, p: c.batches.create(input_file_id=f, **{**_BATCH, "endpoint": "/v1/" + _LONG}),
    "input_file_id": lambda c, f, p: c.batches.create(input_file_id="file-" + _LONG, **_BATCH),
    "completion_window": lambda c, f, p: c.batches.create(
        input_file_id=f, **{**_BATCH, "completion_window": "1" * 31 + "h" + _LONG}),
    "metadata": lambda c, f, p: c.batches.create(input_file_id=f, **_BATCH, metadata={"k" + _LONG: "v"}),
    "purpose": lambda c, f, p: c.files.create(file=p.open("rb"), purpose="p" + _LONG),
    "file id": lambda c, f, p: c.files.retrieve("file-" + _LONG[:4000]),
    "batch id": lambda c, f, p: c.batches.retrieve("batch_" + _LONG[:4000]),
}


@pytest.mark.parametrize("field", list(_QUOTING))
def test_user_strings_in_error_messages_are_cut(start_server, tmp_path: Path, field: str) -> None:
    """A user string an error quotes is cut to QUOTED_CHARS, whatever its size (a body may have 1 MB)."""
    alice = start_server().client()
    file_id = upload_batch_file(alice, tmp_path / "a.jsonl", [_chat("a")])
    with pytest.raises(openai.APIStatusError) as refused:
        _QUOTING[field](alice, file_id, tmp_path / "a.jsonl")
    message = refused.value.body["message"]
    assert refused.value.status_code in (400, 404) and "xxx..." in message, message[:300]
    assert len(message) < QUOTED_CHARS + 200, (len(message), message[:300])
