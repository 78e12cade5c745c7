"""`tokenmill annotate` / `tokenmill.annotate(...)`: one prompt template over a whole dataset.

Each row is rendered with Jinja2's immutable sandbox (StrictUndefined: a column the template names that the
row lacks, or holds null, is that row's error; a template reaching for Python internals, e.g.
`cycler.__init__.__globals__`, gets a `SecurityError` naming its line instead of running code), completed in this process or by queue workers, checkpointed, and written back
with its input columns unchanged plus the result columns, in input order.
"""

from __future__ import annotations

import json
import time
import traceback
from collections.abc import Iterator
from typing import Any

import jinja2
import jinja2.meta
import jinja2.sandbox
import pyarrow as pa
from pydantic import ValidationError

from tokenmill.apps.arrow_schema import Column, parsed_column
from tokenmill.apps.datasets import (MAX_ROW_BYTES, Dataset, DatasetError, Writer, check_output, format_of,
                                    open_dataset)
from tokenmill.apps.options import RunOptions, run_options
from tokenmill.apps.pipeline import Summary, compute_all, open_checkpoint, stored
from tokenmill.apps.runners import Unit, make_runner, sampling_dict
from tokenmill.apps.store import Checkpoint, KeyHasher, Outcome
from tokenmill.errors import InvalidRequestError
from tokenmill.queue.schemas import Embed, Score, invalid_request_from

#: The result columns after the text column, with their Parquet types (all nullable: a failed row has nulls).
RESULT_COLUMNS = {"parsed": pa.string(), "finish_reason": pa.string(), "prompt_tokens": pa.int64(),
                  "completion_tokens": pa.int64(), "error": pa.string()}
#: The column of each row's probability per choice, with `--probabilities`.
PROBABILITIES = "probabilities"
#: The column of each row's generated tokens with their logprobs and top alternatives, with `--logprobs N`: in
#: Parquet a list of this struct, in JSONL a list of objects of the same fields.
LOGPROBS = "logprobs"
LOGPROBS_TYPE = pa.list_(pa.struct([
    ("token", pa.string()), ("logprob", pa.float64()),
    ("top_logprobs", pa.list_(pa.struct([("token", pa.string()), ("logprob", pa.float64())]))),
]))
#: With `--embed`, the result columns instead: each row's vector (in JSONL a list of floats), its prompt tokens,
#: its error.
EMBEDDING = "embedding"
EMBED_COLUMNS = {EMBEDDING: pa.list_(pa.float32()), "prompt_tokens": pa.int64(), "error": pa.string()}
#: With `--score`, the result columns instead: each row's continuations scored, in order (in JSONL a list of objects
#: of the same fields), its prompt tokens, its error.
SCORES = "scores"
SCORE_COLUMNS = {SCORES: pa.list_(pa.struct([("continuation", pa.string()), ("logprob", pa.float64()),
                                              ("is_greedy", pa.bool_()), ("num_tokens", pa.int64())])),
                 "prompt_tokens": pa.int64(), "error": pa.string()}


