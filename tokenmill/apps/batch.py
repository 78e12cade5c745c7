"""`tokenmill batch`: OpenAI Batch API files in, OpenAI Batch API files out.

Input lines are `{"custom_id", "method": "POST", "url": "/v1/chat/completions" | "/v1/completions" |
"/v1/embeddings", "body"}`; output lines `{"id", "custom_id", "response": {"status_code": 200, "request_id", "body"},
"error": null}` whose body is a `chat.completion` or `text_completion` object with its `usage`, or for embeddings
`{"object": "list", "data": [{"object": "embedding", "index", "embedding"}], "model", "usage"}` (each input's vector,
a list of floats or, with `encoding_format: "base64"`, its little-endian float32 bytes in base64). As OpenAI's Batch
API does:

* a file unusable as a whole (`check_lines`, the one rule `tokenmill serve` applies too) is refused up front,
  naming its lines, before any request runs;
* a request refused as given (its body, by the parser here or by the engine) is its line in the errors file with
  the API's error response: `{"id", "custom_id", "response": {"status_code": 400, "request_id", "body": {"error":
  {"message", "type": "invalid_request_error", "param", "code"}}}, "error": null}` (`refused_line`);
* a request that could not run to its end (cancelled, expired, a worker's failure) has `response` null and
  `error` `{"code", "message"}` (`error_line`).

The pipeline (checkpoint, dedup, windows, progress, two streaming passes) is annotate's.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import struct
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from tokenmill.apps.datasets import (FORMATS, MAX_ROW_BYTES, DatasetError, TooLong, Writer, check_output, read_lines,
                                    too_long)
from tokenmill.apps.options import RunOptions, run_options
from tokenmill.apps.pipeline import Summary, compute_all, open_checkpoint, stored
from tokenmill.apps.runners import Unit, error_parts, make_runner, sampling_dict
from tokenmill.apps.store import Checkpoint, Outcome, SeenSet, content_key
from tokenmill.errors import InvalidRequestError
from tokenmill.queue.schemas import Embed, Score, invalid_request_from
from tokenmill.sampling_params import CONSTRAINT_CODES

URLS = {"/v1/chat/completions": "chat.completion", "/v1/completions": "text_completion", "/v1/embeddings": "list"}
EMBEDDINGS = "/v1/embeddings"
LINE_FIELDS = ("custom_id", "method", "url", "body")
BODY_FIELDS = {"model", "messages", "prompt", "max_tokens", "max_completion_tokens", "temperature", "top_p", "stop",
               "seed", "n", "logprobs", "top_logprobs", "response_format", "user", "stream", "tokenmill"}
#: tokenmill's extension of a completions or chat completions body, under its `tokenmill` field (`extension`):
#: `choice` (constrain the completion to one of these strings), `choice_probabilities` (with `choice`: each choice's
#: probability, answered in the body's `tokenmill.choice_probabilities`), `score` (continuations: each one's
#: log-likelihood given the prompt, answered in the body's `tokenmill.scores`; nothing is generated).
EXTENSION = "tokenmill"
EXTENSION_FIELDS = ("choice", "choice_probabilities", "score")
#: The body fields a score request may have beside its prompt: it samples nothing.
SCORE_FIELDS = {"model", "messages", "prompt", "user", EXTENSION}
EMBEDDING_FIELDS = {"model", "input", "dimensions", "encoding_format", "user"}
ENCODING_FORMATS = ("float", "base64")
#: Inputs one embeddings request may hold (OpenAI's limit).
MAX_INPUTS = 2048
#: Problems of an unusable file listed; reading it stops at this many.
MAX_PROBLEMS = 100
#: Longest custom_id a line may have (OpenAI's limit is of this order): ids are kept per request until the batch ends.
MAX_CUSTOM_ID_CHARS = 512
#: Characters of a user's value an error message quotes, at most: the batch's `errors` stay small whatever the file.
QUOTED_CHARS = 64


def quoted(value: Any) -> str:
    """`repr(value)`, cut to `QUOTED_CHARS` characters (with "...") so that an error never copies a user's value whole."""
    text = repr(value)
    return text if len(text) <= QUOTED_CHARS else text[: QUOTED_CHARS - 3] + "..."
