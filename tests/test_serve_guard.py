"""`tokenmill.apps.api.guard.RequestGuard` on its own, around a minimal ASGI app (no server, no Redis): what the
real-server tests in tests/service cannot make an app do."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

import pytest

from tokenmill.apps.api.auth import Keys
from tokenmill.apps.api.guard import MAX_BODY_BYTES, RequestGuard
from tokenmill.apps.api.settings import ServeSettings


def _guard(app: Any, tmp_path: Path) -> RequestGuard:
    settings = ServeSettings(broker_url="redis://127.0.0.1:1/0", files_dir=str(tmp_path), api_keys="alice=sk-alice")
    return RequestGuard(app, settings, Keys(settings))


def _call(guard: RequestGuard, chunks: list[bytes]) -> list[dict[str, Any]]:
    """POST /v1/anything with `chunks` as a chunked body (no Content-Length); the messages the guard sent."""
    scope = {"type": "http", "method": "POST", "path": "/v1/anything",
             "headers": [(b"authorization", b"Bearer sk-alice")], "query_string": b"", "http_version": "1.1",
             "scheme": "http", "server": ("test", 80), "client": ("c", 1)}
    messages = [{"type": "http.request", "body": chunk, "more_body": i < len(chunks) - 1}
                for i, chunk in enumerate(chunks)]
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    asyncio.run(guard(scope, receive, send))
    return sent


def test_an_app_failing_after_its_body_was_refused_is_logged_and_the_refusal_answered(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    async def app(scope: Any, receive: Any, send: Any) -> None:
        try:
            while (await receive()).get("more_body"):
                pass
        except Exception:
            raise RuntimeError("a bug behind the refusal") from None

    with caplog.at_level(logging.ERROR, logger="tokenmill.apps.api.guard"):
        sent = _call(_guard(app, tmp_path), [b"x" * (MAX_BODY_BYTES // 2 + 1)] * 2 + [b""])
    assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 413
    assert "the app failed after its body was refused (413)" in caplog.text
    assert "RuntimeError: a bug behind the refusal" in caplog.text


def test_a_body_within_its_limit_reaches_the_app_and_its_answer_goes_out(tmp_path: Path) -> None:
    async def app(scope: Any, receive: Any, send: Any) -> None:
        size = 0
        while True:
            message = await receive()
            size += len(message.get("body", b""))
            if not message.get("more_body"):
                break
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": str(size).encode()})

    guard = _guard(app, tmp_path)
    sent = _call(guard, [b"x" * 1000, b"y" * 24])
    assert sent[0]["status"] == 200 and sent[1]["body"] == b"1024"
    assert guard.requests == 0 and not guard.tenant_requests  # counted while served, and no longer
