"""`tokenmill serve`'s small guards (issue 57): what it refuses, what it never tells a client, where it never goes."""

from __future__ import annotations

import http.server
import json
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
import redis
from service_fixtures import KEYS, REPO, RedisServer, Server, queued, queued_messages

from tokenmill.apps.api.app import Services
from tokenmill.apps.api.auth import Keys
from tokenmill.apps.api.records import Records, lease_key
from tokenmill.apps.api.settings import ServeSettings
from tokenmill.apps.api.webhooks import Deliverer


@pytest.fixture
def server(tmp_path: Path, redis_server: RedisServer) -> Iterator[Server]:
    started = Server(redis_server.url, tmp_path / "files", tmp_path / "serve.log")
    yield started
    started.close()


def _get(server: Server, path: str) -> int:
    request = urllib.request.Request(f"http://127.0.0.1:{server.port}{path}",
                                     headers={"Authorization": f"Bearer {KEYS['alice']}"})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status
    except urllib.error.HTTPError as exc:
        return exc.code


def test_a_completion_window_past_the_maximum_is_a_400(server: Server, tmp_path: Path) -> None:
    client = server.client()
    path = tmp_path / "in.jsonl"
    path.write_text(json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/completions",
                                "body": {"model": "m", "prompt": "x", "max_tokens": 1}}) + "\n")
    file_id = client.files.create(file=path.open("rb"), purpose="batch").id
    for window, expected in (("100000h", "at most 24h here"), ("1d", "must look like '24h'")):
        with pytest.raises(openai.BadRequestError) as refused:
            client.batches.create(input_file_id=file_id, endpoint="/v1/completions", completion_window=window)
        assert expected in refused.value.message and refused.value.body["param"] == "completion_window"
    assert client.batches.create(input_file_id=file_id, endpoint="/v1/completions", completion_window="24h").id


def test_no_docs_pages_and_no_schema_unless_asked(server: Server) -> None:
    """The docs pages load their scripts from a CDN: never served. The schema only with --openapi-schema."""
    assert [_get(server, path) for path in ("/docs", "/redoc", "/openapi.json")] == [404, 404, 404]


def test_an_internal_error_tells_the_client_a_reference_and_the_log_the_details(
        server: Server, redis_server: RedisServer) -> None:
    redis_server.stop()  # every route now fails inside (the records live in Redis)
    with pytest.raises(openai.InternalServerError) as failed:
        server.client().files.list()
    message = failed.value.message
    assert "The server had an error processing your request (reference " in message
    assert "Connection" not in message and "redis" not in message.lower()  # no details for the client
    reference = message.rsplit("reference ", 1)[1].rstrip(").")
    assert f"internal error on GET /v1/files (reference {reference})" in server.log_path.read_text()


def _silent_listener() -> socket.socket:
    """A TCP port that accepts connections and never answers (a paused server, a dropped route)."""
    listener = socket.create_server(("127.0.0.1", 0), backlog=64)
    held: list[socket.socket] = []

    def accept() -> None:
        while True:
            try:
                held.append(listener.accept()[0])  # kept open, never read or written
            except OSError:
                return

    threading.Thread(target=accept, daemon=True).start()
    return listener


def test_the_api_s_redis_calls_are_bounded_by_the_socket_timeout(tmp_path: Path) -> None:
    """The records' client takes `redis_socket_timeout` from the serve settings: a call on a silent Redis raises
    (after one retry on a new connection) instead of holding the request thread for good."""
    listener = _silent_listener()
    try:
        url = f"redis://127.0.0.1:{listener.getsockname()[1]}/0"
        settings = ServeSettings(broker_url=url, files_dir=str(tmp_path / "files"), api_keys="alice=k",
                                 redis_socket_timeout=0.5)
        records = Services(settings, Keys(settings)).records
        outcome: list[BaseException] = []

        def call() -> None:
            try:
                records.batch("batch_x")
            except BaseException as exc:  # noqa: BLE001 - what the call raised is the test's result
                outcome.append(exc)

        started = time.monotonic()
        caller = threading.Thread(target=call, daemon=True)
        caller.start()
        # two tries of one socket timeout each, and a margin: well below redis-py's own default (5 s, none before 6.0)
        caller.join(timeout=3)
        assert not caller.is_alive(), "a records call on a silent Redis did not return within its bound"
        assert len(outcome) == 1 and isinstance(outcome[0], redis.TimeoutError), outcome
        assert time.monotonic() - started >= 0.5
    finally:
        listener.close()


