"""`rediss://` means TLS with the server verified, on every Redis connection tokenmill makes.

A real TLS-only redis-server with a password (its CA made here) carries a job through a real worker:
the broker, the result backend and the worker's own Redis client all speak TLS. A plain TCP listener
standing in for a `rediss://` address must never read the password, from the client (publishing, reading
results, `tokenmill dead-letters`) or from the worker.
"""

from __future__ import annotations

import ssl
import subprocess
import sys
import time
from urllib.parse import quote

import pytest
from pydantic import ValidationError
from service_fixtures import REPO, PlainListener, TlsRedisServer, wait_for

from tokenmill.client import Client
from tokenmill.queue.settings import QueueSettings

PASSWORD = "Secret-tls-password"


def test_a_job_round_trips_through_a_worker_over_tls(tls_redis_server: TlsRedisServer, start_worker) -> None:
    url = tls_redis_server.url
    worker = start_worker(url, "tls").wait_ready()
    with Client(url) as client:
        handles = [client.submit(prompt="over TLS", max_tokens=4), *client.submit_many(
            [{"id": f"tls-{i}", "prompt": f"row {i}", "max_tokens": 3} for i in range(3)])]
        results = client.results(handles, timeout=60)
    assert [r.ok for r in results] == [True] * 4 and results[0].usage.completion_tokens == 4
    assert PASSWORD not in worker.log_text()
    listed = _cli("dead-letters", "--broker", url, "list")
    assert listed.returncode == 0, listed.stderr


def test_rediss_without_the_ca_verifies_and_refuses_an_unknown_ca(tls_redis_server: TlsRedisServer) -> None:
    """No ssl_ca_certs: the system store is used, which does not hold the test CA, so nothing connects."""
    url = f"rediss://:{PASSWORD}@127.0.0.1:{tls_redis_server.port}/0"
    with Client(url) as client:
        with pytest.raises(Exception, match="certificate verify failed"):
            client.app.connection_for_write().ensure_connection(max_retries=1)
        with pytest.raises(Exception, match="certificate verify failed"):
            client.app.backend.client.ping()


def test_the_http_apis_records_speak_verified_tls(tls_redis_server: TlsRedisServer) -> None:
    """`tokenmill serve`'s own keys (files, batches, webhooks) go over the same verified TLS as the queue's."""
    from tokenmill.apps.api.records import Records

    records = Records(tls_redis_server.url)
    options = records.redis.connection_pool.connection_kwargs
    assert options["ssl_cert_reqs"] == ssl.CERT_REQUIRED and options["ssl_check_hostname"] is True
    records.add_file("tenant-a", {"id": "file-tls", "bytes": 3, "expires_at": 0})
    assert records.redis.get("tokenmill:api:file:file-tls") is not None  # written over TLS, read back
    unknown_ca = Records(f"rediss://:{PASSWORD}@127.0.0.1:{tls_redis_server.port}/0")
    with pytest.raises(Exception, match="certificate verify failed"):
        unknown_ca.redis.ping()


def test_client_never_sends_the_password_to_a_plaintext_rediss_address(plain_listener: PlainListener, tmp_path) -> None:
    url = f"rediss://:{PASSWORD}@127.0.0.1:{plain_listener.port}/0"
    for code in (f"Client({url!r}).submit(prompt='x')", f"Client({url!r}).get('some-job')"):
        _run_until_contacted(plain_listener, [sys.executable, "-c", f"from tokenmill.client import Client; {code}"])
    _run_until_contacted(plain_listener, [sys.executable, "-m", "tokenmill.cli", "dead-letters", "--broker", url, "list"])
    requests = tmp_path / "requests.jsonl"
    requests.write_text('{"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {"prompt": "x", "max_tokens": 2}}\n')
    _run_until_contacted(plain_listener, [sys.executable, "-m", "tokenmill.cli", "batch", "-i", str(requests), "-o",
                                          str(tmp_path / "out.jsonl"), "--broker", url, "--quiet"])
    _assert_tls_only(plain_listener)


def test_worker_never_sends_the_password_to_a_plaintext_rediss_address(plain_listener: PlainListener, start_worker) -> None:
    worker = start_worker(f"rediss://:{PASSWORD}@127.0.0.1:{plain_listener.port}/0", "leak")
    wait_for(lambda: len(plain_listener.received) >= 2 or worker.process.poll() is not None, 90, "the worker to connect")
    _assert_tls_only(plain_listener)


@pytest.mark.parametrize(("url", "parameter"), [
    ("rediss://h:6379/0?ssl_cert_reqs=none", "ssl_cert_reqs"),
    ("rediss://h:6379/0?ssl_cert_reqs=CERT_OPTIONAL", "ssl_cert_reqs"),
    ("rediss://h:6379/0?ssl_check_hostname=false", "ssl_check_hostname"),
    ("redis://h:6379/0?ssl_ca_certs=/ca.pem", "ssl_ca_certs needs a rediss:// URL"),
    ("rediss://h:6379/0?ssl_ca_cert=/ca.pem", "unknown TLS parameter ssl_ca_cert"),
])
def test_urls_that_would_weaken_tls_are_refused(url: str, parameter: str) -> None:
    with pytest.raises(ValidationError, match=parameter):
        QueueSettings(broker_url=url)
    with pytest.raises(ValidationError, match=parameter):
        QueueSettings(result_backend=url)


def test_celery_gets_verifying_tls_options_for_rediss() -> None:
    from tokenmill.queue.app import celery_config

    ca = "/etc/ssl/private ca.pem"
    config = celery_config(QueueSettings(broker_url=f"rediss://:pw@h:1/0?ssl_ca_certs={quote(ca)}&socket_timeout=3"))
    expected = {"ssl_cert_reqs": ssl.CERT_REQUIRED, "ssl_check_hostname": True, "ssl_ca_certs": ca}
    assert config["broker_use_ssl"] == expected and config["redis_backend_use_ssl"] == expected
    assert config["broker_url"] == config["result_backend"] == "rediss://:pw@h:1/0?socket_timeout=3"
    plain = celery_config(QueueSettings(broker_url="redis://h:1/0"))
    assert plain["broker_use_ssl"] is False and plain["redis_backend_use_ssl"] is None


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tokenmill.cli", *args], capture_output=True, text=True, timeout=120,
                          cwd=REPO, env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})


def _run_until_contacted(listener: PlainListener, command: list[str], timeout: float = 60) -> None:
    """Run `command` until it has opened a connection to `listener` (and a moment more), then stop it."""
    before = len(listener.received)
    process = subprocess.Popen(command, cwd=REPO, env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"},
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for(lambda: len(listener.received) > before or process.poll() is not None, timeout, f"{command} to connect")
        time.sleep(1.0)  # a retry would show a second attempt's bytes too
    finally:
        process.kill()
        process.wait(timeout=10)
    assert len(listener.received) > before, f"{command} never connected"


def _assert_tls_only(listener: PlainListener) -> None:
    """Every connection opened with a TLS handshake record (0x16) and none carried the password."""
    assert listener.received, "nothing connected"
    leaked = [data[:80] for data in listener.received if PASSWORD.encode() in data]
    assert not leaked, f"the password went over plaintext: {leaked}"
    assert all(data[:1] == b"\x16" for data in listener.received if data), [d[:20] for d in listener.received]
