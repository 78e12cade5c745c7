"""`tokenmill serve`'s resources bounded whatever the load (issue 57): Redis connections in pools that wait,
threads, HTTP connections, descriptors; with a real redis-server, real `tokenmill serve` processes and a real worker."""

from __future__ import annotations

import json
import os
import resource
import socket
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import redis
from service_fixtures import KEYS, RedisServer, Server, socket_ports, wait_for

from tokenmill.apps.api.records import Records
from tokenmill.apps.api.resources import ACCEPT_FAILED
from tokenmill.apps.api.settings import ServeSettings

FINAL = ("completed", "failed", "cancelled", "expired")


def _one_line(path: Path, content: str) -> Path:
    body = {"model": "builtin:tiny", "messages": [{"role": "user", "content": content}], "max_tokens": 2,
            "temperature": 0}
    line = {"custom_id": "r0", "method": "POST", "url": "/v1/chat/completions", "body": body}
    path.write_text(json.dumps(line) + "\n")
    return path


def _server_connections(pid: int, redis_server: RedisServer, subscribed: bool = False) -> int:
    """The Redis clients whose address is a socket of process `pid` (`subscribed`: those subscribed to a channel)."""
    ports = socket_ports(pid)
    return sum(int(client["addr"].rsplit(":", 1)[1]) in ports and (not subscribed or int(client["sub"]) > 0)
               for client in redis_server.client().client_list())


