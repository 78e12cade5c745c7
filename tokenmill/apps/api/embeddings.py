"""`POST /v1/embeddings`: OpenAI's embeddings endpoint, answered while the request waits.

Each input becomes an embedding job (`Job.embed`) in the tenant's fair share of the queue, as a batch's requests do;
the answer waits for their results, at most `embeddings_timeout` seconds (then a 504 in OpenAI's error shape, and the
jobs are cancelled). The body's rules are a batch line's (`tokenmill.apps.batch.embedding_inputs`,
`embedding_options`), and so is the answer (`embedding_body`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from pydantic import BaseModel, ConfigDict

from tokenmill.apps.api.driver import tenant_share
from tokenmill.apps.api.errors import APIError
from tokenmill.apps.api.resources import Connections
from tokenmill.apps.api.settings import ServeSettings
from tokenmill.apps.batch import REFUSED_STATUS, embedding_body, embedding_inputs, embedding_options
from tokenmill.client import JobTimeoutError, embed_job
from tokenmill.errors import InvalidRequestError
from tokenmill.queue.schemas import JobResult
from tokenmill.queue.served import not_served, served_models

#: A job's field as the embeddings body names it.
_BODY_PARAMS = {"prompt": "input", "prompt_token_ids": "input", "embed.dimensions": "dimensions"}


class CreateEmbedding(BaseModel):
    """`POST /v1/embeddings`, as `client.embeddings.create(...)` sends it; values checked as a batch line's."""

    model_config = ConfigDict(extra="forbid")

    model: str
    input: Any
    dimensions: Any = None
    encoding_format: Any = None
    user: str | None = None


class Waiting:
    """The `POST /v1/embeddings` requests waiting, each on one of the threads every route shares: at most `limit` a
    tenant and `total` in all (half the request threads), so that waiting embeddings never hold every thread."""

    def __init__(self, limit: int, total: int) -> None:
        self.limit, self.total = limit, total
        self._lock = threading.Lock()
        self._by_tenant: dict[str, int] = {}

    @contextmanager
    def slot(self, tenant: str) -> Iterator[None]:
        with self._lock:
            waiting = self._by_tenant.get(tenant, 0)
            if waiting >= self.limit:
                raise APIError(429, f"This key has {waiting} embeddings requests waiting, the most allowed "
                                    "(TOKENMILL_MAX_EMBEDDING_REQUESTS); try again when one is answered.", None,
                               "too_many_requests")
            if sum(self._by_tenant.values()) >= self.total:
                raise APIError(429, f"This server has {self.total} embeddings requests waiting, the most it lets "
                                    "wait at once (half of TOKENMILL_REQUEST_THREADS); try again shortly.", None,
                               "too_many_requests")
            self._by_tenant[tenant] = waiting + 1
        try:
            yield
        finally:
            with self._lock:
                self._by_tenant[tenant] -= 1
                if not self._by_tenant[tenant]:
                    del self._by_tenant[tenant]


def create_embeddings(body: CreateEmbedding, tenant: str, settings: ServeSettings,
                      connections: Connections) -> dict[str, Any]:
    """OpenAI's `CreateEmbeddingResponse` for `body`; raises `APIError`: 400 for a body (or an input a worker's
    engine) refuses, 404 for a model no live worker serves, 504 past `embeddings_timeout`."""
    try:
        inputs = embedding_inputs(body.input)
        embed, encoding = embedding_options(body.model_dump())
    except InvalidRequestError as exc:
        raise APIError(400, str(exc), exc.field, "invalid_request") from None
    _check_model(body.model, settings, connections.redis)
    deadline = time.monotonic() + settings.embeddings_timeout

    def waiting() -> None:  # for a turn of the server's publishers: the same deadline
        if time.monotonic() >= deadline:
            raise _timed_out(settings)

    with connections.client(tenant_share(tenant)) as client:
        try:
            with connections.publishing(client, waiting, min(1.0, settings.embeddings_timeout)):
                handles = client.submit_many([embed_job(text, embed) for text in inputs])
        except InvalidRequestError as exc:  # too big for a job: "jobs[i].prompt"
            index = exc.field.partition("]")[0].removeprefix("jobs[")
            raise APIError(400, exc.message, f"input[{index}]", "invalid_request") from None
        try:
            results = client.results(handles, timeout=max(0.0, deadline - time.monotonic()))
        except JobTimeoutError:
            client.cancel(handles)
            raise _timed_out(settings) from None
    for result in results:
        if not result.ok:
            raise _failure(result)
    tokens = sum(result.usage.prompt_tokens if result.usage else 0 for result in results)
    return embedding_body(body.model, [result.embedding or [] for result in results], tokens, encoding)


def _timed_out(settings: ServeSettings) -> APIError:
    return APIError(504, f"The embeddings were not computed within {settings.embeddings_timeout:g}s "
                         "(TOKENMILL_EMBEDDINGS_TIMEOUT); the queue is busy or no worker serves it.", None, "timeout")


def _check_model(model: str, settings: ServeSettings, redis: Any) -> None:
    """404 for a model no live worker on the queue announces (with none live at all, the jobs wait for one)."""
    why = not_served(model, served_models(redis, settings.queue), settings.queue)
    if why is not None:
        raise APIError(404, f"{why[0].upper()}{why[1:]}.", "model", "model_not_found")


def _failure(result: JobResult) -> APIError:
    """A failed job's error: the request's 400 when its input was refused, else a 500 with the job's error code."""
    error = result.error
    code, message = (error.code, error.message) if error else ("server_error", "failed")
    status = REFUSED_STATUS.get(code, 500)
    param = _BODY_PARAMS.get(error.field, error.field) if error and error.field else None
    return APIError(status, message, param, code)