class Prompter:
    """Renders a row into a unit (or an error): the template, the optional system prompt, chat or not."""

    def __init__(self, template: str, system: str | None, chat: bool, model: str, sampling: dict[str, Any],
                 embed: dict[str, Any] | None = None, score: list[str] | None = None) -> None:
        """`embed` (`Embed`'s fields): each row's prompt is embedded, not completed (`sampling` then empty); `score`
        (continuations): each row's prompt scores them, likewise."""
        # Templates come from the command line or a file, maybe someone else's: the sandbox refuses attribute
        # access to internals and calls of unsafe callables, and immutable also refuses mutating row values.
        self.env = jinja2.sandbox.ImmutableSandboxedEnvironment(undefined=jinja2.StrictUndefined,
                                                                keep_trailing_newline=True, autoescape=False)
        self.template = self._compile(template, "template")
        self.system = self._compile(system, "system") if system else None
        self._templates = [("template", self.template)] + ([("system", self.system)] if self.system else [])
        #: only the columns the templates name go into their context (rows can be wide)
        self.names = sorted(set().union(*(jinja2.meta.find_undeclared_variables(self.env.parse(src))
                                          for src in (template, system or ""))))
        self.chat = chat
        self.sampling = sampling
        self.embed = embed
        self.score = score
        payload = {"embed": embed} if embed is not None else {"score": score} if score is not None else {}
        self._key = KeyHasher(model=model, sampling=sampling, **payload)

    def check_columns(self, columns: list[str]) -> None:
        """The columns the templates name all exist in the input (`InvalidRequestError` on template otherwise): checked
        once, before any model loads, instead of failing every row alike."""
        missing = [name for name in self.names if name not in columns and name not in self.env.globals]
        if missing:
            raise InvalidRequestError("template", f"names column(s) {', '.join(map(repr, missing))} that the input "
                                                  f"does not have (columns: {', '.join(columns)})")

    def _compile(self, source: str, what: str) -> jinja2.Template:
        try:
            return self.env.from_string(source)
        except jinja2.TemplateSyntaxError as exc:
            raise InvalidRequestError(what, f"line {exc.lineno}: {exc.message}") from None

    def _render(self, template: jinja2.Template, context: dict[str, Any]) -> str:
        # `Template.render` rebuilds its globals chain per call; a shared context is half the cost per row
        return "".join(template.root_render_func(template.new_context({**self.env.globals, **context}, shared=True)))

    def unit(self, row: dict[str, Any], label: str) -> Unit | str:
        context = {k: row[k] for k in self.names if row.get(k) is not None}  # a null column counts as missing
        rendered: list[str | None] = []
        for what, template in self._templates:
            try:
                rendered.append(self._render(template, context))
            except jinja2.UndefinedError as exc:
                return f"{what}: column {exc.message} or null in this row (columns: {', '.join(row)})"
            except Exception as exc:  # e.g. a filter failing on this row's value, or the sandbox refusing: this row only
                return f"{what}: line {_template_line(template, exc)}: {type(exc).__name__}: {exc}"
        text, system = (rendered + [None])[:2]
        if self.chat:
            messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": text}]
            return Unit(self._key(messages=messages), None, messages, self.sampling, label=label, embed=self.embed,
                        score=self.score)
        prompt = f"{system}\n\n{text}" if system else text
        return Unit(self._key(prompt=prompt), prompt, None, self.sampling, label=label, embed=self.embed,
                    score=self.score)


def _template_line(template: jinja2.Template, exc: BaseException) -> int | str:
    """The template line an error was raised at: the last frame of the template's compiled code, mapped back
    by jinja2's own debug info (rendering through `root_render_func` skips jinja2's traceback rewriting)."""
    code = template.root_render_func.__code__.co_filename
    lines = [lineno for frame, lineno in traceback.walk_tb(exc.__traceback__) if frame.f_code.co_filename == code]
    return template.get_corresponding_lineno(lines[-1]) if lines else "?"