def _threads(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/task"))


def _status(port: int, key: str | None = None) -> int:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/models", headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status
    except urllib.error.HTTPError as exc:
        return exc.code


def test_one_tenant_s_many_batches_hold_bounded_connections_and_threads_and_another_s_complete(
        redis_server: RedisServer, start_worker, tmp_path: Path) -> None:
    """Alice's 40 batches with no worker (each driven one waits for its results): the server's Redis connections stay
    within `redis_connections + 2 * max_publishers`, the drivers' waits on one subscription (one connection each
    before), and its threads within the drivers, the request threads and its own; then a worker, and every one of
    bob's batches (and alice's) completes, none failed for a connection."""
    flags = {"max-drivers": 4, "request-threads": 4, "redis-connections": 9, "max-publishers": 1,
             "max-active-batches": 50, "rate-limit": 100000, "rate-burst": 10000}
    server = Server(redis_server.url, tmp_path / "files", tmp_path / "serve.log", **flags)
    try:
        pid = server.process.pid
        alice, bob = server.client(), server.client("bob")
        file_id = alice.files.create(file=_one_line(tmp_path / "a.jsonl", "alice").open("rb"), purpose="batch").id
        peaks = {"connections": 0, "subscribed": 0, "threads": 0}
        sampling = threading.Event()

        def sample() -> None:
            while not sampling.is_set():
                peaks["connections"] = max(peaks["connections"], _server_connections(pid, redis_server))
                peaks["subscribed"] = max(peaks["subscribed"], _server_connections(pid, redis_server, subscribed=True))
                peaks["threads"] = max(peaks["threads"], _threads(pid))
                sampling.wait(0.05)

        sampler = threading.Thread(target=sample)
        sampler.start()
        try:
            # more requests at once than request threads; past alice's share of them (request_threads - 1) a 429,
            # which the SDK retries after its Retry-After
            patient = alice.with_options(max_retries=30)
            with ThreadPoolExecutor(8) as pool:
                mine = list(pool.map(lambda _: patient.batches.create(
                    input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h").id, range(40)))
            wait_for(lambda: sum(alice.batches.retrieve(b).status == "in_progress" for b in mine) >= 4, 30,
                     "four of alice's batches driven")
            time.sleep(2)  # the drivers wait for results, each on its subscription
        finally:
            sampling.set()
            sampler.join()
        assert peaks["connections"] <= 9 + 2 * 1, peaks
        assert peaks["subscribed"] == 1, peaks  # the four drivers' waits share it
        assert peaks["threads"] <= 4 + 4 + 4, peaks  # drivers, request threads; the loop's, the supervisor's, the results
        # subscription's reader, one more
        start_worker(redis_server.url).wait_ready()
        bob_file = bob.files.create(file=_one_line(tmp_path / "b.jsonl", "bob").open("rb"), purpose="batch").id
        theirs = [bob.batches.create(input_file_id=bob_file, endpoint="/v1/chat/completions",
                                     completion_window="24h").id for _ in range(3)]
        wait_for(lambda: all(bob.batches.retrieve(b).status in FINAL for b in theirs), 120, "bob's batches")
        assert [bob.batches.retrieve(b).status for b in theirs] == ["completed"] * 3
        wait_for(lambda: all(alice.batches.retrieve(b).status in FINAL for b in mine), 240, "alice's batches")
        assert {alice.batches.retrieve(b).status for b in mine} == {"completed"}
        log = server.log_path.read_text()
        assert "Too many connections" not in log and "MaxConnectionsError" not in log
    finally:
        server.close()


def test_a_call_finding_the_pool_taken_waits_for_a_connection_and_gives_up_after_the_timeout(
        redis_server: RedisServer) -> None:
    records = Records(redis_server.url, socket_timeout=1.0, max_connections=1)
    pool = records.redis.connection_pool
    held = pool.get_connection()
    threading.Timer(0.5, pool.release, [held]).start()
    started = time.monotonic()
    assert records.redis.ping()  # redis-py's default pool raised MaxConnectionsError here at once
    assert time.monotonic() - started >= 0.4
    held = pool.get_connection()
    started = time.monotonic()
    with pytest.raises(redis.ConnectionError):
        records.redis.ping()
    assert 0.9 <= time.monotonic() - started < 5  # bounded: the pool timeout (retried once)
    pool.release(held)


def test_redis_connections_must_exceed_the_drivers_and_request_threads() -> None:
    with pytest.raises(ValueError, match="must exceed"):
        ServeSettings(max_drivers=40, request_threads=24, redis_connections=64)
    assert ServeSettings(max_drivers=40, request_threads=23, redis_connections=64).redis_connections == 64


def test_the_open_files_limit_is_raised_to_the_hard_limit_at_start(redis_server: RedisServer, tmp_path: Path) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or hard <= 300:
        pytest.skip(f"a finite hard limit above 300 is needed (hard: {hard})")
    resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))  # the server inherits 256
    try:
        server = Server(redis_server.url, tmp_path / "files", tmp_path / "serve.log")
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    try:
        limits = Path(f"/proc/{server.process.pid}/limits").read_text()
        line = next(line for line in limits.splitlines() if line.startswith("Max open files"))
        assert line.split()[3:5] == [str(hard), str(hard)]
        assert f"open files limit {hard} (hard {hard})" in server.log_path.read_text()
    finally:
        server.close()


def test_out_of_descriptors_the_accept_failure_is_logged_once_a_second_and_the_server_answers_again(
        redis_server: RedisServer, tmp_path: Path) -> None:
    """With 64 descriptors and 150 connections opened, CPython's accept loop fails once per connection waiting at
    every retry (it logged `ACCEPT_FAILED` ~2000 times a second with uvicorn's backlog); the server logs it once a
    second, and serves again once the connections close."""
    server = Server(redis_server.url, tmp_path / "files", tmp_path / "serve.log")
    try:
        resource.prlimit(server.process.pid, resource.RLIMIT_NOFILE, (64, 64))
        before = server.log_path.read_text().count(ACCEPT_FAILED)
        sockets = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(150)]
        try:
            time.sleep(4)
            log = server.log_path.read_text()
            reports = log.count(ACCEPT_FAILED) - before
            assert 1 <= reports <= 6, reports
            assert "more since the last report" in log
        finally:
            for sock in sockets:
                sock.close()
        wait_for(lambda: _status(server.port, KEYS["alice"]) == 200, 20, "the server answering again")
    finally:
        server.close()


def _cpu_seconds(pid: int) -> float:
    """The process's CPU time so far, user and system, all threads."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_out_of_descriptors_the_server_pauses_accepting_instead_of_spinning_and_serves_again(
        redis_server: RedisServer, tmp_path: Path) -> None:
    """With 64 descriptors and 150 connections waiting to be accepted, the server's CPU stays near its idle level
    (CPython's accept loop retried every waiting connection each second, ~2,000 failed accepts, exception handler
    calls and timers a second with uvicorn's backlog); once the connections close it serves again."""
    server = Server(redis_server.url, tmp_path / "files", tmp_path / "serve.log")
    pid = server.process.pid
    try:
        time.sleep(1)  # settled after start
        before = _cpu_seconds(pid)
        time.sleep(4)
        idle = _cpu_seconds(pid) - before
        resource.prlimit(pid, resource.RLIMIT_NOFILE, (64, 64))
        sockets = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(150)]
        try:
            time.sleep(1)  # every descriptor taken, the rest waiting in the listen backlog
            before = _cpu_seconds(pid)
            time.sleep(4)
            exhausted = _cpu_seconds(pid) - before
        finally:
            for sock in sockets:
                sock.close()
        assert exhausted <= idle + 0.08, (exhausted, idle)  # 2% of the 4 s, over idle
        wait_for(lambda: _status(server.port, KEYS["alice"]) == 200, 20, "the server answering again")
    finally:
        server.close()
