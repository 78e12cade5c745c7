"""The routes: OpenAI's Files, Batches, Embeddings and Models endpoints as the `openai` SDK calls them.

(No `from __future__ import annotations` here: FastAPI reads the handlers' annotations, which name the local
`Tenant` dependency.)

Handlers are plain functions (FastAPI runs them in its thread pool), since Redis and the queue client are
synchronous; the batches themselves are driven by `driver.Supervisor`'s threads, never by a request.
"""

import itertools
import re
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Annotated, Any
from urllib.parse import quote

from fastapi import Depends, FastAPI, File, Form, Header, Query, UploadFile
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ConfigDict

from tokenmill.apps.api import errors
from tokenmill.apps.api.auth import Keys
from tokenmill.apps.api.driver import Supervisor, file_object
from tokenmill.apps.api.embeddings import CreateEmbedding, Waiting, create_embeddings
from tokenmill.apps.api.errors import APIError, not_found
from tokenmill.apps.api.files import new_file_id, open_store, upload_size
from tokenmill.apps.api.guard import RequestGuard
from tokenmill.apps.api.quotas import check_queued, check_stored, input_usage
from tokenmill.apps.api.records import FINAL, OUTPUT_EXPIRES_FIELD, Records, batch_key, now
from tokenmill.apps.api.resources import Connections, bound_the_loop
from tokenmill.apps.api.settings import ServeSettings
from tokenmill.apps.api.webhooks import Deliverer
from tokenmill.apps.batch import URLS, quoted
from tokenmill.apps.datasets import s3_endpoint
from tokenmill.queue.served import served_models

_WINDOW = re.compile(r"([1-9][0-9]*)(h|m|s)")
_SECONDS = {"h": 3600, "m": 60, "s": 1}


class CreateBatch(BaseModel):
    """`POST /v1/batches`, as `client.batches.create(...)` sends it."""

    model_config = ConfigDict(extra="forbid")

    input_file_id: str
    endpoint: str
    completion_window: str
    metadata: dict[str, str] | None = None
    output_expires_after: dict[str, Any] | None = None  # {"anchor": "created_at", "seconds": N}: the output files' life