#: The HTTP status of a request refused as given, by its error code; a failure with any other code has no response.
REFUSED_STATUS = {"invalid_request": 400, "invalid_job": 400, "model_not_found": 404}
_PROBLEMS_SHOWN = 10


class FileProblem(Exception):
    """What makes a batch input file unusable as a whole: OpenAI fails such a batch at validation."""

    def __init__(self, code: str, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.param = param

    def at(self, line: int | None) -> dict[str, Any]:
        """The problem as a failed batch's `errors` lists it (the SDK's `BatchError`)."""
        where = "" if line is None else f"line {line}: "
        return {"code": self.code, "message": where + self.message, "line": line, "param": self.param}


@dataclass
class Envelope:
    """A line's four fields, checked (`envelope`); `key` is the line's digest."""

    custom_id: str
    url: str
    body: dict[str, Any]
    key: str


@dataclass
class Request:
    custom_id: str
    url: str
    model: str
    units: list[Unit]
    logprobs: int | None
    key: str
    encoding_format: str = "float"  # embeddings: how each vector is written
    probabilities: bool = False  # `tokenmill.choice_probabilities`: the body's `tokenmill` carries them


@dataclass
class Refused:
    """A request whose body was refused as given: nothing runs, its line is a 400 response (`refused_line`)."""

    custom_id: str
    key: str
    message: str
    param: str | None
    units: tuple[()] = ()


def envelope(raw: bytes) -> Envelope:
    """A line's `custom_id`, `url` and `body`; raises the `FileProblem` of a line no usable file holds: not a JSON
    object, a field other than the four or one missing, a method other than POST, an unsupported url."""
    try:
        line = json.loads(raw)
    except RecursionError:
        raise FileProblem("invalid_json", "the line nests too deeply to parse") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise FileProblem("invalid_json", f"the line is not valid JSON: {exc}") from None
    if not isinstance(line, dict):
        raise FileProblem("invalid_request", "the line must be a JSON object")
    unknown = sorted(set(line) - set(LINE_FIELDS))
    missing = [name for name in LINE_FIELDS if name not in line]
    if unknown or missing:
        name, why = (unknown[0], "unsupported field") if unknown else (missing[0], "missing")
        raise FileProblem("invalid_request", f"{name}: {why} (a line has {', '.join(LINE_FIELDS)})", name)
    custom_id, method, url, body = (line[name] for name in LINE_FIELDS)
    if not isinstance(custom_id, str) or not custom_id:
        raise FileProblem("invalid_request", "custom_id: must be a non-empty string", "custom_id")
    if len(custom_id) > MAX_CUSTOM_ID_CHARS:
        raise FileProblem("invalid_request", f"custom_id: at most {MAX_CUSTOM_ID_CHARS} characters, got "
                                             f"{len(custom_id)}", "custom_id")
    if method != "POST":
        raise FileProblem("invalid_request", f"method: must be POST, got {quoted(method)}", "method")
    if not isinstance(url, str) or url not in URLS:
        raise FileProblem("invalid_request", f"url: unsupported {quoted(url)} (supported: {', '.join(URLS)})", "url")
    if not isinstance(body, dict):
        raise FileProblem("invalid_request", "body: must be a JSON object", "body")
    return Envelope(custom_id, url, body, hashlib.sha256(raw).hexdigest()[:32])


class Parser:
    """Turns one line into a `Request`, or the `Refused` request of a body refused as given."""

    def __init__(self, model: str, default_max_tokens: int | None) -> None:
        self.model = model
        self.default_max_tokens = default_max_tokens

    def parse(self, raw: bytes) -> Request | Refused:
        """Raises `FileProblem` for a line no usable file holds (`envelope`)."""
        return self.request(envelope(raw))

    def request(self, line: Envelope) -> Request | Refused:
        try:
            return self._request(line.custom_id, line.url, line.body)
        except InvalidRequestError as exc:
            return Refused(line.custom_id, line.key, str(exc), exc.field)

    def _request(self, custom_id: str, url: str, body: dict[str, Any]) -> Request:
        if url == EMBEDDINGS:
            return self._embeddings(custom_id, body)
        unknown = sorted(set(body) - BODY_FIELDS)
        if unknown:
            raise InvalidRequestError(unknown[0], f"unsupported field (supported: {', '.join(sorted(BODY_FIELDS))})")
        if body.get("stream"):
            raise InvalidRequestError("stream", "streaming is not available in a batch")
        extension = tokenmill_extension(body.get(EXTENSION))
        prompt, messages = self._prompt(url, body)
        if "score" in extension:
            return self._score(custom_id, url, body, prompt, messages, extension["score"])
        n = body.get("n", 1)
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= 128:
            raise InvalidRequestError("n", f"must be an integer in [1, 128], got {n!r}")
        params, logprobs = self._sampling(url, body)
        params.update(extension)
        try:
            base = sampling_dict(params)  # checked before the seed is offset per choice
        except InvalidRequestError as exc:
            raise InvalidRequestError(_body_param(exc.field, body), exc.message) from None
        model = body.get("model") if isinstance(body.get("model"), str) else self.model
        units = []
        for index in range(n):
            choice = base if base["seed"] is None else sampling_dict(dict(base, seed=base["seed"] + index))
            key = content_key(model=self.model, prompt=prompt, messages=messages, sampling=choice, choice=index)
            units.append(Unit(key, prompt, messages, choice, label=custom_id, weight=1 / n))
        return Request(custom_id, url, model, units, logprobs, content_key(custom_id=custom_id, units=[u.key for u in units]),
                       probabilities=bool(extension.get("choice_probabilities")))

    def _score(self, custom_id: str, url: str, body: dict[str, Any], prompt: str | None,
               messages: list[dict[str, str]] | None, continuations: list[str | list[int]]) -> Request:
        """A score request (`tokenmill.score`): one unit scoring the continuations (`Unit.score`)."""
        sampled = sorted(set(body) - SCORE_FIELDS)
        if sampled:
            raise InvalidRequestError(sampled[0], "not with tokenmill.score: a score samples nothing")
        model = body.get("model") if isinstance(body.get("model"), str) else self.model
        unit = Unit(content_key(model=self.model, prompt=prompt, messages=messages, score=continuations), prompt,
                    messages, {}, label=custom_id, score=continuations)
        return Request(custom_id, url, model, [unit], None, content_key(custom_id=custom_id, units=[unit.key]))

    def _embeddings(self, custom_id: str, body: dict[str, Any]) -> Request:
        """An embeddings request: one unit per input, each an embedding (`Unit.embed`)."""
        unknown = sorted(set(body) - EMBEDDING_FIELDS)
        if unknown:
            raise InvalidRequestError(unknown[0], f"unsupported field (supported: {', '.join(sorted(EMBEDDING_FIELDS))})")
        inputs = embedding_inputs(body.get("input"))
        embed, encoding = embedding_options(body)
        model = body.get("model") if isinstance(body.get("model"), str) else self.model
        units = [Unit(content_key(model=self.model, prompt=text, embed=embed), text, None, {}, label=custom_id,
                      weight=1 / len(inputs), embed=embed) for text in inputs]
        key = content_key(custom_id=custom_id, units=[u.key for u in units])
        return Request(custom_id, EMBEDDINGS, model, units, None, key, encoding)

    def _prompt(self, url: str, body: dict[str, Any]) -> tuple[str | None, list[dict[str, str]] | None]:
        if url == "/v1/chat/completions":
            if "prompt" in body:
                raise InvalidRequestError("prompt", "not a chat completions field (use messages)")
            messages = body.get("messages")
            if not isinstance(messages, list) or not messages:
                raise InvalidRequestError("messages", "must be a non-empty list of {role, content} objects")
            for i, m in enumerate(messages):
                if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                    raise InvalidRequestError(f"messages[{i}]", "must be an object with string role and content")
                extra = sorted(set(m) - {"role", "content", "name"})
                if extra:
                    raise InvalidRequestError(f"messages[{i}].{extra[0]}", "unsupported field")
            return None, [{"role": m["role"], "content": m["content"]} for m in messages]
        if "messages" in body:
            raise InvalidRequestError("messages", "not a completions field (use prompt)")
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if not isinstance(prompt, str) or not prompt:
            raise InvalidRequestError("prompt", "must be a non-empty string (one prompt per request)")
        return prompt, None

    def _sampling(self, url: str, body: dict[str, Any]) -> tuple[dict[str, Any], int | None]:
        limit = next((body[k] for k in ("max_completion_tokens", "max_tokens") if body.get(k) is not None), self.default_max_tokens)
        params: dict[str, Any] = {} if limit is None else {"max_tokens": limit}
        for name in ("temperature", "top_p", "seed"):
            if body.get(name) is not None:
                params[name] = body[name]
        if body.get("stop") is not None:
            params["stop"] = body["stop"]
        logprobs = self._logprobs(url, body)
        if logprobs is not None:
            params["logprobs"] = logprobs
        params.update(_response_format(body.get("response_format")))
        return params, logprobs

    def _logprobs(self, url: str, body: dict[str, Any]) -> int | None:
        if url == "/v1/chat/completions":
            wanted = body.get("logprobs")
            if wanted is not None and not isinstance(wanted, bool):
                raise InvalidRequestError("logprobs", f"must be a boolean for chat completions, got {wanted!r}")
            top = body.get("top_logprobs")
            if top is not None and not wanted:
                raise InvalidRequestError("top_logprobs", "requires logprobs: true")
            count = (top or 0) if wanted else None
        else:
            if "top_logprobs" in body:
                raise InvalidRequestError("top_logprobs", "not a completions field (logprobs is the count)")
            count = body.get("logprobs")
        return count


def tokenmill_extension(value: Any) -> dict[str, Any]:
    """A body's `tokenmill` extension (`EXTENSION_FIELDS`), checked: its sampling fields as `SamplingParams` names
    them, or `{"score": continuations}` alone. Raises `InvalidRequestError` naming `tokenmill.<field>`."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise InvalidRequestError(EXTENSION, f"must be an object of {', '.join(EXTENSION_FIELDS)}")
    unknown = sorted(set(value) - set(EXTENSION_FIELDS))
    if unknown:
        raise InvalidRequestError(f"{EXTENSION}.{unknown[0]}",
                                  f"unsupported field (supported: {', '.join(EXTENSION_FIELDS)})")
    if "score" not in value:
        return dict(value)
    if len(value) > 1:
        raise InvalidRequestError(f"{EXTENSION}.score", "not with choice or choice_probabilities")
    try:
        return {"score": Score(continuations=value["score"]).continuations}
    except ValidationError as exc:
        error = invalid_request_from(exc)
        field = error.field.removeprefix("score.").removeprefix("continuations")
        raise InvalidRequestError(f"{EXTENSION}.score{field}", error.message) from None


def embedding_inputs(value: Any) -> list[str | list[int]]:
    """OpenAI's `input` of an embeddings request as its prompts: a string, token ids, or a list of either (at most
    `MAX_INPUTS`, none empty). Raises `InvalidRequestError` naming `input` (or `input[i]`)."""
    if isinstance(value, str) or (isinstance(value, list) and value and all(map(_is_token, value))):
        value = [value]
    if not isinstance(value, list) or not value:
        raise InvalidRequestError("input", "must be a non-empty string, list of strings, or token ids")
    if len(value) > MAX_INPUTS:
        raise InvalidRequestError("input", f"at most {MAX_INPUTS} inputs per request, got {len(value)}")
    for index, item in enumerate(value):
        if not (isinstance(item, str) or isinstance(item, list) and all(map(_is_token, item))) or not item:
            raise InvalidRequestError(f"input[{index}]", "must be a non-empty string or a non-empty list of token ids")
    return value


def _is_token(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def embedding_options(body: dict[str, Any]) -> tuple[dict[str, Any], str]:
    """An embeddings body's job options (`Embed`'s fields, None left out) and its `encoding_format` ("float" when
    null or absent). Raises `InvalidRequestError` naming the field."""
    encoding = body.get("encoding_format")
    encoding = "float" if encoding is None else encoding
    if encoding not in ENCODING_FORMATS:
        raise InvalidRequestError("encoding_format",
                                  f"must be one of {', '.join(ENCODING_FORMATS)}, got {quoted(encoding)}")
    try:
        return Embed(dimensions=body.get("dimensions")).model_dump(exclude_none=True), encoding
    except ValidationError as exc:
        raise invalid_request_from(exc) from None


def embedding_body(model: str, vectors: list[list[float]], prompt_tokens: int, encoding: str) -> dict[str, Any]:
    """OpenAI's embeddings response (`CreateEmbeddingResponse`): each vector as floats, or for `encoding` "base64"
    its little-endian float32 bytes in base64."""
    data = [{"object": "embedding", "index": index,
             "embedding": float32_base64(vector) if encoding == "base64" else vector}
            for index, vector in enumerate(vectors)]
    return {"object": "list", "data": data, "model": model,
            "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}}


def float32_base64(vector: list[float]) -> str:
    """`vector` as OpenAI's `encoding_format: "base64"` (the engine's `pooling.encode_base64`, without torch)."""
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")


def _body_param(field: str, body: dict[str, Any]) -> str:
    """The body field that set sampling field `field`."""
    if field in ("json_schema", "json_object"):
        return "response_format.json_schema.schema" if field == "json_schema" else "response_format"
    if field == "max_tokens" and body.get("max_completion_tokens") is not None:
        return "max_completion_tokens"
    if field in EXTENSION_FIELDS and isinstance(body.get(EXTENSION), dict) and field in body[EXTENSION]:
        return f"{EXTENSION}.{field}"
    return field


def _response_format(value: Any) -> dict[str, Any]:
    """OpenAI's response_format as tokenmill's structured-output sampling fields."""
    if value is None:
        return {}
    if not isinstance(value, dict) or value.get("type") not in ("text", "json_object", "json_schema"):
        raise InvalidRequestError("response_format", "must be {\"type\": \"text\" | \"json_object\" | \"json_schema\", ...}")
    if value["type"] == "json_object":
        return {"json_object": True}
    if value["type"] == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
            raise InvalidRequestError("response_format.json_schema", "must be an object with a 'schema' object")
        return {"json_schema": spec["schema"]}
    return {}


def batch(
    input: str,
    output: str,
    *,
    errors: str | None = None,
    options: RunOptions | None = None,
    model: str | None = None,
    broker: str | None = None,
    queue: str | None = None,
    llm: Any = None,
    engine_options: dict[str, Any] | None = None,
    default_max_tokens: int | None = None,
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
) -> Summary:
    """Run an OpenAI Batch API input file; returns the `Summary` (`failed`: the lines of the errors file).
    `errors` defaults to `<output>` with `.errors.jsonl` in place of its extension. Raises `InvalidRequestError`,
    before the model loads, for a file unusable as a whole (`check_lines`; a line over `max_row_bytes`,
    decompressed, is one). Run ids, Ctrl-C, `detach` and `retry_cancelled` as in `annotate`, and as there the run
    options (`RunOptions`' fields) come as keywords or as one `options` value, not both."""
    run = run_options(options, locals())
    started = time.perf_counter()
    errors = errors or os.path.splitext(output)[0] + ".errors.jsonl"
    check_outputs(input, output, errors)
    source = Source(input, run.s3_endpoint_url, run.max_row_bytes, run.input_compression)
    total = check_file(source)
    checkpoint = open_checkpoint(run, output)
    summary = Summary(output=output, errors_output=errors)
    try:
        runner = make_runner(run, checkpoint.run)
        parser = Parser(run.model_label, default_max_tokens)
        compute_all("batch", total, (r.units for _, r in parse_requests(source, parser)), checkpoint, runner, summary,
                    run)
        _write(source, parser, checkpoint, Writer(output, "json", run.s3_endpoint_url),
               Writer(errors, "json", run.s3_endpoint_url), summary)
    finally:
        checkpoint.close()
    return summary.finish(started, run.quiet)


def check_outputs(input: str, output: str, errors: str) -> None:
    """Refuse, before any work, outputs that cannot be written as named (`check_output`), one named as a format other
    than JSONL (the batch output is OpenAI's JSONL), or the errors file named as the output."""
    for what, uri in (("output", output), ("errors", errors)):
        extension = os.path.splitext(uri)[1].lower()
        if FORMATS.get(extension, "json") != "json":
            raise DatasetError(f"{what} {uri!r}: batch results are JSONL, as OpenAI writes them; name it .jsonl")
        check_output(uri, [input], what)
    same = output == errors if "://" in output else os.path.abspath(output) == os.path.abspath(errors)
    if same:
        raise DatasetError(f"errors {errors!r} is the output too; name the errors file otherwise (default: "
                           "<output without its extension>.errors.jsonl)")


@dataclass
class Source:
    """The input file, where it is, the longest line read whole, and its codec if asked for (else by suffix)."""

    uri: str
    endpoint: str | None
    max_row_bytes: int
    compression: str | None = None


def check_lines(source: Source, problems: list[dict[str, Any]], endpoint: str | None = None,
                max_lines: int | None = None) -> Iterator[tuple[int, Envelope]]:
    """The one rule of what makes a batch input file unusable as a whole (OpenAI fails such a batch at validation;
    `tokenmill batch` and `tokenmill serve` both ask this): a line `envelope` refuses, a line over the size limit,
    a `url` other than the batch's `endpoint`, a repeated custom_id, more than `max_lines` requests, none at all.
    Yields each other line's envelope with its number; each problem goes into `problems` (`FileProblem.at`), and
    reading stops at `MAX_PROBLEMS` of them or past `max_lines`. Anything else is its own request's error."""
    seen, total = SeenSet(), 0  # custom_ids kept on disk, not in memory
    try:
        for number, raw in numbered_lines(source):
            total += 1
            if max_lines is not None and total > max_lines:
                problems.append(FileProblem("too_many_lines", f"the file has more than {max_lines} requests "
                                            "(TOKENMILL_MAX_BATCH_LINES)").at(number))
                return
            try:
                yield number, _usable(number, raw, source.max_row_bytes, endpoint, seen)
            except FileProblem as problem:
                problems.append(problem.at(number))
                if len(problems) >= MAX_PROBLEMS:
                    return
    finally:
        seen.close()
    if total == 0:
        problems.append(FileProblem("empty_file", "the input file holds no requests").at(None))


def _usable(number: int, raw: bytes | TooLong, max_row_bytes: int, endpoint: str | None, seen: SeenSet) -> Envelope:
    if isinstance(raw, TooLong):
        raise FileProblem("line_too_long", too_long(raw.size, max_row_bytes))
    line = envelope(raw)
    if endpoint is not None and line.url != endpoint:
        raise FileProblem("mismatched_endpoint", f"url {quoted(line.url)} is not the batch's endpoint {endpoint!r}",
                          "url")
    first = seen.add(line.custom_id, number)
    if first is not None:
        raise FileProblem("duplicate_custom_id", f"custom_id {quoted(line.custom_id)} already on line {first}",
                          "custom_id")
    return line


def check_file(source: Source) -> int:
    """The number of requests of a usable file (`check_lines`); raises `InvalidRequestError` naming the lines of an
    unusable one."""
    problems: list[dict[str, Any]] = []
    total = sum(1 for _ in check_lines(source, problems))
    if problems:
        raise InvalidRequestError("input", unusable(source.uri, problems))
    return total


def unusable(uri: str, problems: list[dict[str, Any]]) -> str:
    """Why a file is unusable, in one line: its first problems, and how many more were found."""
    shown = "; ".join(problem["message"] for problem in problems[:_PROBLEMS_SHOWN])
    more = f"; and {len(problems) - _PROBLEMS_SHOWN} more" if len(problems) > _PROBLEMS_SHOWN else ""
    return f"{uri} is not a usable batch input file: {shown}{more}"


def numbered_lines(source: Source) -> Iterator[tuple[int, bytes | TooLong]]:
    """The file's non-empty lines with their numbers (blank lines count, as an editor numbers them)."""
    for number, raw in enumerate(read_lines(source.uri, source.endpoint, source.max_row_bytes, source.compression), start=1):
        if isinstance(raw, TooLong) or raw.strip():
            yield number, raw


def parse_requests(source: Source, parser: Parser) -> Iterator[tuple[int, Request | Refused]]:
    """Each request of a file `check_lines` found usable, with its line number (pass 1, pass 2, `tokenmill serve`
    taking a batch over); raises `InvalidRequestError` if the file has become unusable since."""
    for number, raw in numbered_lines(source):
        try:
            if isinstance(raw, TooLong):
                raise FileProblem("line_too_long", too_long(raw.size, source.max_row_bytes))
            request = parser.parse(raw)
        except FileProblem as problem:
            raise InvalidRequestError("input", unusable(source.uri, [problem.at(number)])) from None
        yield number, request


def _write(source: Source, parser: Parser, checkpoint: Checkpoint, out: Writer, err: Writer, summary: Summary) -> None:
    """Pass 2: one line per request, in input order, into the output or the errors file."""
    try:
        for _, request in parse_requests(source, parser):
            outcomes = [stored(checkpoint, u.key) for u in request.units]
            line, error = request_line(request, outcomes)
            summary.count_row(request.custom_id, error)
            (out if error is None else err).write_rows([line])
        out.close()
        err.close()
    except BaseException:
        out.abort()
        err.abort()
        raise


def request_line(request: Request | Refused, outcomes: list[Outcome]) -> tuple[dict[str, Any], str | None]:
    """One request's line of the output file, or of the errors file with the error: the same lines whoever
    computed the outcomes (`tokenmill batch` from its checkpoint, `tokenmill serve` from the job results).
    `outcomes`: one per unit of the request (none for a refused one)."""
    if isinstance(request, Refused):
        return refused_line(request.key, request.custom_id, 400, "invalid_request", request.message, request.param), \
            request.message
    # as OpenAI answers a structured output cut by max_tokens or a stop: a response, its finish_reason saying so
    failed = next((o for o in outcomes if not o.ok and not o.error.startswith(CONSTRAINT_CODES)), None)
    if failed is not None:
        return failure_line(request, failed.error), failed.error
    if request.logprobs is not None and not all(map(_has_token_texts, outcomes)):
        error = ("logprobs_unavailable: a worker older than this tokenmill ran this request and sent its logprobs "
                 "without token texts; upgrade the workers and run the request again")
        return error_line(request.key, request.custom_id, "logprobs_unavailable", error.partition(": ")[2]), error
    return result_line(request, outcomes), None


def _has_token_texts(outcome: Outcome) -> bool:
    return not outcome.logprobs or all("token" in position for position in json.loads(outcome.logprobs))


def failure_line(request: Request, error: str) -> dict[str, Any]:
    """The line of a request that failed: refused as given by whoever ran it (`REFUSED_STATUS`: the API's error
    response, as for a refused body), else not run to its end (`error_line`)."""
    code, message, param = error_parts(error)
    status = REFUSED_STATUS.get(code)
    if status is None:
        return error_line(request.key, request.custom_id, code, error.partition(": ")[2] or error)
    if param == "prompt" and request.url == "/v1/chat/completions":
        param = "messages"  # the engine refuses the prompt the messages became
    if request.url == EMBEDDINGS:  # the job's field as the body named it
        param = {"prompt": "input", "prompt_token_ids": "input", "embed.dimensions": "dimensions"}.get(param, param)
    if param is not None and param.startswith("continuations"):  # the engine's name of a score's continuation
        param = f"{EXTENSION}.score{param.removeprefix('continuations')}"
    return refused_line(request.key, request.custom_id, status, code, message, param)


def refused_line(key: str, custom_id: str, status: int, code: str, message: str, param: str | None) -> dict[str, Any]:
    """A request refused as given, as OpenAI's batch writes it: the API's error response, `error` null."""
    body = {"error": {"message": message, "type": "invalid_request_error", "param": param, "code": code}}
    response = {"status_code": status, "request_id": f"req_{key[:24]}", "body": body}
    return {"id": f"batch_req_{key[:24]}", "custom_id": custom_id, "response": response, "error": None}


def error_line(key: str, custom_id: str, code: str, message: str) -> dict[str, Any]:
    """A request not run to its end (cancelled, expired, a worker's failure): no response, OpenAI's `error`."""
    return {"id": f"batch_req_{key[:24]}", "custom_id": custom_id, "response": None, "error": {"code": code, "message": message}}


def result_line(request: Request, outcomes: list[Outcome]) -> dict[str, Any]:
    if request.url == EMBEDDINGS:
        return embeddings_line(request, outcomes)
    kind = URLS[request.url]
    choices = []
    for index, outcome in enumerate(outcomes):
        logprobs = openai_logprobs(kind, outcome.logprobs) if request.logprobs is not None else None
        if kind == "chat.completion":
            message = {"role": "assistant", "content": outcome.text, "refusal": None}
            choices.append({"index": index, "message": message, "finish_reason": outcome.finish_reason, "logprobs": logprobs})
        else:
            choices.append({"index": index, "text": outcome.text, "finish_reason": outcome.finish_reason, "logprobs": logprobs})
    prompt_tokens = outcomes[0].prompt_tokens
    completion_tokens = sum(o.completion_tokens for o in outcomes)
    body = {
        "id": f"{'chatcmpl' if kind == 'chat.completion' else 'cmpl'}-{request.key[:24]}",
        "object": kind,
        "created": max(o.created for o in outcomes),
        "model": request.model,
        "choices": choices,
        "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                  "total_tokens": prompt_tokens + completion_tokens},
        "system_fingerprint": None,
        **extension_answer(request, outcomes),
    }
    response = {"status_code": 200, "request_id": f"req_{request.key[:24]}", "body": body}
    return {"id": f"batch_req_{request.key[:24]}", "custom_id": request.custom_id, "response": response, "error": None}


def extension_answer(request: Request, outcomes: list[Outcome]) -> dict[str, Any]:
    """The body's `tokenmill` field of a request that used the extension: `{"choice_probabilities": {choice:
    probability}}` (the first choice's: they are the same for each) or `{"scores": [{"logprob", "is_greedy",
    "num_tokens"}]}`; nothing otherwise, so a plain request's body is OpenAI's alone."""
    first = outcomes[0]
    if request.units[0].score is not None:
        return {EXTENSION: {"scores": json.loads(first.scores or "[]")}}
    if request.probabilities:
        return {EXTENSION: {"choice_probabilities": json.loads(first.choice_probabilities or "{}")}}
    return {}


def embeddings_line(request: Request, outcomes: list[Outcome]) -> dict[str, Any]:
    """An embeddings request's output line: its inputs' vectors in order (`embedding_body`), their prompt tokens."""
    vectors = [json.loads(outcome.embedding or "[]") for outcome in outcomes]
    body = embedding_body(request.model, vectors, sum(o.prompt_tokens for o in outcomes), request.encoding_format)
    response = {"status_code": 200, "request_id": f"req_{request.key[:24]}", "body": body}
    return {"id": f"batch_req_{request.key[:24]}", "custom_id": request.custom_id, "response": response, "error": None}


def openai_logprobs(kind: str, logprobs: str | None) -> dict[str, Any]:
    """The engine's logprobs (`Outcome.logprobs`: JSON text, each position with its tokens' text, `token`, `bytes`
    and `top_tokens`, from the engine whichever process ran it) in OpenAI's shape for `kind`: a chat completion's
    `{"content": [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}], "refusal": None}`, a text
    completion's `{tokens, token_logprobs, top_logprobs: [{token: logprob}], text_offset}` (offsets into the
    completion's text, from 0). The one formatter of `tokenmill batch`, embedded or `--broker`, and `tokenmill serve`."""
    positions = json.loads(logprobs) if logprobs else []
    if kind == "chat.completion":
        content = [{"token": p["token"], "logprob": p["logprob"], "bytes": p["bytes"],
                    "top_logprobs": [{"token": token, "logprob": lp, "bytes": raw}
                                     for (_, lp), (token, raw) in zip(p["top_logprobs"], p["top_tokens"])]}
                   for p in positions]
        return {"content": content, "refusal": None}
    tokens = [p["token"] for p in positions]
    offsets, at = [], 0
    for text in tokens:
        offsets.append(at)
        at += len(text)
    return {"tokens": tokens, "token_logprobs": [p["logprob"] for p in positions],
            "top_logprobs": [{token: lp for (_, lp), (token, _) in zip(p["top_logprobs"], p["top_tokens"])}
                             for p in positions], "text_offset": offsets}