def annotate(
    input: str,
    output: str,
    template: str,
    *,
    system: str | None = None,
    chat: bool = False,
    options: RunOptions | None = None,
    model: str | None = None,
    broker: str | None = None,
    queue: str | None = None,
    llm: Any = None,
    engine_options: dict[str, Any] | None = None,
    json_schema: dict[str, Any] | str | None = None,
    choice: list[str] | None = None,
    regex: str | None = None,
    id_column: str | None = None,
    column: str = "annotation",
    input_format: str | None = None,
    output_format: str | None = None,
    state_dir: str | None = None,
    checkpoint_interval: float = 2.0,
    retry_failed: bool = False,
    retry_cancelled: bool = False,
    detach: bool = False,
    s3_endpoint_url: str | None = None,
    window: int | None = None,
    rows_per_message: int = 32,
    max_row_bytes: int = MAX_ROW_BYTES,
    input_compression: str | None = None,
    quiet: bool = False,
    limit: int | None = None,
    dry_run: bool = False,
    embed: bool = False,
    dimensions: int | None = None,
    score: list[str] | None = None,
    **sampling: Any,
) -> Summary:
    """Annotate every row of `input` into `output`; returns the run's `Summary` (also printed unless `quiet`).

    The run options (`RunOptions`' fields, shared with `batch`) come as keywords or as one `options` value, not
    both (`InvalidRequestError`). Embedded (default): the engine runs here (`model`, required, with
    `engine_options`; or pass a loaded `tokenmill.LLM` as `llm`). Distributed: `broker="redis://..."` sends rows to queue workers, as
    the run printed at the start (`tokenmill cancel --run RUN` stops it); Ctrl-C cancels the rows in flight
    (after asking, at a terminal) unless `detach`, and the same call again computes them; a resume skips rows
    cancelled with `tokenmill cancel` unless `retry_cancelled` (`retry_failed`: the same for rows that failed).
    `**sampling` are `SamplingParams` fields (`max_tokens`, `temperature` (default 0), `seed`, ...); `logprobs=N`
    adds a `logprobs` column: each generated token with its logprob and its N most likely alternatives. A row (a
    JSONL/CSV line, decompressed, or a Parquet row's decoded values) over `max_row_bytes` is not read: it fails
    with its error, the run goes on. JSONL/CSV is decompressed by its suffix (`.gz`, ...) or `input_compression`.
    `limit`: only the first rows. `dry_run`: print the first rendered prompts and the run's plan, load no model,
    write nothing. `embed`: embed each row's prompt instead (`dimensions`: keep the first values, normalised), its
    vector in an `embedding` column (Parquet: list<float32>) beside `prompt_tokens` and `error`; no sampling.
    `score` (continuations): score them given each row's prompt instead (`LLM.score`), a `scores` column of
    `{continuation, logprob, is_greedy, num_tokens}` per continuation, in order, beside `prompt_tokens` and `error`.
    Raises `InvalidRequestError` (bad option or template) or `DatasetError` (unusable input/output) before any work; a row that fails gets its error in the output instead.
    """
    run = run_options(options, locals())
    started = time.perf_counter()
    structured = {"json_schema": json_schema, "choice": choice, "regex": regex}
    embedding = embed_options(embed, dimensions, {**sampling, **structured})
    continuations = score_options(score, embed, {**sampling, **structured})
    params = {} if embedding is not None or continuations is not None else sampling_dict(
        {"temperature": 0.0, **sampling, **{k: v for k, v in structured.items() if v is not None}})
    if limit is not None and limit < 1:
        raise InvalidRequestError("limit", f"must be >= 1, got {limit}")
    prompter = Prompter(template, system, chat, run.model_label, params, embedding, continuations)
    dataset = open_dataset(input, input_format, run.s3_endpoint_url, run.max_row_bytes, run.input_compression)
    out_format = format_of(output, output_format, "output")
    check_output(output, dataset.uris)
    if limit is not None:
        dataset = LimitedDataset(dataset, limit)
    schema = dataset.schema
    if embedding is not None:
        _check_columns(schema, id_column, EMBEDDING, out_format, tuple(EMBED_COLUMNS.keys() - {EMBEDDING}), results=())
    elif continuations is not None:
        _check_columns(schema, id_column, SCORES, out_format, tuple(SCORE_COLUMNS.keys() - {SCORES}), results=())
    else:
        _check_columns(schema, id_column, column, out_format, tuple(_extra_columns(params)))
    prompter.check_columns(schema.names)
    if dry_run:
        print_plan(dataset, prompter, id_column, input, output, run.model_label, run.broker)
        return Summary(output=output)
    total = dataset.count_rows()
    checkpoint = open_checkpoint(run, output)
    summary = Summary(output=output)
    try:
        runner = make_runner(run, checkpoint.run)
        runner.check(params)
        compute_all("annotate", total, _units(dataset, prompter, id_column), checkpoint, runner, summary, run)
        writer = Writer(output, out_format, run.s3_endpoint_url)
        _write(dataset, schema, prompter, id_column, column, checkpoint, writer, summary)
    finally:
        checkpoint.close()
    return summary.finish(started, run.quiet)


