"""`RunOptions`: where and how an `annotate` or `batch` run computes, one value for both runs and their CLI.

Each field with a `metadata["help"]` is also a flag of both subcommands (`tokenmill.apps.cli.add_run_flags`), with
that help, the field's default and a type from its annotation: a run option added here reaches the Python API and
both commands alike. The engine's own options are `EngineConfig`'s (`ENGINE_OPTIONS`), carried in `engine_options`.
Light on purpose (no pyarrow): the CLI reads these fields while it builds its parser, for every subcommand.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import Field, dataclass, field, fields
from typing import Any, Literal

from tokenmill.errors import InvalidRequestError

#: The JSONL/CSV codecs a run can be told to decompress with ("none": read as it is).
Compression = Literal["none", "gzip", "bz2", "zstd", "lz4"]


def _flag(default: Any, help: str, metavar: str | None = None, env: str | None = None) -> Any:
    """A field that is also a flag: `help` its flag's help, `env` the variable whose value is the flag's default."""
    return field(default=default, metadata={"help": help, "metavar": metavar, "env": env})


@dataclass(frozen=True)
class RunOptions:
    """The options `annotate` and `batch` share: where rows are computed (the engine here, or queue workers), where
    the checkpoint lives, how the input is read, how much is in flight. Every default is the runs' default."""

    #: The embedded engine's model (a local directory, a hub id, builtin:tiny); with `broker`, only its name in keys.
    model: str | None = _flag(None, "model of the embedded engine, required without --broker: a local directory, a "
                              "Hugging Face hub id, or builtin:tiny (random weights, for tests); with --broker the "
                              "workers' model runs and this only names it [env TOKENMILL_MODEL]", env="TOKENMILL_MODEL")
    #: A Redis URL: rows go to queue workers; None: the engine runs in this process.
    broker: str | None = _flag(None, "redis://... : distributed mode, rows go to queue workers")
    #: The workers' queue (None: tokenmill's default queue).
    queue: str | None = _flag(None, "queue name (default: tokenmill)")
    #: A loaded `tokenmill.LLM` to run embedded, instead of loading `model`.
    llm: Any = None
    #: `EngineConfig` fields of the engine `model` loads here (None or left out: the engine's defaults).
    engine_options: Mapping[str, Any] | None = None
    #: The checkpoint's directory (None: `default_state_dir` of the output).
    state_dir: str | None = _flag(None, "checkpoint directory (default: <output>.tokenmill-state)")
    #: Seconds a finished row may wait before the checkpoint commits it, at most (0: at once).
    checkpoint_interval: float = _flag(2.0, "commit finished rows to the checkpoint at least this often (0: after "
                                       "every row)", metavar="SECONDS")
    #: A resume computes again the rows that ended in error.
    retry_failed: bool = _flag(False, "recompute rows that ended in error")
    #: A resume computes again the rows cancelled with `tokenmill cancel` (a Ctrl-C's rows are, whatever this says).
    retry_cancelled: bool = _flag(False, "recompute rows cancelled with `tokenmill cancel` (a Ctrl-C's rows are "
                                  "recomputed anyway)")
    #: Distributed: Ctrl-C leaves the queued rows running instead of cancelling them.
    detach: bool = _flag(False, "distributed: on Ctrl-C leave the queued rows running (default: cancel them)")
    #: The S3-compatible endpoint of s3:// inputs and outputs (None: `TOKENMILL_S3_ENDPOINT_URL`, else boto3's).
    s3_endpoint_url: str | None = _flag(None, "S3-compatible endpoint (MinIO...) [env TOKENMILL_S3_ENDPOINT_URL]")
    #: Rows in flight at most (None: `runners.DEFAULT_WINDOW` of the mode); the input is never read further ahead.
    window: int | None = _flag(None, "rows in flight at most (default 1024 embedded, 4096 distributed)")
    #: Jobs per queue message (distributed).
    rows_per_message: int = _flag(32, "rows per queue message (distributed)")
    #: A row or line longer than this, decompressed, is not read: it fails alone (`datasets.MAX_ROW_BYTES`).
    max_row_bytes: int = _flag(1 << 20, "a row or line longer than this (decompressed) is not read: it fails alone "
                               "(default 1 MiB)", metavar="BYTES")
    #: The JSONL/CSV input's codec (None: each file's suffix decides).
    input_compression: Compression | None = _flag(None, "decompress the JSONL/CSV input with this codec (default: "
                                                  "by suffix, .gz .bz2 .zst .lz4)")
    #: No progress bar, no summary table.
    quiet: bool = _flag(False, "no progress bar, no summary table")

    def __post_init__(self) -> None:
        if self.broker is not None and "://" not in self.broker:
            raise InvalidRequestError("broker", f"must be a Redis URL such as redis://localhost:6379/0, got "
                                      f"{self.broker[:64]!r}")
        for name, low in (("window", 1), ("rows_per_message", 1), ("max_row_bytes", 1)):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < low):
                raise InvalidRequestError(name, f"must be an integer >= {low}, got {value!r}")
        interval = self.checkpoint_interval
        if isinstance(interval, bool) or not isinstance(interval, int | float) or not 0 <= interval < float("inf"):
            raise InvalidRequestError("checkpoint_interval", f"must be a number of seconds >= 0, got {interval!r}")

    @property
    def mode(self) -> str:
        """Where rows are computed: "queue" (workers, with a broker) or "embedded" (this process)."""
        return "queue" if self.broker else "embedded"

    @property
    def model_label(self) -> str:
        """The model's name in result keys. Distributed without a model, the queue stands for the workers' model."""
        if self.model:
            return self.model
        if self.llm is not None:
            return self.llm.engine.config.model
        return f"queue:{self.queue or 'tokenmill'}" if self.broker else "builtin:tiny"


def run_options(options: RunOptions | None, keywords: Mapping[str, Any]) -> RunOptions:
    """The options of a run given either as `options` or as keyword arguments (`keywords`: the caller's own, read by
    field name, e.g. its `locals()`, so every field must be a keyword of the caller); a keyword away from its default
    beside `options` raises `InvalidRequestError` ("options"), as it would otherwise be ignored (one at its default
    cannot be told from one left out). Options that leave no engine to run raise as `require_model` does."""
    given = RunOptions(**{spec.name: keywords[spec.name] for spec in fields(RunOptions)})
    if options is None:
        require_model(given)
        return given
    if given != RunOptions():
        raise InvalidRequestError("options", "give the run options as options=RunOptions(...) or as keywords, not both")
    require_model(options)
    return options


def require_model(options: RunOptions) -> None:
    """Raise `InvalidRequestError` ("model") where `options` name no engine: no broker, no `model` and no `llm`. The
    one check of it, with one message: the CLI (`options_from`), `annotate`, `batch` (`run_options`) and
    `make_runner` all call it."""
    if options.mode == "embedded" and not options.model and options.llm is None:
        raise InvalidRequestError("model", "required without --broker: pass --model (or set TOKENMILL_MODEL; in "
                                  "Python, model= or a loaded llm=) to a local directory or a Hugging Face hub id "
                                  "(builtin:tiny names the random-weight test model)")


def flag_fields() -> tuple[Field[Any], ...]:
    """The fields of `RunOptions` that are also flags (those with a help), in the order the help lists them."""
    return tuple(spec for spec in fields(RunOptions) if "help" in spec.metadata)
