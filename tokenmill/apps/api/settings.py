"""Settings of `tokenmill serve`: the queue's own (`QueueSettings`) plus the API's, from `TOKENMILL_*` variables."""

from __future__ import annotations

from pydantic import Field, field_validator, model_validator

from tokenmill.queue.schemas import S3Location
from tokenmill.queue.settings import QueueSettings


#: Seconds a job's stored result must outlive the longest completion window: a batch is finalized from its results
#: a lease and a few supervisor scans after its window ends.
RESULT_MARGIN = 3600


class ServeSettings(QueueSettings):
    """What the HTTP API needs besides the queue: keys, where files live, limits, the batch lease."""

    api_keys: str | None = Field(
        None, description="Comma-separated bearer API keys of `tokenmill serve`, each `tenant=key` or a bare key "
        "(its tenant: a hash of it). Each tenant sees only its own files and batches.")
    api_keys_file: str | None = Field(
        None, description="File of hashed API keys for `tokenmill serve`: one `tenant sha256:<hex of the key>` a "
        "line (`#` comments), used with TOKENMILL_API_KEYS if both are set.")
    files_dir: str = Field("tokenmill-files", description="Where `tokenmill serve` keeps uploaded and output files: "
                           "a directory, or `s3://bucket/prefix` (MinIO and other S3 stores through "
                           "TOKENMILL_S3_ENDPOINT_URL); shared by every server process of one deployment.")
    s3_endpoint_url: str | None = Field(None, description="S3 endpoint (MinIO, moto, ...); default: AWS.")
    max_upload_bytes: int = Field(200 * 1024 * 1024, ge=1, description="Largest file `POST /v1/files` accepts (bytes).")
    max_batch_lines: int = Field(50_000, ge=1, description="Most requests one batch's input file may hold; more "
                                 "fails the batch's validation.")
    lease_seconds: float = Field(15.0, gt=0, description="Seconds a `tokenmill serve` process holds the lease of a "
                                 "batch it drives without renewing it; a killed server's batches are taken over "
                                 "after this.")
    batch_rows_per_message: int = Field(32, ge=1, description="Requests per `tokenmill.generate_batch` message "
                                        "when `tokenmill serve` queues a batch.")
    default_max_tokens: int | None = Field(None, ge=1, description="max_tokens of a batch request that sets neither "
                                           "max_tokens nor max_completion_tokens (as `tokenmill batch --max-tokens`); "
                                           "unset: the rule of every door, 256 tokens.")
    file_expires: int = Field(30 * 86400, ge=1, description="Seconds an uploaded file, or a batch's output or error "
                              "file without `output_expires_after`, is kept (its record and its bytes).")
    batch_expires: int = Field(30 * 86400, ge=1, description="Seconds a batch's record is kept once it is final.")
    max_drivers: int = Field(32, ge=1, description="Batches one `tokenmill serve` process drives at once (a thread "
                             "and a queue client each); the others wait their turn, the tenants' in turn.")
    max_active_batches: int = Field(100, ge=1, description="Batches one tenant may have not final yet; past it "
                                    "`POST /v1/batches` answers 429.")
    max_batch_records: int = Field(10_000, ge=1, description="Batch records one tenant may have kept, final ones "
                                   "included (each kept TOKENMILL_BATCH_EXPIRES once final); past it "
                                   "`POST /v1/batches` answers 429 until some expire.")
    max_queued_jobs: int = Field(200_000, ge=1, description="Jobs (requests × `n`; an embeddings request: its inputs) "
                                 "one tenant's batches not final yet may hold; a batch past it is a 429 with "
                                 "Retry-After at `POST /v1/batches` (a 400 if its file alone is past it).")
    max_queued_prompt_bytes: int = Field(512 * 1024 * 1024, ge=1, description="Prompt bytes one tenant's batches not "
                                         "final yet may hold, estimated from above as each request line's whole size, "
                                         "once per choice (serve has no tokenizer; a token of text is at least a "
                                         "byte); past it as TOKENMILL_MAX_QUEUED_JOBS.")
    max_stored_files: int = Field(10_000, ge=1, description="Files one tenant may store (uploads and its batches' "
                                  "output files); past it `POST /v1/files` answers 400, and at it `POST /v1/batches`, "
                                  "until files are deleted or expire.")
    max_stored_bytes: int = Field(10 * 1024 ** 3, ge=1, description="Bytes of files one tenant may store (uploads and "
                                  "outputs); past it `POST /v1/files` answers 400, and at it `POST /v1/batches`, until "
                                  "files are deleted or expire.")
    rate_limit: float = Field(1200.0, gt=0, description="Requests a minute one API key may make (per `tokenmill serve` "
                              "process); past it a 429 with Retry-After.")
    rate_burst: int = Field(120, ge=1, description="Requests a key may make at once before `rate_limit` paces it.")
    embeddings_timeout: float = Field(60.0, gt=0, description="Seconds `POST /v1/embeddings` waits for its inputs' "
                                      "embedding jobs; past it a 504 and the jobs are cancelled.")
    max_embedding_requests: int = Field(4, ge=1, description="`POST /v1/embeddings` requests one tenant may have "
                                        "waiting at once (per `tokenmill serve` process, which waits for them on "
                                        "threads every route shares); past it a 429.")
    request_threads: int = Field(24, ge=2, description="Threads one `tokenmill serve` process runs request handlers "
                                 "on (FastAPI's thread pool), at least 2: one tenant may hold all but one; more requests "
                                 "at once wait for one.")
    redis_connections: int = Field(64, ge=2, description="Connections one `tokenmill serve` process opens to the "
                                   "result backend's Redis (records, result reads, waits' subscriptions: one pool); a "
                                   "call finding all taken waits, TOKENMILL_REDIS_SOCKET_TIMEOUT at most. Must exceed "
                                   "max_drivers + request_threads.")
    max_publishers: int = Field(8, ge=1, description="Queue clients of one `tokenmill serve` process publishing jobs "
                                "at once (drivers queueing batches, embeddings requests), 2 broker connections each; "
                                "the others wait their turn.")
    max_http_connections: int = Field(512, ge=1, description="Requests one `tokenmill serve` process serves at once: "
                                      "connections that have delivered a whole request head (idle ones, and ones "
                                      "still sending their head, are not counted); past it a 503 with Retry-After.")
    request_head_timeout: float = Field(10.0, gt=0, description="Seconds an HTTP connection has to deliver a whole "
                                        "request head, from its opening or from the end of its previous response; "
                                        "past it the connection is closed. Connections without a whole request head "
                                        "are not counted in TOKENMILL_MAX_HTTP_CONNECTIONS.")
    min_body_rate: int = Field(16 * 1024, ge=1, description="Bytes a second a request's body must arrive at, counted "
                               "over the time the server waits for it, after a first TOKENMILL_REQUEST_HEAD_TIMEOUT "
                               "seconds; a slower body is answered 408 and its connection closed.")
    max_tenant_requests: int = Field(32, ge=1, description="Requests of one tenant a `tokenmill serve` process serves "
                                     "at once (at most TOKENMILL_MAX_HTTP_CONNECTIONS - 1 and TOKENMILL_REQUEST_THREADS - "
                                     "1, so that one tenant always leaves the others a request and a handler thread); "
                                     "past it a 429 with Retry-After.")
    max_tenant_uploads: int = Field(4, ge=1, description="`POST /v1/files` uploads of one tenant a `tokenmill serve` "
                                    "process receives at once (within TOKENMILL_MAX_TENANT_REQUESTS); past it a 429 "
                                    "with Retry-After.")
    max_completion_window: int = Field(86400, ge=3600, description="Longest `completion_window` a batch may ask "
                                       "for, in seconds (OpenAI's is 24h); a longer one is refused with a 400. At most "
                                       "TOKENMILL_RESULT_EXPIRES less an hour (serve's and the workers'): a batch "
                                       "re-driven later reads its finished jobs' stored results.")
    openapi_schema: bool = Field(False, description="Serve the API's OpenAPI schema at /openapi.json (the "
                                 "interactive docs pages are never served: they load scripts from a CDN).")
    webhook_url: str | None = Field(None, description="URL `tokenmill serve` POSTs batch.completed / batch.failed / "
                                    "batch.cancelled / batch.expired events to, signed as Standard Webhooks says; "
                                    "unset: no webhooks.")
    webhook_secret: str | None = Field(None, description="The `whsec_<base64>` secret webhooks are signed with "
                                       "(required with TOKENMILL_WEBHOOK_URL).")
    webhook_timeout: float = Field(10.0, gt=0, description="Seconds one webhook delivery may take.")
    webhook_max_attempts: int = Field(10, ge=1, description="Deliveries of one webhook event before it is given up "
                                      "(retried after 1, 2, 4 ... s, at most an hour apart).")

    @model_validator(mode="after")
    def _check_pools(self) -> "ServeSettings":
        # each driver and request thread may hold a connection for a command at once, and the waits for results share
        # one more (`tokenmill.apps.api.resources`): then no thread waits for a connection held by a wait
        if self.redis_connections <= self.max_drivers + self.request_threads:
            raise ValueError(f"TOKENMILL_REDIS_CONNECTIONS ({self.redis_connections}) must exceed "
                             f"TOKENMILL_MAX_DRIVERS + TOKENMILL_REQUEST_THREADS "
                             f"({self.max_drivers} + {self.request_threads})")
        return self

    @model_validator(mode="after")
    def _check_window(self) -> "ServeSettings":
        # a batch re-driven (restart, takeover, fair-share hand-back), also just after its window ended, reads its
        # jobs' stored results: they must outlive any batch's window by `RESULT_MARGIN`
        if self.max_completion_window + RESULT_MARGIN > self.result_expires:
            raise ValueError(f"TOKENMILL_MAX_COMPLETION_WINDOW ({self.max_completion_window}) must be at most "
                             f"TOKENMILL_RESULT_EXPIRES ({self.result_expires}) less {RESULT_MARGIN}: lower the window, "
                             "or raise TOKENMILL_RESULT_EXPIRES here and on every worker")
        return self

    @model_validator(mode="after")
    def _check_webhook(self) -> "ServeSettings":
        if self.webhook_url is not None:
            if not self.webhook_url.startswith(("http://", "https://")):
                raise ValueError(f"TOKENMILL_WEBHOOK_URL: an http:// or https:// URL, got {self.webhook_url!r}")
            if not self.webhook_secret:
                raise ValueError("TOKENMILL_WEBHOOK_URL is set but TOKENMILL_WEBHOOK_SECRET is not (whsec_<base64>)")
            from standardwebhooks.webhooks import Webhook

            try:
                Webhook(self.webhook_secret)
            except Exception as exc:
                raise ValueError(f"TOKENMILL_WEBHOOK_SECRET: not a whsec_<base64> secret ({exc})") from None
        return self

    @field_validator("files_dir")
    @classmethod
    def _check_files_dir(cls, value: str) -> str:
        if value.startswith("s3://"):
            S3Location.parse(value)  # an S3 files store is s3://bucket or s3://bucket/prefix
        return value