class LimitedDataset:
    """The first `limit` rows of a dataset, read as the dataset reads them."""

    def __init__(self, dataset: Dataset, limit: int) -> None:
        self.dataset = dataset
        self.limit = limit
        self.schema = dataset.schema

    def count_rows(self) -> int:
        """Read up to the limit only: the dataset's own count may scan a whole JSONL or CSV input."""
        return sum(batch.num_rows for batch, _ in self.batches())

    def batches(self) -> Iterator[tuple[pa.RecordBatch, dict[int, str]]]:
        left = self.limit
        for batch, errors in self.dataset.batches():
            if left <= 0:
                return
            if batch.num_rows > left:
                batch, errors = batch.slice(0, left), {i: e for i, e in errors.items() if i < left}
            left -= batch.num_rows
            yield batch, errors


#: Prompts `print_plan` shows, and characters a token for its estimate (the model's tokenizer is not loaded).
PLAN_PROMPTS = 3
CHARS_PER_TOKEN = 4


def print_plan(dataset: Dataset | LimitedDataset, prompter: Prompter, id_column: str | None, input: str, output: str,
               model: str, broker: str | None) -> None:
    """What a run would do, on stdout: where, the first rendered prompts, rows and estimated tokens. Reads the input
    once; no model, no checkpoint, no output."""
    from kombu.utils.url import maybe_sanitize_url

    rows = failing = chars = 0
    shown: list[str] = []
    for _, batch_rows in _rows(dataset, id_column):
        for row in batch_rows:
            rows += 1
            unit = _unit(prompter, row)
            if not isinstance(unit, Unit):
                failing += 1
                continue
            text = unit.prompt if unit.prompt is not None else json.dumps(unit.messages, ensure_ascii=False)
            chars += len(text)
            if len(shown) < PLAN_PROMPTS:
                shown.append(f"--- row {row[0]}:\n{text}")
    max_tokens = prompter.sampling.get("max_tokens", 0)  # an embedding run completes nothing
    where = f"queue workers at {maybe_sanitize_url(broker)}" if broker else "the embedded engine"
    print(f"plan: {rows} rows of {input} -> {output}, model {model} on {where}")
    print("\n".join(shown) if shown else "(no row renders)")
    print(f"rows: {rows - failing} to run, {failing} failing before the model (their error goes in the output)")
    print(f"tokens: ~{chars // CHARS_PER_TOKEN:,} prompt (at ~{CHARS_PER_TOKEN} characters a token) + at most "
          f"{max_tokens * (rows - failing):,} completion (max_tokens {max_tokens} x {rows - failing} rows)")


def _check_columns(schema: pa.Schema, id_column: str | None, column: str, out_format: str,
                   extra: tuple[str, ...] = (), results: tuple[str, ...] = tuple(RESULT_COLUMNS)) -> None:
    if out_format == "csv":
        raise DatasetError("output format: must be jsonl or parquet (results can hold nested values), got csv")
    if id_column is not None and id_column not in schema.names:
        raise InvalidRequestError("id_column", f"no column {id_column!r} in the input (columns: {', '.join(schema.names)})")
    if column in (*results, *extra):
        raise InvalidRequestError("column", f"{column!r} is the name of another result column "
                                            f"({', '.join(results + extra)}); name the result column otherwise")
    for name in [column, *results, *extra]:
        if name in schema.names:
            raise InvalidRequestError("column", f"the input already has a column {name!r}; name the result column "
                                                f"with --column, or rename the input column")


def embed_options(embed: bool, dimensions: int | None, sampling: dict[str, Any]) -> dict[str, Any] | None:
    """An embedding run's job options (`Embed`'s fields), or None for a completion run. Raises `InvalidRequestError`
    for `dimensions` without `embed`, or a sampling option (other than None, or temperature 0) with it."""
    if not embed:
        if dimensions is not None:
            raise InvalidRequestError("dimensions", "requires embed")
        return None
    asked = [name for name, value in sampling.items() if value is not None and (name != "temperature" or value != 0)]
    if asked:
        raise InvalidRequestError(asked[0], "not with embed: an embedding samples nothing")
    try:
        return Embed(dimensions=dimensions).model_dump(exclude_none=True)
    except ValidationError as exc:
        raise invalid_request_from(exc) from None