def test_a_paused_redis_fails_a_request_instead_of_holding_it(redis_server: RedisServer, tmp_path: Path) -> None:
    """A real `tokenmill serve` whose redis-server is SIGSTOPped answers 500 within its socket timeouts."""
    server = Server(redis_server.url, tmp_path / "files", tmp_path / "serve.log",
                    env={"TOKENMILL_REDIS_SOCKET_TIMEOUT": "0.5"})
    try:
        client = server.client()
        client.files.list()  # its connections are open now
        redis_server.process.send_signal(signal.SIGSTOP)
        try:
            started = time.monotonic()
            with pytest.raises(openai.InternalServerError):
                client.with_options(timeout=20).files.list()
            assert time.monotonic() - started < 3  # as above: two tries of one socket timeout, and a margin
        finally:
            redis_server.process.send_signal(signal.SIGCONT)
        assert server.client().files.list().data == []  # and it goes on once Redis answers again (a new connection)
    finally:
        server.close()


def test_no_auth_is_refused_beyond_this_host_and_keys_on_the_command_line_are_warned_of() -> None:
    done = subprocess.run([sys.executable, "-m", "tokenmill.cli", "serve", "--insecure-no-auth", "--host", "0.0.0.0"],
                          cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert "--insecure-no-auth serves only this host" in done.stderr


class _Redirecting(http.server.BaseHTTPRequestHandler):
    hits: list[str] = []

    def do_POST(self) -> None:  # noqa: N802 (http.server's name)
        self.hits.append(self.path)
        self.rfile.read(int(self.headers["Content-Length"]))
        if self.path == "/hook":
            self.send_response(302)
            self.send_header("Location", "/elsewhere")
        else:
            self.send_response(204)  # reached only by a redirect followed
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


def test_a_webhook_is_never_redirected(redis_server: RedisServer) -> None:
    """A 3xx is a failed delivery: the signed event never goes where the receiver points it."""
    receiver = http.server.HTTPServer(("127.0.0.1", 0), _Redirecting)
    threading.Thread(target=receiver.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{receiver.server_port}/hook"
        deliverer = Deliverer(Records(redis_server.url), url, "whsec_" + "MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw",
                              5.0, 3, threading.Event())
        assert deliverer.post("evt_1", b'{"type": "batch.completed"}') == "HTTP 302"
        assert _Redirecting.hits == ["/hook"]
    finally:
        receiver.shutdown()


def test_a_key_past_its_rate_gets_429_with_retry_after_and_the_others_go_on(redis_server: RedisServer,
                                                                            tmp_path: Path) -> None:
    server = Server(redis_server.url, tmp_path / "files", tmp_path / "serve.log", **{"rate-limit": 6, "rate-burst": 3})
    try:
        codes = [_get(server, "/v1/files") for _ in range(5)]
        assert codes[:3] == [200, 200, 200] and codes[3:] == [429, 429]  # a burst of 3, then one every 10 s
        with pytest.raises(openai.RateLimitError) as limited:
            server.client().with_options(max_retries=0).files.list()
        assert limited.value.response.headers["Retry-After"] in {"9", "10"}
        assert limited.value.body["code"] == "rate_limit_exceeded"
        assert server.client("bob").files.list().data == []  # another key's bucket is its own
    finally:
        server.close()


def _lines(path: Path, lines: list[dict]) -> Path:
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def _chat(custom_id: str, **body: object) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, **body}}


def _ended(client: openai.OpenAI, batch_id: str) -> object:
    from service_fixtures import wait_for

    return wait_for(lambda: (b := client.batches.retrieve(batch_id)).status in ("failed", "completed") and b, 60,
                    f"batch {batch_id} to end")


