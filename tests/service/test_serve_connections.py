"""`tokenmill serve`'s connections (`tokenmill.apps.api.connections`): no client or tenant can make another tenant's
requests fail by holding connections, idle ones, ones sending their head slowly, or slow uploads."""

from __future__ import annotations

import json
import socket
import time
import urllib.error
import urllib.request
from typing import Any

from service_fixtures import KEYS, Server, wait_for


def _get(server: Server, tenant: str | None = "bob", path: str = "/v1/batches") -> tuple[int, Any, Any]:
    """Status, headers and JSON body of a GET, in at most 5 s."""
    headers = {"Authorization": f"Bearer {KEYS[tenant]}"} if tenant else {}
    request = urllib.request.Request(f"http://127.0.0.1:{server.port}{path}", headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=5) as response:
            return response.status, response.headers, _json(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, exc.headers, _json(exc.read())


def _json(body: bytes) -> Any:
    """The body's JSON, or the body itself where it is none (uvicorn's own plain-text answers)."""
    try:
        return json.loads(body)
    except ValueError:
        return body


def _slow_upload(server: Server, tenant: str = "alice") -> socket.socket:
    """A `POST /v1/files` announcing 100 MB, of which only the first part's headers are sent."""
    sock = socket.create_connection(("127.0.0.1", server.port))
    sock.sendall(b"POST /v1/files HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + KEYS[tenant].encode()
                 + b"\r\nContent-Type: multipart/form-data; boundary=B\r\nContent-Length: 100000000\r\n\r\n--B\r\n"
                 b'Content-Disposition: form-data; name="file"; filename="a.jsonl"\r\n\r\n')
    return sock


def _answer(sock: socket.socket, timeout: float) -> tuple[int, str, Any] | None:
    """The response read from `sock` within `timeout` s (status, its head, its JSON body); None if none came."""
    sock.settimeout(timeout)
    data = b""
    try:
        while b"\r\n\r\n" not in data or len(data.split(b"\r\n\r\n", 1)[1]) < _length(data):
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
    except TimeoutError:
        return None
    if not data:
        return None
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), head.decode().lower(), _json(body)


def _length(data: bytes) -> int:
    for line in data.split(b"\r\n\r\n", 1)[0].split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            return int(line.split(b":", 1)[1])
    return 0


def _closed_by_server(sock: socket.socket, within: float) -> bool:
    sock.settimeout(within)
    try:
        return sock.recv(1024) == b""
    except TimeoutError:
        return False
    except ConnectionResetError:
        return True


def test_idle_and_slow_head_connections_past_the_limit_leave_every_tenant_served(start_server) -> None:
    """max_http_connections=8: 8 connections that send nothing and 8 that send their head a byte a second are not
    counted; bob is served at once, every time, and the server closes them all after request_head_timeout."""
    server = start_server(**{"max-http-connections": 8, "request-head-timeout": 3})
    idle = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(8)]
    trickling = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(8)]
    for sock in trickling:
        sock.sendall(b"GET /v1/batches HTTP/1.1\r\n")
    try:
        time.sleep(0.5)  # all accepted
        for _ in range(3):
            begun = time.monotonic()
            status, _, _ = _get(server)
            assert status == 200 and time.monotonic() - begun < 2
            for sock in trickling:
                sock.sendall(b"X")  # a header's byte now and then: no whole head
            time.sleep(0.5)
        assert all(_closed_by_server(sock, 5) for sock in idle + trickling)
        # the deadline runs again after each response: a kept-alive connection that sends half a head is closed too
        kept = socket.create_connection(("127.0.0.1", server.port))
        kept.sendall(b"GET /v1/batches HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + KEYS["bob"].encode()
                     + b"\r\n\r\n")
        assert _answer(kept, 5)[0] == 200
        kept.sendall(b"GET /v1/batches HTTP/1.1\r\n")
        assert _closed_by_server(kept, 8)
    finally:
        for sock in idle + trickling:
            sock.close()


