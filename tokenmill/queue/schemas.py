"""Wire format of a job and of its result: pydantic v2 models, JSON, versioned.

These models are the boundary between producers and workers, so they are strict: a job that would
fail on the worker for a reason visible here (no prompt, two prompts, bad sampling value, bad S3
destination) is refused before it is queued, with an `InvalidRequestError` naming the field.

Torch-free on purpose: a producer installs only the light client.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_serializer,
    field_validator,
    model_validator,
)

from tokenmill.errors import InvalidRequestError
from tokenmill.queue import fastjson
from tokenmill.queue.result_objects import ResultReadError, read_object
from tokenmill.sampling_params import MAX_NESTING, SamplingParams, check_nesting, without_defaults

#: Bumped on any incompatible change of `Job` or `JobResult`. A worker refuses versions it does not know.
SCHEMA_VERSION = 1

#: Job ids end up in Redis keys and S3 object names, so keep them to a safe, printable alphabet.
JOB_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$"
_JOB_ID = re.compile(JOB_ID_PATTERN)
_CONTENT_HASH = re.compile(r"[0-9a-f]{64}")

#: Wire fields left out of a job's content hash: stamped per submission, not part of what the job asks for.
VOLATILE_FIELDS = frozenset({"id", "submitted_at"})

_S3_URI = re.compile(r"^s3://(?P<bucket>[a-z0-9][a-z0-9.-]{1,61}[a-z0-9])(?:/(?P<prefix>.*))?$")
_PROMPT_FIELDS = ("prompt", "messages", "prompt_token_ids")
_SAMPLING_FIELDS = frozenset(f.name for f in dataclasses.fields(SamplingParams))

TokenId = Annotated[int, Field(ge=0, strict=True)]
Timestamp = float | None


def new_job_id() -> str:
    """A random id. Producers that want idempotency pass their own stable id instead."""
    return uuid.uuid4().hex


class ChatMessage(BaseModel):
    """One chat turn; the worker turns a list of them into prompt ids with the model's chat template."""

    model_config = ConfigDict(extra="forbid")

    role: str = Field(min_length=1)
    content: str


class S3Location(BaseModel):
    """Where a job's result JSON goes: `s3://bucket/prefix/<job id>.json`."""

    bucket: str
    prefix: str = ""

    @classmethod
    def parse(cls, uri: str) -> S3Location:
        match = _S3_URI.match(uri)
        if match is None:
            raise ValueError(f"must look like s3://bucket/prefix (bucket: 3-63 lowercase letters, digits, '.', '-'), got {uri!r}")
        return cls(bucket=match["bucket"], prefix=(match["prefix"] or "").strip("/"))

    def key_for(self, job_id: str) -> str:
        return f"{self.prefix}/{job_id}.json" if self.prefix else f"{job_id}.json"

    def uri_for(self, job_id: str) -> str:
        return f"s3://{self.bucket}/{self.key_for(job_id)}"


#: The pooling modes of an embedding job (`Embed.pooling`), as the engine's `tokenmill.engine.pooling.POOLING_MODES`.
PoolingMode = Literal["last", "mean", "cls"]


class Embed(BaseModel):
    """What an embedding job asks (`Job.embed`): the prompt's vector instead of a completion. Each None leaves the
    choice to the checkpoint, as the engine's `PoolingParams`: `pooling` ("last", "mean", "cls"), `normalize` (L2),
    `dimensions` (keep the first values, as OpenAI's `dimensions`)."""

    model_config = ConfigDict(extra="forbid")

    dimensions: int | None = Field(default=None, ge=1, strict=True)
    normalize: bool | None = Field(default=None, strict=True)
    pooling: PoolingMode | None = None


#: Continuations one score job may hold (`Score.continuations`).
MAX_CONTINUATIONS = 1024


class Score(BaseModel):
    """What a score job asks (`Job.score`): each continuation's log-likelihood given the prompt, as lm-eval-harness's
    `loglikelihood`, instead of a completion. A text continuation is tokenized alone and appended to the prompt's
    tokens (put the separating space in it: " Paris"); token ids are taken as they are."""

    model_config = ConfigDict(extra="forbid")

    continuations: list[str | list[TokenId]] = Field(min_length=1, max_length=MAX_CONTINUATIONS)

    @field_validator("continuations", mode="before")
    @classmethod
    def _check_continuations(cls, value: Any) -> Any:
        """Each a non-empty string or a non-empty list of token ids, named `score.continuations[i]` otherwise."""
        for index, item in enumerate(value if isinstance(value, list) else []):
            tokens = isinstance(item, list) and all(type(t) is int and t >= 0 for t in item)
            if not (isinstance(item, str) or tokens) or not item:
                raise InvalidRequestError(f"score.continuations[{index}]",
                                          "must be a non-empty string or a non-empty list of token ids")
        return value