def test_user_strings_are_never_copied_whole_into_errors_or_jobs(redis_server: RedisServer, tmp_path: Path) -> None:
    """A 500-character custom_id repeated on 101 lines once made a 50 MB batch object (its errors quoted the id each
    time) and its jobs each carried it: errors quote at most a few dozen characters, jobs a 64-character label, and an
    id past 512 characters is refused."""
    server = Server(redis_server.url, tmp_path / "files", tmp_path / "serve.log")
    try:
        client = server.client()
        long_id = "x" * 500
        upload = _lines(tmp_path / "dup.jsonl", [_chat(long_id) for _ in range(101)])
        file_id = client.files.create(file=upload.open("rb"), purpose="batch").id
        failed = _ended(client, client.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions",
                                                      completion_window="24h").id)
        assert failed.status == "failed" and len(failed.errors.data) == 100
        assert len(json.dumps(failed.model_dump())) < 30_000 and long_id not in json.dumps(failed.model_dump())
        too_long = _lines(tmp_path / "long.jsonl", [_chat("y" * 513)])
        file_id = client.files.create(file=too_long.open("rb"), purpose="batch").id
        refused = _ended(client, client.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions",
                                                       completion_window="24h").id)
        assert refused.errors.data[0].message == "line 1: custom_id: at most 512 characters, got 513"
        source = _lines(tmp_path / "ok.jsonl", [_chat(long_id + str(i)) for i in range(3)])
        file_id = client.files.create(file=source.open("rb"), purpose="batch").id
        client.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h")
        broker = redis_server.client()
        from service_fixtures import wait_for

        wait_for(lambda: queued(broker), 30, "the jobs queued (no worker takes them)")
        messages = b"".join(queued_messages(broker))
        assert long_id.encode() not in messages and b'"row":"' + b"x" * 64 + b'"' in _bodies(messages)
    finally:
        server.close()


def _bodies(items: bytes) -> bytes:
    import base64

    return b"".join(base64.b64decode(json.loads(line)["body"]) for line in items.replace(b"}{", b"}\n{").splitlines())


def test_n_counts_against_the_line_limit(redis_server: RedisServer, tmp_path: Path) -> None:
    server = Server(redis_server.url, tmp_path / "files", tmp_path / "serve.log", **{"max-batch-lines": 10})
    try:
        client = server.client()
        upload = _lines(tmp_path / "n.jsonl", [_chat(f"r{i}", n=4) for i in range(4)])  # 4 lines, 16 completions
        file_id = client.files.create(file=upload.open("rb"), purpose="batch").id
        failed = _ended(client, client.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions",
                                                      completion_window="24h").id)
        assert failed.status == "failed" and failed.errors.data[0].code == "too_many_lines"
        assert "asks for 16 completions" in failed.errors.data[0].message
    finally:
        server.close()


