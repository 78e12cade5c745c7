"""OpenAI's error shape, `{"error": {"message", "type", "param", "code"}}`, for every error the API returns."""

from __future__ import annotations

import logging
import uuid
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from tokenmill.apps.batch import quoted

log = logging.getLogger(__name__)

_TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
          413: "invalid_request_error", 429: "requests"}


class APIError(Exception):
    """An error answered in OpenAI's shape: the SDK raises its matching exception (`NotFoundError` for 404...)."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers  # sent with it (`Retry-After` where waiting helps)

    def body(self) -> dict[str, Any]:
        kind = _TYPES.get(self.status, "server_error" if self.status >= 500 else "invalid_request_error")
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}


def not_found(what: str, id: str) -> APIError:
    """404 for an id that does not exist or belongs to another tenant (the two look the same on purpose)."""
    return APIError(404, f"No {what} found with id {quoted(id)}.", param="id", code="not_found")


def logged_reference(logger: logging.Logger, exc: BaseException, what: str, *args: Any) -> str:
    """A new reference for an internal error, logged with `what % args` and `exc`'s details: the client is told the
    reference only, never the details (a path, a bucket, a trace)."""
    reference = uuid.uuid4().hex[:16]
    logger.error(f"{what} (reference %s)", *args, reference, exc_info=exc)
    return reference


def upload_too_large(limit: int) -> APIError:
    """413 for an upload over `limit` bytes: refused as its body comes in (`guard`) or as it is saved (`files`)."""
    return APIError(413, f"file: larger than the {limit}-byte upload limit (TOKENMILL_MAX_UPLOAD_BYTES)",
                    param="file", code="file_too_large")


def install(app: FastAPI) -> None:
    """Every error of the app, FastAPI's own validation and routing errors included, in OpenAI's shape."""

    @app.exception_handler(APIError)
    async def api_error(_: Request, exc: APIError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0]
        param = ".".join(str(part) for part in first["loc"][1:]) or None
        return JSONResponse(APIError(400, f"{param or 'request'}: {first['msg']}", param, "invalid_request").body(),
                            status_code=400)

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> JSONResponse:
        """A bug or an outage: the client gets a reference, the log the details (never the other way round)."""
        reference = logged_reference(log, exc, "internal error on %s %s", request.method, request.url.path)
        body = APIError(500, f"The server had an error processing your request (reference {reference}).", None,
                        "server_error").body()
        return JSONResponse(body, status_code=500)

    @app.exception_handler(HTTPException)
    async def http_error(_: Request, exc: HTTPException) -> JSONResponse:
        code = "not_found" if exc.status_code == 404 else None
        return JSONResponse(APIError(exc.status_code, str(exc.detail), None, code).body(), status_code=exc.status_code)