class ContinuationScore(BaseModel):
    """One continuation's score (`JobResult.scores`): `logprob`, the sum of its tokens' log-probabilities (no
    temperature, no filter); `is_greedy`, whether each of its tokens is the most probable one; `num_tokens`."""

    logprob: float
    is_greedy: bool
    num_tokens: int


class Job(BaseModel):
    """One prompt to complete, to embed (`embed`) or to score continuations of (`score`).

    Exactly one of `prompt`, `messages` or `prompt_token_ids`. Sampling parameters may be given nested
    (`sampling={...}`) or flat next to the prompt (`max_tokens=64`), the way `Client.submit` and
    `generate.delay(...)` pass them; either way they are checked by `SamplingParams` itself, so the
    client and the engine apply the very same rules. `id` doubles as the idempotency key: a worker
    never recomputes a job whose result is already stored.

    With `embed` (`{}` for the checkpoint's choices), the result's `embedding` is the prompt's vector and nothing is
    generated: a sampling parameter beside it is refused, naming it. With `score`, likewise: the result's `scores`
    hold each continuation's `ContinuationScore`, in order.
    """

    model_config = ConfigDict(extra="forbid")

    version: Literal[1] = SCHEMA_VERSION
    id: str = Field(default_factory=new_job_id, pattern=JOB_ID_PATTERN)
    prompt: str | None = Field(default=None, min_length=1)
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    prompt_token_ids: list[TokenId] | None = Field(default=None, min_length=1)
    sampling: SamplingParams = Field(default_factory=SamplingParams)
    embed: Embed | None = None
    score: Score | None = None
    output: str | None = None
    metadata: dict[str, Any] = Field(default_factory=dict)
    submitted_at: float | None = None
    #: Seconds the job may run on a worker (from its start there); past it the job ends `deadline_exceeded`
    #: with what it generated so far. Celery's `time_limit` / `soft_time_limit` of `apply_async` set it too.
    deadline_s: float | None = Field(default=None, gt=0, allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _gather_flat_sampling(cls, data: Any) -> Any:
        """Move flat sampling fields (`max_tokens=...`) under `sampling`, the single place they are checked."""
        if not isinstance(data, dict) or _SAMPLING_FIELDS.isdisjoint(data):  # a set test: the usual, nested job
            return data
        flat = {k: v for k, v in data.items() if k in _SAMPLING_FIELDS}
        nested = data.get("sampling")
        if isinstance(nested, SamplingParams):
            nested = nested.to_dict()
        rest = {k: v for k, v in data.items() if k not in _SAMPLING_FIELDS}
        rest["sampling"] = {**(nested or {}), **flat}
        return rest

    @field_validator("sampling", mode="plain")
    @classmethod
    def _check_sampling(cls, value: Any) -> SamplingParams:
        if isinstance(value, SamplingParams):
            return SamplingParams.from_dict(value.to_dict())
        if isinstance(value, dict):
            return SamplingParams.from_dict(value)
        raise InvalidRequestError("sampling", f"must be an object of sampling parameters, got {type(value).__name__}")

    @field_serializer("sampling")
    def _dump_sampling(self, value: SamplingParams) -> dict[str, Any]:
        return value.to_dict()

    @field_validator("metadata", mode="after")
    @classmethod
    def _check_metadata(cls, value: dict[str, Any]) -> dict[str, Any]:
        """Metadata travels in the job and comes back in the result, both as JSON: refuse what JSON cannot hold."""
        if not value:
            return value
        check_nesting(value, "metadata")
        try:
            json.dumps(value, allow_nan=False)
        except (TypeError, ValueError) as exc:
            raise InvalidRequestError("metadata", f"must be JSON (strings, numbers, booleans, null, lists, objects): {exc}") from None
        return value

    @field_validator("output")
    @classmethod
    def _check_output(cls, value: str | None) -> str | None:
        if value is not None:
            S3Location.parse(value)
        return value

    @model_validator(mode="after")
    def _exactly_one_prompt(self) -> Job:
        if (self.prompt is None) + (self.messages is None) + (self.prompt_token_ids is None) != 2:  # per job: no getattr
            given = [name for name in _PROMPT_FIELDS if getattr(self, name) is not None]
            got = " and ".join(given) if given else "none"
            raise InvalidRequestError(
                given[-1] if given else "prompt", f"exactly one of prompt, messages, prompt_token_ids is required (got {got})"
            )
        if self.embed is not None and self.score is not None:
            raise InvalidRequestError("score", "a job embeds or scores, not both: leave out embed or score")
        if (self.embed is not None or self.score is not None) and (sampled := without_defaults(self.sampling.to_dict())):
            kind = "an embedding job (embed)" if self.score is None else "a score job (score)"
            raise InvalidRequestError(next(iter(sampled)), f"{kind} samples nothing: leave it out")
        return self

    @property
    def s3_location(self) -> S3Location | None:
        return S3Location.parse(self.output) if self.output else None

    def to_wire(self) -> dict[str, Any]:
        """The JSON-ready dict that travels as the Celery task's argument."""
        return self.model_dump(mode="json", exclude_none=True)

    def content_hash(self) -> str:
        """SHA-256 of what the job asks for: its wire form without `VOLATILE_FIELDS`, as canonical JSON.

        Stored in its result (`JobResult.job_hash`), so a job id reused for different content is told
        apart from a resubmission of the same job (which stays idempotent), as payment APIs do with
        idempotency keys.
        """
        return content_hash(self.to_wire())

    @classmethod
    def from_wire(cls, data: Any) -> Job:
        """Parse a job, turning any problem into one `InvalidRequestError` that names the field."""
        try:
            return cls.model_validate(data)
        except ValidationError as exc:
            raise invalid_request_from(exc) from None


def is_job_id(value: Any) -> bool:
    """Whether `value` is a string `JOB_ID_PATTERN` matches whole (checked per message: compiled once)."""
    return isinstance(value, str) and _JOB_ID.fullmatch(value) is not None


def is_content_hash(value: Any) -> bool:
    """Whether `value` has the form of a `content_hash` (a SHA-256 hex digest)."""
    return isinstance(value, str) and _CONTENT_HASH.fullmatch(value) is not None


def content_hash(wire: dict[str, Any]) -> str:
    """`Job.content_hash` of a job's validated wire form (`Job.to_wire()`), without parsing it again."""
    content = {k: v for k, v in wire.items() if k not in VOLATILE_FIELDS}
    return hashlib.sha256(fastjson.canonical(content, *free_form(content))).hexdigest()


def message_wire(wire: dict[str, Any]) -> dict[str, Any]:
    """A job's validated wire form (`Job.to_wire()`) as its queue message carries it: its sampling values without the
    defaults (`without_defaults`), which `Job` fills back in as it parses, so a worker gets the same job, and the same
    content hash, from a smaller message in Redis."""
    sampling = wire.get("sampling")
    return {**wire, "sampling": without_defaults(sampling)} if isinstance(sampling, dict) else wire


def free_form(wire: dict[str, Any]) -> tuple[Any, ...]:
    """The parts of a job's validated wire form that may hold any JSON value (its metadata, its JSON schema; the rest
    is strings, integers and checked finite numbers): what `fastjson` checks before writing a job with orjson."""
    sampling = wire.get("sampling")
    return wire.get("metadata"), sampling.get("json_schema") if isinstance(sampling, dict) else None


def invalid_request_from(exc: ValidationError) -> InvalidRequestError:
    """The first error of a pydantic ValidationError, as an InvalidRequestError naming the field.

    Errors raised by `SamplingParams` keep their own field name (`max_tokens`, not `sampling`),
    because that is the name the producer wrote.
    """
    first = exc.errors(include_url=False)[0]
    inner = (first.get("ctx") or {}).get("error")
    if isinstance(inner, InvalidRequestError):
        return inner
    loc = "".join(f"[{part}]" if isinstance(part, int) else f".{part}" for part in first["loc"]).lstrip(".") or "job"
    message = first["msg"].removeprefix("Value error, ")
    if first["type"] == "extra_forbidden":
        message = "unknown field"
    return InvalidRequestError(loc, message)


#: Compact JSON of decoded JSON is at most this many times longer than its source: a character of 1-4 UTF-8
#: bytes becomes at most one or two `\uXXXX` (6x for DEL, sent raw and escaped back), a float such as `1e15`
#: is written out (4.5x).
REENCODED_GROWTH = 6
#: Bytes a worker may add to a decoded job before checking it (its `id`, from the task id).
_ADDED_BYTES = 1024


def job_payload(args: tuple[Any, ...], fields: dict[str, Any]) -> dict[str, Any]:
    """The job object of a `tokenmill.generate` call (empty when the job came as keyword fields only); pops `job` from
    `fields`. A plain Celery producer may send the job positionally, as `job=`, or as keyword fields."""
    if "job" in fields:
        args = (*args, fields.pop("job"))
    if len(args) > 1:
        raise InvalidRequestError("job", f"expected one job object, got {len(args)} positional arguments")
    payload = args[0] if args else {}
    if payload is None:
        return {}
    if not isinstance(payload, dict):
        raise InvalidRequestError("job", f"must be an object of job fields, got {type(payload).__name__} "
                                         "(send prompt=... as a keyword argument, or a dict)")
    return payload


def check_size(wire: dict[str, Any], limit: int, source: bytes | None = None) -> None:
    """Refuse a job whose JSON is over `limit` bytes, naming the field that makes it big.

    The client checks the job it is about to queue, the worker every job it receives before parsing or
    tokenizing anything (a job sent with plain Celery never met the client); both with the setting
    `max_job_bytes` (`tokenmill.queue.settings.MAX_JOB_BYTES` by default). Encoding recurses, so each field's
    nesting is checked first (`MAX_NESTING`, naming the field as `Job` would: a sampling field by its own name).

    `source`: the JSON text `wire` was decoded from (or one holding it, such as its message's body). When it is
    too short for any re-encoding to pass `limit` (`REENCODED_GROWTH`) and has too few brackets for any field to
    nest past `MAX_NESTING`, the job passes without encoding it (a typical job does, and skips the encoding's
    cost).
    """
    if (source is not None and len(source) * REENCODED_GROWTH + _ADDED_BYTES <= limit
            and source.count(b"[") + source.count(b"{") <= MAX_NESTING):
        return
    for name, value in wire.items():
        if name == "sampling" and isinstance(value, dict):
            for inner, setting in value.items():
                check_nesting(setting, str(inner))
        else:
            check_nesting(value, name)
    size = len(json.dumps(wire, separators=(",", ":"), default=str).encode())
    if size <= limit:
        return
    sizes = {name: len(json.dumps(value, separators=(",", ":"), default=str).encode()) for name, value in wire.items()}
    biggest = max(sizes, key=sizes.__getitem__)
    raise InvalidRequestError(
        biggest, f"job is {size} bytes encoded, over the {limit}-byte limit ({biggest} alone is {sizes[biggest]} bytes)"
    )


class Usage(BaseModel):
    """Token counts, as OpenAI-style APIs report them."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class JobError(BaseModel):
    """Why a job failed. `code` is stable (match on it); `message` is for people; `field` names bad input."""

    code: Literal["invalid_job", "invalid_request", "dead_letter", "output_write_failed", "task_failure", "cancelled",
                  "deadline_exceeded", "conflict", "constraint_incomplete", "constraint_failed"]
    message: str
    field: str | None = None


class JobResult(BaseModel):
    """The final outcome of one job.

    When the job named an S3 destination, the full result is the JSON object at `output_uri` and the
    copy in Redis is a stub without `text`, `token_ids`, `logprobs`, `parsed`, `choice_probabilities`, `embedding` and
    `scores`, so Redis does not hold large payloads twice; `read()` fetches the full result.
    """

    model_config = ConfigDict(extra="ignore")

    version: Literal[1] = SCHEMA_VERSION
    id: str
    status: Literal["succeeded", "failed", "cancelled"]  # cancelled: `text` holds what it generated before
    text: str | None = None
    token_ids: list[int] | None = None
    finish_reason: str | None = None  # "stop" (EOS, stop token or string), "length"; stopped early: "cancelled", "deadline"
    # `logprobs=N`: per generated token {"token_id", "token", "bytes", "logprob", "top_logprobs": [[id, logprob]] (the
    # N most likely), "top_tokens": [[token, bytes]] (theirs, in the same order)}; `token` is the token's text as the
    # tokenizer decodes it alone, `bytes` its own bytes (a token holding part of a UTF-8 character too)
    logprobs: list[Any] | None = None
    parsed: Any = None  # json_schema / json_object: the completion's JSON value, when it satisfies the constraint
    constraint_satisfied: bool | None = None  # structured outputs: False when cut by max_tokens or a stop string
    # structured outputs: why a complete output failed the engine's final check (keyword and schema pointer);
    # optional, so results written before it still parse
    constraint_error: str | None = None
    # structured outputs: the grammar backend that enforced it ("xgrammar" or "llguidance"); optional as above
    constraint_backend: str | None = None
    # `choice_probabilities=True`: each choice's probability given the prompt, normalised over the choices (`text` is
    # the most probable); optional as above
    choice_probabilities: dict[str, float] | None = None
    # `embed`: the prompt's vector (`text` is empty, `usage.completion_tokens` 0); optional as above
    embedding: list[float] | None = None
    # `score`: each continuation's score, in order (`text` is empty, `usage.completion_tokens` 0); optional as above
    scores: list[ContinuationScore] | None = None
    usage: Usage | None = None
    queued_at: Timestamp = None
    started_at: Timestamp = None
    first_token_at: Timestamp = None
    finished_at: Timestamp = None
    output_uri: str | None = None
    error: JobError | None = None
    attempt: int | None = None
    worker: str | None = None
    metadata: dict[str, Any] = Field(default_factory=dict)
    job_hash: str | None = None  # `Job.content_hash()` of the job this is the result of (None: unparsable job, older worker)

    @property
    def ok(self) -> bool:
        return self.status == "succeeded"

    @classmethod
    def failure(cls, job_id: str, code: str, message: str, field: str | None = None, **extra: Any) -> JobResult:
        """A failed result; `finished_at` defaults to now."""
        extra.setdefault("finished_at", time.time())
        return cls(id=job_id, status="failed", error=JobError(code=code, message=message, field=field), **extra)

    @classmethod
    def cancelled(cls, job_id: str, message: str, **extra: Any) -> JobResult:
        """A cancelled result (code `cancelled`); `finished_at` defaults to now."""
        extra.setdefault("finished_at", time.time())
        return cls(id=job_id, status="cancelled", error=JobError(code="cancelled", message=message), **extra)

    def stub(self, output_uri: str) -> JobResult:
        """The Redis copy of a result whose full JSON lives at `output_uri`."""
        return self.model_copy(update={"output_uri": output_uri, "text": None, "token_ids": None, "logprobs": None,
                                       "parsed": None, "choice_probabilities": None, "embedding": None,
                                       "scores": None})

    def to_wire(self) -> dict[str, Any]:
        return self.model_dump(mode="json")

    def read(self, endpoint_url: str | None = None) -> JobResult:
        """The full result: this one when its text is here (no `output_uri`, or read already), else the
        JSON object the worker wrote at `output_uri`, with that `output_uri`.

        Args:
            endpoint_url: the S3 endpoint (MinIO, ...); default `TOKENMILL_S3_ENDPOINT_URL`, else boto3's own.

        Raises:
            ResultReadError: the object could not be read (no such key, access denied, ...) or holds another
                job's result; its message names the s3:// URI and the cause.
            ImportError: boto3 is not installed (`pip install boto3`, or the `worker` extra).
        """
        if self.output_uri is None or self.text is not None:
            return self
        body = read_object(self.output_uri, endpoint_url)
        try:
            full = JobResult.model_validate_json(body)
        except ValidationError as exc:
            first = exc.errors(include_url=False)[0]["msg"]
            raise ResultReadError(self.output_uri, f"not a job result: {first}") from None
        if full.id != self.id or (None not in (full.job_hash, self.job_hash) and full.job_hash != self.job_hash):
            raise ResultReadError(self.output_uri, f"holds the result of another job ({full.id}, content "
                                                   f"{(full.job_hash or '?')[:12]}), not of job {self.id}")
        return full.model_copy(update={"output_uri": self.output_uri})

    def conflict_with(self, job_hash: str | None) -> JobResult | None:
        """A failed `conflict` result when this stored result belongs to other content under the same id, else None.

        A result without a hash (an older worker's, or a job that could not be parsed) cannot be told apart
        and is taken as the job's own.
        """
        if job_hash is None or self.job_hash is None or self.job_hash == job_hash:
            return None
        return JobResult.failure(
            self.id, "conflict", f"job id {self.id!r} was already used for a job with different content (stored result "
            f"for content {self.job_hash[:12]}, this job is {job_hash[:12]}); the stored result is that job's and is "
            "kept: submit this job under a new id", "id", job_hash=job_hash)