def test_drivers_are_bounded_and_shared_by_the_tenants_in_turn(redis_server: RedisServer, tmp_path: Path) -> None:
    """With two drivers, alice's seven batches and bob's one (no worker: none ends): alice's first two get them,
    then bob's takes one back from alice's second (which goes on later from its record), the rest wait without a
    thread each; an eighth active batch of alice's is a 429."""
    import time

    from service_fixtures import wait_for

    server = Server(redis_server.url, tmp_path / "files", tmp_path / "serve.log",
                    **{"max-drivers": 2, "max-active-batches": 7})
    try:
        alice, bob = server.client(), server.client("bob")

        def create(client: openai.OpenAI, name: str) -> str:
            path = _lines(tmp_path / f"{name}.jsonl", [_chat(f"{name}-{i}") for i in range(2)])
            file_id = client.files.create(file=path.open("rb"), purpose="batch").id
            return client.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions",
                                         completion_window="24h").id

        def threads() -> int:
            return len(list(Path(f"/proc/{server.process.pid}/task").iterdir()))

        mine = [create(alice, "a0")]
        wait_for(lambda: alice.batches.retrieve(mine[0]).status == "in_progress", 30, "alice's first batch driven")
        one_driver = threads()
        mine += [create(alice, f"a{i}") for i in range(1, 7)]
        with pytest.raises(openai.RateLimitError) as refused:
            create(alice, "a7")
        assert refused.value.body["code"] == "too_many_active_batches"
        wait_for(lambda: alice.batches.retrieve(mine[1]).status == "in_progress", 30, "alice's second batch driven")
        theirs = create(bob, "b0")
        wait_for(lambda: bob.batches.retrieve(theirs).status == "in_progress", 30, "bob's batch driven")
        time.sleep(2)  # a few supervisor scans: alice's waiting batches get no driver meanwhile
        assert [alice.batches.retrieve(b).status for b in mine[2:]] == ["validating"] * 5
        leased = [bool(redis_server.client().exists(lease_key(b))) for b in (*mine, theirs)]
        assert leased == [True] + [False] * 6 + [True]  # alice's second handed its driver to bob's batch
        assert threads() <= one_driver + 2  # the second driver (and room for one more request thread), not 7 more
    finally:
        server.close()


def test_in_turns_takes_each_tenant_s_oldest_first() -> None:
    from tokenmill.apps.api.driver import in_turns

    assert list(in_turns({"b": ["b1"], "a": ["a1", "a2", "a3"], "c": []})) == ["a1", "b1", "a2", "a3"]


def test_files_and_final_batches_expire_and_running_ones_do_not(redis_server: RedisServer, tmp_path: Path) -> None:
    """Everything a tenant leaves behind goes in time: a file (its record, index entry and bytes) after
    `--file-expires`, a final batch's record after `--batch-expires`; a batch still running stays, and so does its
    input file."""
    from service_fixtures import wait_for

    server = Server(redis_server.url, tmp_path / "files", tmp_path / "serve.log",
                    **{"file-expires": 3, "batch-expires": 2})
    try:
        client = server.client()
        bad = _lines(tmp_path / "bad.jsonl", [_chat("a"), _chat("a")])  # a repeated custom_id: fails validation
        bad_file = client.files.create(file=bad.open("rb"), purpose="batch")
        assert bad_file.expires_at == bad_file.created_at + 3
        failed = _ended(client, client.batches.create(input_file_id=bad_file.id, endpoint="/v1/chat/completions",
                                                      completion_window="24h").id)
        good_file = client.files.create(file=_lines(tmp_path / "good.jsonl", [_chat("b")]).open("rb"), purpose="batch")
        good = good_file.id
        running = client.batches.create(input_file_id=good, endpoint="/v1/chat/completions", completion_window="24h",
                                        extra_body={"output_expires_after": {"anchor": "created_at", "seconds": 3600}})
        with pytest.raises(openai.BadRequestError):
            client.batches.create(input_file_id=good, endpoint="/v1/chat/completions", completion_window="24h",
                                  extra_body={"output_expires_after": {"anchor": "created_at", "seconds": 5}})
        stored = tmp_path / "files"
        assert any(stored.iterdir())

        def gone(get: object) -> bool:
            try:
                get()
            except openai.NotFoundError:
                return True
            return False

        wait_for(lambda: gone(lambda: client.batches.retrieve(failed.id)), 30, "the failed batch to expire")
        wait_for(lambda: gone(lambda: client.files.retrieve(bad_file.id)), 30, "the file to expire")
        assert [b.id for b in client.batches.list()] == [running.id]  # running: kept past --batch-expires
        import time

        time.sleep(max(0.0, good_file.expires_at + 2 - time.time()))  # past its time, and a sweep or two
        assert client.files.retrieve(good).id == good  # the running batch's input: kept past --file-expires
        assert bad_file.id not in [f.id for f in client.files.list()]
        assert not any(bad_file.id in path.name for path in stored.rglob("*"))
        assert not redis_server.client().exists(f"tokenmill:api:batch:{failed.id}")
    finally:
        server.close()