def test_one_tenants_slow_uploads_leave_the_other_tenant_served(start_server) -> None:
    """max_http_connections=8 and no pace to keep (min_body_rate=1): alice's uploads past max_tenant_uploads are
    answered 429 in OpenAI's shape, with Retry-After, before their bodies; bob is served all along."""
    server = start_server(**{"max-http-connections": 8, "min-body-rate": 1, "max-tenant-uploads": 3})
    uploads = []
    for _ in range(8):
        uploads.append(_slow_upload(server))
        time.sleep(0.1)
    try:
        answers = [_answer(sock, 1.0) for sock in uploads]
        held = [sock for sock, answer in zip(uploads, answers) if answer is None]
        statuses = []
        for _ in range(4):
            statuses.append(_get(server)[0])
            for sock in held:
                sock.sendall(b"{}\n")  # a few bytes every second keep them open
            time.sleep(1)
        assert statuses == [200] * 4
        refused = [answer for answer in answers if answer is not None]
        assert len(held) == 3 and len(refused) == 5
        for status, head, body in refused:
            assert status == 429 and "retry-after: 1" in head and body["error"]["type"] == "requests"
            assert "TOKENMILL_MAX_TENANT_UPLOADS" in body["error"]["message"]
        # her own other requests are bounded too: 3 uploads held, at most 7 requests at once (8 - 1)
        assert _get(server, "alice")[0] == 200
    finally:
        for sock in uploads:
            sock.close()


def test_a_body_slower_than_min_body_rate_is_answered_408(start_server) -> None:
    server = start_server(**{"request-head-timeout": 2, "min-body-rate": 1024})
    upload = _slow_upload(server)
    try:
        begun = time.monotonic()
        answer = None
        while answer is None and time.monotonic() - begun < 10:
            upload.sendall(b"{}\n")
            answer = _answer(upload, 0.5)
        assert answer is not None, "no answer in 10 s"
        status, head, body = answer
        assert status == 408 and body["error"]["code"] == "request_timeout" and "connection: close" in head
        assert 2 <= time.monotonic() - begun < 6
        assert _closed_by_server(upload, 2)
    finally:
        upload.close()


def test_past_max_http_connections_a_request_is_a_503_in_openais_shape_then_served_again(start_server) -> None:
    """max_http_connections=2, so one tenant holds one request at most: alice's and bob's slow uploads fill it."""
    server = start_server(**{"max-http-connections": 2, "min-body-rate": 1})
    uploads = [_slow_upload(server, "alice"), _slow_upload(server, "bob")]
    try:
        assert _answer(uploads[0], 1.0) is None and _answer(uploads[1], 1.0) is None
        status, headers, body = _get(server, None, "/v1/models")
        assert status == 503 and headers["Retry-After"] == "1"
        assert body["error"]["type"] == "server_error" and "TOKENMILL_MAX_HTTP_CONNECTIONS" in body["error"]["message"]
        assert _answer(_slow_upload(server, "alice"), 1.0)[0] == 429  # her one request is held
    finally:
        for sock in uploads:
            sock.close()
    wait_for(lambda: _get(server)[0] == 200, 10, "the server answering again")


def test_a_tenant_leaves_the_others_a_handler_thread(start_server) -> None:
    """request_threads=3: one tenant has at most 2 requests at once, whatever max_tenant_requests says, so a
    handler thread is always left to the others."""
    server = start_server(**{"request-threads": 3, "min-body-rate": 1, "max-tenant-uploads": 4})
    uploads = [_slow_upload(server, "alice") for _ in range(2)]
    try:
        assert [_answer(sock, 1.0) for sock in uploads] == [None, None]
        status, _, body = _get(server, "alice")
        assert status == 429 and "at most 2 requests of one key" in body["error"]["message"]
        assert _get(server, "bob")[0] == 200
    finally:
        for sock in uploads:
            sock.close()


def test_uvicorns_h11_protocol_still_has_what_the_head_deadline_relies_on() -> None:
    """`HeadDeadlineH11Protocol` overrides three of uvicorn's methods and reads a few of its attributes (pyproject bounds
    uvicorn below 0.56; a release within may still rename them): a rename would silently leave connections without a head deadline."""
    import inspect

    from uvicorn.protocols.http.h11_impl import H11Protocol, RequestResponseCycle

    from tokenmill.apps.api.connections import HeadDeadlineH11Protocol

    assert HeadDeadlineH11Protocol.__mro__[1] is H11Protocol
    for name in ("connection_made", "on_response_complete", "connection_lost"):
        assert name in vars(H11Protocol), f"uvicorn's H11Protocol no longer defines {name}"
    init = inspect.getsource(H11Protocol.__init__)
    assert all(f"self.{name} " in init or f"self.{name}:" in init for name in ("loop", "conn", "cycle", "transport"))
    assert "self.response_complete" in inspect.getsource(RequestResponseCycle.__init__)