def score_options(score: list[str] | None, embed: bool, sampling: dict[str, Any]) -> list[str] | None:
    """A score run's continuations (checked as a `Score`'s), or None. Raises `InvalidRequestError` for `score` with
    `embed` or a sampling option (other than None, or temperature 0), or a bad continuation, naming `score`."""
    if score is None:
        return None
    if embed:
        raise InvalidRequestError("score", "not with embed: a run embeds or scores")
    asked = [name for name, value in sampling.items() if value is not None and (name != "temperature" or value != 0)]
    if asked:
        raise InvalidRequestError(asked[0], "not with score: a score samples nothing")
    try:
        return Score(continuations=score).continuations  # type: ignore[return-value]  # strings: the command's
    except ValidationError as exc:
        error = invalid_request_from(exc)
        raise InvalidRequestError(error.field.removeprefix("score.").replace("continuations", "score"), error.message) from None


Row = tuple[str, dict[str, Any], str | None]  # (row id, columns, why it could not be read)


def _rows(dataset: Dataset, id_column: str | None) -> Iterator[tuple[pa.RecordBatch, list[Row]]]:
    """Each record batch with its rows as (row id, dict, read error): the id column's value (the position for a
    row that could not be read), else the row's position."""
    position = 0
    for batch, errors in dataset.batches():
        rows = batch.to_pylist()
        ids = [str(r[id_column]) if id_column and i not in errors else str(position + i) for i, r in enumerate(rows)]
        position += len(rows)
        yield batch, [(row_id, row, errors.get(i)) for i, (row_id, row) in enumerate(zip(ids, rows))]


def _unit(prompter: Prompter, row: Row) -> Unit | str:
    row_id, values, error = row
    return error if error is not None else prompter.unit(values, row_id)


def _units(dataset: Dataset, prompter: Prompter, id_column: str | None) -> Iterator[list[Unit]]:
    for _, rows in _rows(dataset, id_column):
        for row in rows:
            unit = _unit(prompter, row)
            yield [unit] if isinstance(unit, Unit) else []


def _write(dataset: Dataset, schema: pa.Schema, prompter: Prompter, id_column: str | None, column: str,
           checkpoint: Checkpoint, writer: Writer, summary: Summary) -> None:
    """Pass 2: the input again, each row with its result from the checkpoint, in input order."""
    parsed = parsed_column(prompter.sampling.get("json_schema"))  # a struct column where the schema allows
    types = {**RESULT_COLUMNS, "parsed": parsed.type, **_extra_columns(prompter.sampling)}
    text = [pa.field(column, pa.string())]
    if prompter.embed is not None or prompter.score is not None:
        types, text = EMBED_COLUMNS if prompter.score is None else SCORE_COLUMNS, []
    out_schema = pa.schema([*schema, *text, *(pa.field(n, t) for n, t in types.items())])
    try:
        if writer.format == "parquet":
            writer.start_parquet(out_schema)
        for batch, rows in _rows(dataset, id_column):
            results = []
            for row in rows:
                unit = _unit(prompter, row)
                outcome = stored(checkpoint, unit.key) if isinstance(unit, Unit) else Outcome(error=unit)
                summary.count_row(row[0], outcome.error)
                results.append(outcome)
            if prompter.embed is not None or prompter.score is not None:
                _write_embeddings(writer, batch, [values for _, values, _ in rows], results, out_schema, prompter.score)
            elif writer.format == "parquet":
                writer.write_batch(_with_results(batch, results, out_schema, parsed))
            else:
                writer.write_rows([{**values, **_columns(o, column, PROBABILITIES in types, LOGPROBS in types)}
                                   for (_, values, _), o in zip(rows, results)])
        writer.close()
    except BaseException:
        writer.abort()
        raise


def _extra_columns(sampling: dict[str, Any]) -> dict[str, pa.DataType]:
    """The columns `sampling` asks for beyond the result columns, with their Parquet types: with
    `choice_probabilities`, each row's probability per choice (a struct, one float per choice); with `logprobs`, its
    tokens (`LOGPROBS_TYPE`)."""
    columns: dict[str, pa.DataType] = {}
    if sampling.get("choice_probabilities"):
        columns[PROBABILITIES] = pa.struct([(choice, pa.float64()) for choice in dict.fromkeys(sampling["choice"])])
    if sampling.get("logprobs") is not None:
        columns[LOGPROBS] = LOGPROBS_TYPE
    return columns