class Services:
    """What the handlers share: settings, keys, records, the file store and the batch supervisor."""

    def __init__(self, settings: ServeSettings, keys: Keys) -> None:
        self.settings = settings
        self.keys = keys
        self.records = Records(settings.backend_url, webhooks=settings.webhook_url is not None,
                               batch_expires=settings.batch_expires, socket_timeout=settings.redis_socket_timeout,
                               max_connections=settings.redis_connections)
        self.connections = Connections(settings, self.records.redis)  # every Redis connection bounded (`resources`)
        self.store = open_store(settings.files_dir, s3_endpoint(settings.s3_endpoint_url))
        self.supervisor = Supervisor(settings, self.records, self.store, self.connections)
        self.embedding_requests = Waiting(settings.max_embedding_requests, max(1, settings.request_threads // 2))
        self.deliverer = None if settings.webhook_url is None else Deliverer(
            self.records, settings.webhook_url, settings.webhook_secret or "", settings.webhook_timeout,
            settings.webhook_max_attempts, self.supervisor.stopping)


def create_app(settings: ServeSettings, keys: Keys) -> FastAPI:
    services = Services(settings, keys)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        bound_the_loop(settings)  # request threads, accept failures logged once a second (`resources`)
        services.supervisor.start()  # takes over the batches of a server that died, at once
        if services.deliverer is not None:
            services.deliverer.start()  # and the webhook events it left undelivered
        yield
        services.supervisor.stop()
        services.connections.close()

    app = FastAPI(title="tokenmill", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url="/openapi.json" if settings.openapi_schema else None)
    errors.install(app)
    app.add_middleware(RequestGuard, settings=settings, keys=keys)  # ahead of every route (`guard`)

    def tenant(authorization: Annotated[str | None, Header()] = None) -> str:
        return keys.tenant(authorization)

    Tenant = Annotated[str, Depends(tenant)]
    _file_routes(app, services, Tenant)
    _batch_routes(app, services, Tenant)

    @app.post("/v1/embeddings")
    def embeddings(body: CreateEmbedding, tenant: Tenant) -> dict[str, Any]:
        """Answered once the inputs' embedding jobs are done (`api.embeddings`)."""
        with services.embedding_requests.slot(tenant):
            return create_embeddings(body, tenant, settings, services.connections)

    @app.get("/v1/models")
    def models(_: Tenant) -> dict[str, Any]:
        """The models live workers on this server's queue announce (`tokenmill.queue.served`)."""
        served = served_models(services.records.redis, settings.queue)
        return {"object": "list", "data": [{"id": m, "object": "model", "created": 0, "owned_by": "tokenmill"}
                                           for m in sorted(served)]}

    return app


def _file_routes(app: FastAPI, services: Services, Tenant: Any) -> None:
    records, store, settings = services.records, services.store, services.settings

    def owned(tenant: str, file_id: str) -> dict[str, Any]:
        found = records.file(tenant, file_id)
        if found is None:
            raise not_found("file", file_id)
        return found

    @app.post("/v1/files")
    def upload(tenant: Tenant, file: Annotated[UploadFile, File()], purpose: Annotated[str, Form()]) -> dict[str, Any]:
        """The key and the body's size were checked before the body was read (`RequestGuard`); the file's own size
        and the tenant's stored files and bytes (`quotas`) before it is stored, its jobs and prompt bytes counted."""
        if purpose != "batch":
            raise APIError(400, f"purpose: only 'batch' is supported, got {quoted(purpose)}", "purpose",
                           "invalid_value")
        check_stored(records.stored(tenant), settings, upload_size(file.file, settings.max_upload_bytes))
        usage = input_usage(file.file)
        file_id = new_file_id()
        size = store.save(file_id, file.file, settings.max_upload_bytes)
        found = file_object(file_id, file.filename or "upload.jsonl", size, purpose, settings.file_expires)
        records.add_file(tenant, found, usage)
        return found

    @app.get("/v1/files")
    def list_files(tenant: Tenant, after: str | None = None, limit: Annotated[int, Query(ge=1, le=10000)] = 10000,
                   order: Annotated[str, Query(pattern="^(asc|desc)$")] = "desc",
                   purpose: str | None = None) -> dict[str, Any]:
        return _page(*records.files(tenant, after, limit, newest_first=order == "desc", purpose=purpose))

    @app.get("/v1/files/{file_id}")
    def get_file(file_id: str, tenant: Tenant) -> dict[str, Any]:
        return owned(tenant, file_id)

    @app.get("/v1/files/{file_id}/content")
    def content(file_id: str, tenant: Tenant) -> StreamingResponse:
        found = owned(tenant, file_id)
        chunks = store.chunks(file_id)
        first = next(chunks, b"")  # a missing file is a 404 here, before the response starts
        return StreamingResponse(itertools.chain([first], chunks), media_type="application/octet-stream",
                                 headers={"Content-Length": str(found["bytes"]),
                                          "Content-Disposition": f"attachment; filename*=UTF-8''{quote(found['filename'])}"})

    @app.delete("/v1/files/{file_id}")
    def delete(file_id: str, tenant: Tenant) -> dict[str, Any]:
        owned(tenant, file_id)
        records.delete_file(tenant, file_id)
        store.delete(file_id)
        return {"id": file_id, "object": "file", "deleted": True}


def _batch_routes(app: FastAPI, services: Services, Tenant: Any) -> None:
    records = services.records

    def owned(tenant: str, batch_id: str) -> dict[str, Any]:
        found = records.batch(batch_id, tenant)
        if found is None:
            raise not_found("batch", batch_id)
        return found

    @app.post("/v1/batches")
    def create(body: CreateBatch, tenant: Tenant) -> dict[str, Any]:
        window = _window_seconds(body.completion_window, services.settings.max_completion_window)
        if body.endpoint not in URLS:
            raise APIError(400, f"endpoint: unsupported {quoted(body.endpoint)} (supported: {', '.join(URLS)})",
                           "endpoint", "invalid_value")
        _check_metadata(body.metadata)
        source = records.file(tenant, body.input_file_id)
        if source is None:
            raise not_found("file", body.input_file_id)
        if source["purpose"] != "batch":
            raise APIError(400, f"input_file_id: file {quoted(body.input_file_id)} has purpose {source['purpose']!r}, "
                           "not 'batch'", "input_file_id", "invalid_value")
        output_expires = _output_expires(body.output_expires_after)
        mine = records.active_by_tenant().get(tenant, [])
        if len(mine) >= services.settings.max_active_batches:
            raise APIError(429, f"This key has {len(mine)} batches not finished yet, the most allowed "
                                f"(TOKENMILL_MAX_ACTIVE_BATCHES); create more once some end.", None,
                           "too_many_active_batches")
        kept = records.batch_count(tenant)
        if kept >= services.settings.max_batch_records:
            raise APIError(429, f"This key has {kept} batch records kept, the most allowed "
                                f"(TOKENMILL_MAX_BATCH_RECORDS); a final batch's record is kept "
                                f"{services.settings.batch_expires} s (TOKENMILL_BATCH_EXPIRES): create more once some "
                                "expire.", None, "too_many_batch_records")
        check_stored(records.stored(tenant), services.settings)  # its output files will be stored files too
        usage = records.input_usage(body.input_file_id)
        check_queued(records.queued(mine), usage, services.settings)
        batch = new_batch(body, window)
        records.add_batch(tenant, batch, usage)
        if output_expires is not None:
            records.set_field(batch["id"], OUTPUT_EXPIRES_FIELD, output_expires)
        services.supervisor.poked.set()
        return batch

    @app.get("/v1/batches")
    def list_batches(tenant: Tenant, after: str | None = None,
                     limit: Annotated[int, Query(ge=1, le=100)] = 20) -> dict[str, Any]:
        found, more = records.batches(tenant, after, limit)
        return _page(found, more)

    @app.get("/v1/batches/{batch_id}")
    def get_batch(batch_id: str, tenant: Tenant) -> dict[str, Any]:
        return owned(tenant, batch_id)

    @app.post("/v1/batches/{batch_id}/cancel")
    def cancel(batch_id: str, tenant: Tenant) -> dict[str, Any]:
        found = owned(tenant, batch_id)
        if found["status"] in ("cancelling", "cancelled"):
            return found
        if found["status"] in FINAL:
            raise APIError(400, f"Cannot cancel a batch with status '{found['status']}'.", None, "invalid_state")
        records.redis.hsetnx(batch_key(batch_id), "cancel", "cancel")

        def cancelling(b: dict[str, Any]) -> None:
            if b["status"] not in FINAL:
                b.update(status="cancelling", cancelling_at=now())

        return records.update(batch_id, cancelling)


def new_batch(body: CreateBatch, window: int) -> dict[str, Any]:
    """A `Batch` as the SDK's type has it, every field present."""
    created = now()
    stamps = ("in_progress_at", "finalizing_at", "completed_at", "failed_at", "expired_at", "cancelling_at",
              "cancelled_at")
    return {"id": f"batch_{uuid.uuid4().hex[:24]}", "object": "batch", "endpoint": body.endpoint, "errors": None,
            "input_file_id": body.input_file_id, "completion_window": body.completion_window,
            "status": "validating", "output_file_id": None, "error_file_id": None, "created_at": created,
            "expires_at": created + window, **dict.fromkeys(stamps),
            "request_counts": {"total": 0, "completed": 0, "failed": 0}, "metadata": body.metadata,
            "model": None, "usage": None}


def _window_seconds(window: str, longest: int) -> int:
    """`completion_window` in seconds: '24h' as OpenAI takes it, or another number of h, m or s up to `longest`."""
    match = _WINDOW.fullmatch(window) if len(window) <= 32 else None
    if match is None:
        raise APIError(400, f"completion_window: must look like '24h' (or a number of m or s), got {quoted(window)}",
                       "completion_window", "invalid_value")
    seconds = int(match[1]) * _SECONDS[match[2]]
    if seconds > longest:
        raise APIError(400, f"completion_window: at most {longest // 3600}h here (TOKENMILL_MAX_COMPLETION_WINDOW), "
                            f"got {quoted(window)}", "completion_window", "invalid_value")
    return seconds


def _output_expires(after: dict[str, Any] | None) -> int | None:
    """Seconds the output and error files live, from `output_expires_after` as OpenAI takes it: anchor `created_at`
    (the file's), 1 hour to 30 days."""
    if after is None:
        return None
    seconds = after.get("seconds")
    if after.get("anchor") != "created_at" or isinstance(seconds, bool) or not isinstance(seconds, int) \
            or not 3600 <= seconds <= 30 * 86400:
        raise APIError(400, "output_expires_after: must be {\"anchor\": \"created_at\", \"seconds\": 3600 to 2592000}",
                       "output_expires_after", "invalid_value")
    return seconds


def _check_metadata(metadata: dict[str, str] | None) -> None:
    """OpenAI's limits: at most 16 pairs, keys up to 64 characters, values up to 512."""
    if metadata is None:
        return
    if len(metadata) > 16:
        raise APIError(400, f"metadata: at most 16 pairs, got {len(metadata)}", "metadata", "invalid_value")
    for key, value in metadata.items():
        if len(key) > 64 or len(value) > 512:
            raise APIError(400, f"metadata: keys up to 64 characters, values up to 512; got key {quoted(key)}",
                           "metadata", "invalid_value")


def _page(data: list[dict[str, Any]], more: bool) -> dict[str, Any]:
    return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None, "has_more": more}
