"""Worker configuration: `WorkerSettings`, read from `TOKENMILL_*` environment variables or `tokenmill worker` flags.

It adds to `QueueSettings` what only a worker needs; the flags are generated from its fields, so a setting has one
name, default and description. Torch-free.
See docs/internals/worker.md, section "Celery and kombu adapters".
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, create_model, field_validator, model_validator
from pydantic_settings import NoDecode

from tokenmill.engine.config import ENGINE_OPTIONS, EngineConfig, EngineOption
from tokenmill.errors import ModelLoadError

from tokenmill.queue.schemas import S3Location
from tokenmill.queue.settings import QueueSettings
from tokenmill.worker.cpus import placement


def _engine_field(option: EngineOption) -> tuple[Any, Any]:
    kind: Any = Literal[option.choices] if option.choices else option.kind
    return (kind | None if option.optional else kind), Field(option.default, description=option.help)


#: The model (required: there is no default model), then one setting per `EngineConfig` option, named, typed,
#: described and defaulted as the engine declares it.
_EngineSettings: Any = create_model(
    "_EngineSettings", __base__=QueueSettings,
    model=(str | None, Field(None, description="Model (required): a local directory, a Hugging Face hub id, or "
                                               "builtin:tiny (random weights, for tests).")),
    **{option.name: _engine_field(option) for option in ENGINE_OPTIONS})


class WorkerSettings(_EngineSettings):  # type: ignore[misc]
    """Everything `tokenmill worker` can be told, by flag or by `TOKENMILL_<NAME>` variable: the queue's settings,
    every engine option (`ENGINE_OPTIONS`, checked by `EngineConfig` itself) and the worker's own."""

    queues: Annotated[list[str] | None, NoDecode] = Field(
        None, description="Comma-separated queues to consume; defaults to --queue."
    )
    concurrency: int | None = Field(
        None, ge=1, description="Jobs held at once (in the engine or writing results); default: 1.25 x --max-num-seqs."
    )
    hostname: str = Field("tokenmill@%h", description="Celery node name (%h: host name).")
    max_deliveries: int = Field(
        5, ge=1, description="Deliveries after which a job that never finishes (it keeps killing workers, "
        "or its run keeps failing and being requeued) is dead-lettered."
    )
    dead_letter_max_len: int = Field(
        10000, ge=1, description="Most entries kept in the dead-letter list (the oldest are dropped beyond it)."
    )
    dead_letter_expires: int = Field(
        30 * 86400, ge=0, description="Seconds the dead-letter list lives after its last new entry (0: no expiry)."
    )
    worker_nice: int = Field(
        10, ge=0, le=19, description="How much lower the CPU priority of the worker's own threads (Celery, job "
        "bookkeeping, result writes) is than its engine process's (a Unix nice increment): when cores are short, "
        "the engine, which every job in the batch waits on, runs first. 0: the same priority.",
    )
    engine_cpus: str = Field(
        "off", description="CPUs of the engine process, the worker's own threads on the other available ones: a list "
        "(2 or 2-3,6), auto (the last available CPU), or off (both anywhere). With a CPU of its own the engine's steps "
        "no longer share one with the worker's work on its jobs. For one worker per machine, or give each its own.",
    )
    remote_control_writes: bool = Field(
        False, description="Accept Celery's remote commands that change a worker (shutdown, pool_grow/shrink/restart, "
        "autoscale, add/cancel_consumer) from anyone who can write to the broker; off: they answer with an error. "
        "revoke (= cancel), inspect and events always work.",
    )
    single_job_intake: bool = Field(
        True, description="Run single tokenmill.generate jobs in groups (admitted by one intake thread, their results "
        "stored and acked by one finisher thread) instead of one Celery pool thread each (jobs with a deadline, time "
        "limit or S3 output keep the pool path); off: all on the pool.",
    )
    shutdown_grace: float = Field(
        60.0, ge=0, description="Seconds after SIGTERM that in-flight jobs may take to finish before they are requeued."
    )
    broker_wait: float = Field(
        60.0, ge=0, description="Seconds a starting worker waits for its broker and result backend to answer before it "
        "exits with code 69 (EX_UNAVAILABLE) naming them; once started, it reconnects for as long as it takes.",
    )
    engine_stall_timeout: float = Field(
        300.0, gt=0, description="Seconds the engine may hold jobs without a step or a message before the worker "
        "counts it stuck (frozen, deadlocked, a step that never ends): it logs why, stops taking jobs, hands the "
        "messages it holds back to their queues and exits with code 70 for its supervisor to restart it. Keep it "
        "above the longest step the engine takes (a step reports at least every 0.5 s).",
    )
    metrics_port: int = Field(
        9400, ge=0, le=65535, description="First Prometheus metrics port tried; if it is taken (another worker on "
        "this host), the next ones up to --metrics-port-tries; the port used is logged. 0 disables the endpoint.",
    )
    metrics_port_tries: int = Field(
        16, ge=1, le=1024, description="Successive ports tried from --metrics-port (1: that port or fail)."
    )
    metrics_addr: str = Field(
        "127.0.0.1", description="Address the metrics endpoint listens on: loopback by default, since the metrics "
        "name queues and workers and carry no authentication; 0.0.0.0 where a scraper on another host or "
        "container must reach it (docker-compose.yml sets it for its workers).",
    )
    output_prefixes: Annotated[list[str] | None, NoDecode] = Field(
        None, description="Comma-separated S3 prefixes that jobs may write their results under (s3://bucket/ or "
        "s3://bucket/prefix/); a job whose output is elsewhere fails (invalid_request, field output) before it is "
        "generated. Unset: jobs with an output are refused.",
    )
    s3_endpoint_url: str | None = Field(None, description="S3 endpoint (MinIO, moto, ...); default: AWS.")
    s3_region: str | None = Field(None, description="S3 region name.")
    s3_retry_max_delay: float = Field(30.0, gt=0, description="Longest pause between S3 write attempts (seconds).")
    log_prompts: bool = Field(False, description="Log prompt and completion text (off: logs carry ids and counts only).")
    log_level: str = Field("INFO", description="Log level.")
    @field_validator("queues", mode="before")
    @classmethod
    def _split_queues(cls, value: Any) -> Any:
        if isinstance(value, str):
            return [part.strip() for part in value.split(",") if part.strip()]
        return value

    @field_validator("output_prefixes", mode="before")
    @classmethod
    def _split_prefixes(cls, value: Any) -> Any:
        if isinstance(value, str):
            value = [part.strip() for part in value.split(",") if part.strip()]
        for entry in value or []:
            if not isinstance(entry, str) or not entry.startswith("s3://"):
                raise ValueError(f"{entry!r} is not an s3://bucket/prefix/ URI")
            S3Location.parse(entry)  # ValueError naming the entry
        return value

    @field_validator("engine_cpus")
    @classmethod
    def _check_engine_cpus(cls, value: str) -> str:
        placement(value)  # ValueError naming what cannot be done here
        return value

    @model_validator(mode="after")
    def _default_queues(self) -> WorkerSettings:
        if not self.queues:
            self.queues = [self.queue]
        return self

    @model_validator(mode="after")
    def _check_engine_options(self) -> WorkerSettings:
        EngineConfig.from_kwargs(self.model or "builtin:tiny", **self.engine_options())  # ValueError naming the option
        return self

    def engine_model(self) -> str:
        """The model the engine loads; `ModelLoadError` when none was given (there is no default model)."""
        if not self.model:
            raise ModelLoadError("no model given: pass --model (or set TOKENMILL_MODEL) to a local directory or a "
                                 "Hugging Face hub id (builtin:tiny names the random-weight test model)")
        return self.model

    @property
    def in_flight_capacity(self) -> int:
        """Jobs a worker takes from the queue at once: a quarter more than the engine runs, so a finished sequence's
        slot is refilled at the next step, not after a broker round trip; more would hide jobs from other workers."""
        return self.concurrency or self.max_num_seqs + max(1, self.max_num_seqs // 4)

    @property
    def take_at_least(self) -> int:
        """Free slots a full worker waits for before it takes more jobs (the transport's `take_at_least`): half the
        jobs beyond `max_num_seqs`, which the engine runs meanwhile, so each take's round trips serve more jobs."""
        return max(1, (self.in_flight_capacity - self.max_num_seqs) // 2)

    def engine_options(self) -> dict[str, Any]:
        """Keyword options of `LLMEngine` (its `EngineConfig`, less the model)."""
        return {option.name: getattr(self, option.name) for option in ENGINE_OPTIONS}