def _probabilities(outcome: Outcome) -> dict[str, float] | None:
    return json.loads(outcome.choice_probabilities) if outcome.ok and outcome.choice_probabilities else None


def _logprobs(outcome: Outcome) -> list[dict[str, Any]] | None:
    """A succeeded row's generated tokens (the engine's text of each, the one rule of every door), each with its
    logprob and its top alternatives (`logprobs=0`: none)."""
    if not outcome.ok or outcome.logprobs is None:
        return None
    return [{"token": p["token"], "logprob": p["logprob"],
             "top_logprobs": [{"token": token, "logprob": lp}
                              for (_, lp), (token, _) in zip(p["top_logprobs"], p["top_tokens"])]}
            for p in json.loads(outcome.logprobs)]


def _columns(outcome: Outcome, column: str, probabilities: bool = False, logprobs: bool = False) -> dict[str, Any]:
    return {
        column: outcome.text if outcome.ok else None,  # a failed row's partial text is no label
        "parsed": None if outcome.parsed is None else json.loads(outcome.parsed),
        "finish_reason": outcome.finish_reason,
        "prompt_tokens": outcome.prompt_tokens if outcome.ok else None,
        "completion_tokens": outcome.completion_tokens if outcome.ok else None,
        "error": outcome.error,
        **({PROBABILITIES: _probabilities(outcome)} if probabilities else {}),
        **({LOGPROBS: _logprobs(outcome)} if logprobs else {}),
    }


def _write_embeddings(writer: Writer, batch: pa.RecordBatch, rows: list[dict[str, Any]], results: list[Outcome],
                      schema: pa.Schema, score: list[str] | None = None) -> None:
    """An embedding run's rows with their `EMBED_COLUMNS` (a failed row: null vector and tokens, its error), or with
    `score` (its continuations) a score run's with their `SCORE_COLUMNS`."""
    columns = {EMBEDDING: [json.loads(o.embedding) if o.ok and o.embedding else None for o in results]} if score is None \
        else {SCORES: [_scored(o, score) for o in results]}
    columns |= {"prompt_tokens": [o.prompt_tokens if o.ok else None for o in results],
               "error": [o.error for o in results]}
    if writer.format != "parquet":
        writer.write_rows([{**values, **{name: column[i] for name, column in columns.items()}}
                           for i, values in enumerate(rows)])
        return
    fields = list(schema)[batch.num_columns :]
    arrays = [*batch.columns, *(pa.array(columns[f.name], type=f.type) for f in fields)]
    writer.write_batch(pa.RecordBatch.from_arrays(arrays, schema=schema))


def _scored(outcome: Outcome, continuations: list[str]) -> list[dict[str, Any]] | None:
    """A score run's row: each continuation with its score (`ContinuationScore`'s fields); None for a failed row."""
    if not outcome.ok or not outcome.scores:
        return None
    return [{"continuation": text, **score} for text, score in zip(continuations, json.loads(outcome.scores))]


def _with_results(batch: pa.RecordBatch, results: list[Outcome], schema: pa.Schema, parsed: Column) -> pa.RecordBatch:
    extra = [
        [o.text if o.ok else None for o in results],
        parsed.values([o.parsed for o in results]),  # the schema's column type (JSON text without a schema)
        [o.finish_reason for o in results],
        [o.prompt_tokens if o.ok else None for o in results],
        [o.completion_tokens if o.ok else None for o in results],
        [o.error for o in results],
    ]
    if PROBABILITIES in schema.names:
        extra.append([_probabilities(o) for o in results])
    if LOGPROBS in schema.names:
        extra.append([_logprobs(o) for o in results])
    fields = list(schema)[batch.num_columns :]
    arrays = [*batch.columns, *(pa.array(values, type=f.type) for values, f in zip(extra, fields))]
    return pa.RecordBatch.from_arrays(arrays, schema=schema)
