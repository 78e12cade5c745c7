"""Queue settings: what both sides of the queue need (broker, result backend, queue name, delays, job size),
a pydantic-settings model read from `TOKENMILL_*` environment variables. Torch-free.

`tokenmill.worker.settings.WorkerSettings` extends it with what only a worker needs.
"""

from __future__ import annotations

import argparse
import types
import typing
from collections.abc import Iterable, Sequence
from typing import Any

from pydantic import Field, ValidationError, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from tokenmill.queue.names import DEFAULT_QUEUE
from tokenmill.queue.tls import check_redis_url

#: Largest encoded job (its JSON, in bytes) a client queues and a worker accepts (`TOKENMILL_MAX_JOB_BYTES`
#: changes both). Redis holds every queued job in memory and a worker tokenizes its prompt; prompts larger
#: than this belong in object storage.
MAX_JOB_BYTES = 1 << 20


class QueueSettings(BaseSettings):
    """Broker-side settings shared by producers and workers."""

    # An empty variable counts as unset, so `TOKENMILL_X: ${TOKENMILL_X:-}` in docker-compose.yml passes a
    # value through when .env sets one and leaves the default here otherwise.
    model_config = SettingsConfigDict(env_prefix="TOKENMILL_", extra="ignore", env_ignore_empty=True)

    broker_url: str = Field(
        "redis://localhost:6379/0", description="Redis URL of the Celery broker; rediss:// means TLS with the server "
        "certificate verified (CA: its ssl_ca_certs parameter, else the system store).",
    )
    result_backend: str | None = Field(None, description="Redis URL for results; defaults to the broker URL.")
    queue: str = Field(DEFAULT_QUEUE, min_length=1, description="Queue that jobs are sent to by default.")
    visibility_timeout: float = Field(
        60.0,
        gt=0,
        description="Seconds after which a job delivered to a worker that stopped renewing its lease "
        "(crashed, killed) is delivered again. Live workers renew leases, so slow jobs are not rerun.",
    )
    result_expires: int = Field(25 * 3600, gt=0, description="Seconds a result stays in Redis (25 hours: an hour past "
                                "`tokenmill serve`'s longest completion window, 24h).")
    redis_socket_timeout: float = Field(
        30.0, gt=0, description="Seconds any Redis call (the broker's, the results', the worker's own) waits for a "
        "reply before its connection counts as dead (a paused server, a dropped route) and the call is retried on a "
        "new one; keep it above the longest script a call runs.",
    )
    max_job_bytes: int = Field(
        MAX_JOB_BYTES, ge=1024, description="Largest encoded job (JSON bytes): clients refuse to queue a larger "
        "one, workers fail it (invalid_job, naming the biggest field) before parsing or tokenizing it.",
    )

    @field_validator("broker_url", "result_backend")
    @classmethod
    def _check_tls(cls, value: str | None) -> str | None:
        return None if value is None else check_redis_url(value)

    @property
    def backend_url(self) -> str:
        return self.result_backend or self.broker_url


def add_settings_flags(parser: argparse.ArgumentParser, settings: type[BaseSettings], names: Iterable[str] | None = None,
                       aliases: dict[str, list[str]] | None = None) -> None:
    """A `--field-name` option per field of `settings` (or of `names`, in that order), with its description, its default
    and its `TOKENMILL_FIELD_NAME` twin in the help; left unset, the variable or the default holds (dest = the field)."""
    for name in names or settings.model_fields:
        info = settings.model_fields[name]
        kind, choices = flag_type(info.annotation)
        default = f" (default: {info.default})" if info.default not in (None, "") else ""
        add_flag(parser, [f"--{name.replace('_', '-')}", *(aliases or {}).get(name, [])], name, kind, choices,
                 f"{info.description}{default} [env TOKENMILL_{name.upper()}]")


def add_flag(parser: argparse.ArgumentParser, flags: list[str], dest: str, kind: type, choices: Sequence[Any] | None,
             help_text: str, metavar: str | None = None) -> None:
    """One option whose default is None (not given: nothing to override); a bool as `--x` / `--no-x`."""
    help_text = help_text.replace("%", "%%")
    if kind is bool:
        parser.add_argument(*flags, dest=dest, action=argparse.BooleanOptionalAction, default=None, help=help_text)
    else:
        parser.add_argument(*flags, dest=dest, type=kind, choices=choices, default=None, metavar=metavar,
                            help=help_text)


def flag_type(annotation: Any) -> tuple[type, tuple[Any, ...] | None]:
    """What a settings field is on the command line: the type argparse converts to and the allowed values.
    `int | None` -> int; `Literal["a", "b"]` -> str, ("a", "b"); lists are given comma-separated (str)."""
    if typing.get_origin(annotation) is typing.Annotated:
        annotation = typing.get_args(annotation)[0]
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        annotation = next(a for a in typing.get_args(annotation) if a is not type(None))
    if typing.get_origin(annotation) is typing.Literal:
        return str, typing.get_args(annotation)
    return (annotation if annotation in (bool, int, float) else str), None


def setting_problems(exc: ValidationError) -> list[str]:
    """One line per setting a `ValidationError` of a settings class refuses, named as its flag (`--max-num-seqs`);
    a check of several settings at once names them itself."""
    problems = []
    for error in exc.errors():
        message = error["msg"].removeprefix("Value error, ")
        if error["loc"]:
            message = f"--{str(error['loc'][0]).replace('_', '-')}: {message} (got {error.get('input')!r})"
        problems.append(message)
    return problems
