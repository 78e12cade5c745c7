"""`tokenmill batch`: OpenAI Batch API files in, OpenAI Batch API files out.

Input lines are `{"custom_id", "method": "POST", "url": "/v1/chat/completions" | "/v1/completions", "body"}`;
output lines `{"id", "custom_id", "response": {"status_code": 200, "request_id", "body"}, "error": null}` whose
body is a `chat.completion` or `text_completion` object; failed requests go to the errors file with `response`
null and `error` = `{"code", "message"}`. A malformed line or an unsupported field fails that request only;
duplicate `custom_id`s refuse the whole file up front (with their line numbers), since results could not be
matched to requests. The pipeline (checkpoint, dedup, windows, progress, two streaming passes) is annotate's.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from tokenmill.apps.annotate import default_state_dir, make_runner, model_label
from tokenmill.apps.datasets import MAX_ROW_BYTES, TooLong, Writer, read_lines, too_long
from tokenmill.apps.pipeline import Progress, Summary, compute, stored
from tokenmill.apps.runners import Unit, sampling_dict
from tokenmill.apps.store import Checkpoint, Outcome, SeenSet, content_key
from tokenmill.errors import InvalidRequestError
from tokenmill.sampling_params import CONSTRAINT_CODES

URLS = {"/v1/chat/completions": "chat.completion", "/v1/completions": "text_completion"}
LINE_FIELDS = {"custom_id", "method", "url", "body"}
BODY_FIELDS = {"model", "messages", "prompt", "max_tokens", "max_completion_tokens", "temperature", "top_p", "stop",
               "seed", "n", "logprobs", "top_logprobs", "response_format", "user", "stream"}
_MAX_DUPLICATES_SHOWN = 10


class LineError(Exception):
    """Why one request line cannot be served: becomes its line in the errors file."""

    def __init__(self, code: str, message: str, custom_id: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.custom_id = custom_id


@dataclass
class Request:
    custom_id: str
    url: str
    model: str
    units: list[Unit]
    logprobs: int | None
    key: str


class Parser:
    """Turns one input line into a `Request` (or raises `LineError`)."""

    def __init__(self, model: str, default_max_tokens: int | None, logprobs_ok: bool) -> None:
        self.model = model
        self.default_max_tokens = default_max_tokens
        self.logprobs_ok = logprobs_ok

    def parse(self, raw: bytes) -> Request:
        try:
            line = json.loads(raw)
        except RecursionError:
            raise LineError("invalid_json", "the line nests too deeply to parse") from None
        except (ValueError, UnicodeDecodeError) as exc:
            raise LineError("invalid_json", f"the line is not valid JSON: {exc}") from None
        if not isinstance(line, dict):
            raise LineError("invalid_request", "the line must be a JSON object")
        custom_id = line.get("custom_id")
        if not isinstance(custom_id, str) or not custom_id:
            raise LineError("invalid_request", "custom_id: must be a non-empty string")
        try:
            return self._line(custom_id, line)
        except LineError as exc:
            exc.custom_id = custom_id
            raise

    def _line(self, custom_id: str, line: dict[str, Any]) -> Request:
        unknown = sorted(set(line) - LINE_FIELDS)
        if unknown:
            raise LineError("invalid_request", f"{unknown[0]}: unsupported field (supported: {', '.join(sorted(LINE_FIELDS))})")
        if line.get("method", "POST") != "POST":
            raise LineError("invalid_request", f"method: must be POST, got {line.get('method')!r}")
        url = line.get("url")
        if not isinstance(url, str) or url not in URLS:
            raise LineError("invalid_request", f"url: unsupported {url!r} (supported: {', '.join(URLS)})")
        body = line.get("body")
        if not isinstance(body, dict):
            raise LineError("invalid_request", "body: must be a JSON object")
        try:
            return self._request(custom_id, url, body)
        except InvalidRequestError as exc:
            raise LineError("invalid_request", f"body.{exc.field}: {exc.message}") from None

    def _request(self, custom_id: str, url: str, body: dict[str, Any]) -> Request:
        unknown = sorted(set(body) - BODY_FIELDS)
        if unknown:
            raise InvalidRequestError(unknown[0], f"unsupported field (supported: {', '.join(sorted(BODY_FIELDS))})")
        if body.get("stream"):
            raise InvalidRequestError("stream", "streaming is not available in a batch")
        prompt, messages = self._prompt(url, body)
        n = body.get("n", 1)
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= 128:
            raise InvalidRequestError("n", f"must be an integer in [1, 128], got {n!r}")
        params, logprobs = self._sampling(url, body)
        base = sampling_dict(params)  # checked before the seed is offset per choice
        model = body.get("model") if isinstance(body.get("model"), str) else self.model
        units = []
        for index in range(n):
            choice = base if base["seed"] is None else sampling_dict(dict(base, seed=base["seed"] + index))
            key = content_key(model=self.model, prompt=prompt, messages=messages, sampling=choice, choice=index)
            units.append(Unit(key, prompt, messages, choice, label=custom_id, weight=1 / n))
        return Request(custom_id, url, model, units, logprobs, content_key(custom_id=custom_id, units=[u.key for u in units]))

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
        if count is not None and not self.logprobs_ok:
            raise InvalidRequestError("logprobs", "not available with --broker (token strings need the model's tokenizer here)")
        return count


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
    """Run an OpenAI Batch API input file; returns the `Summary`. `errors` defaults to `<output>` with
    `.errors.jsonl` in place of its extension. Raises `InvalidRequestError` on duplicate custom_ids. A line
    over `max_row_bytes` (decompressed, for a compressed file) is not read: it is that request's error. Run ids,
    Ctrl-C, `detach` and `retry_cancelled` as in `annotate`."""
    started = time.perf_counter()
    errors = errors or os.path.splitext(output)[0] + ".errors.jsonl"
    mode = "queue" if broker else "embedded"
    label = model_label(model, llm, broker, queue)
    source = Source(input, s3_endpoint_url, max_row_bytes, input_compression)
    total = check_custom_ids(source)
    checkpoint = Checkpoint(os.path.join(state_dir or default_state_dir(output), "checkpoint.sqlite"),
                            checkpoint_interval)
    summary = Summary(output=output, errors_output=errors)
    try:
        runner = make_runner(mode, model, llm, engine_options, broker, queue, window, rows_per_message, checkpoint.run,
                             detach)
        parser = Parser(label, default_max_tokens, logprobs_ok=mode == "embedded")
        progress = Progress(total, "batch", quiet)
        try:
            compute((r.units if isinstance(r, Request) else [] for _, r in parse_requests(source, parser)),
                    checkpoint, runner, progress, summary, retry_failed, retry_cancelled)
        finally:
            progress.close()
        summary.prefix_hit_rate = runner.prefix_hit_rate()
        tokenizer = runner.llm.tokenizer if mode == "embedded" else None
        _write(source, parser, checkpoint, Writer(output, "json", s3_endpoint_url), Writer(errors, "json", s3_endpoint_url),
               summary, tokenizer)
    finally:
        checkpoint.close()
    summary.wall_s = time.perf_counter() - started
    if not quiet:
        summary.print()
    return summary


@dataclass
class Source:
    """The input file, where it is, the longest line read whole, and its codec if asked for (else by suffix)."""

    uri: str
    endpoint: str | None
    max_row_bytes: int
    compression: str | None = None


def check_custom_ids(source: Source) -> int:
    """Refuse duplicate custom_ids up front, naming them and their lines; returns the number of requests.
    The ids seen are kept on disk (`SeenSet`), not in memory."""
    seen, duplicates, total = SeenSet(), [], 0
    try:
        for number, raw in _lines(source):
            total += 1
            if isinstance(raw, TooLong):
                continue  # reported as that line's error later
            try:
                custom_id = json.loads(raw).get("custom_id")
            except (ValueError, AttributeError, UnicodeDecodeError, RecursionError):
                continue  # reported as that line's error later
            if isinstance(custom_id, str) and (first := seen.add(custom_id, number)) is not None:
                duplicates.append(f"{custom_id!r} on lines {first} and {number}")
    finally:
        seen.close()
    if duplicates:
        shown = "; ".join(duplicates[:_MAX_DUPLICATES_SHOWN])
        more = f" and {len(duplicates) - _MAX_DUPLICATES_SHOWN} more" if len(duplicates) > _MAX_DUPLICATES_SHOWN else ""
        raise InvalidRequestError("custom_id", f"duplicate custom_id values in {source.uri}: {shown}{more}")
    return total


def _lines(source: Source) -> Iterator[tuple[int, bytes | TooLong]]:
    for number, raw in enumerate(read_lines(source.uri, source.endpoint, source.max_row_bytes, source.compression), start=1):
        if isinstance(raw, TooLong) or raw.strip():
            yield number, raw


def parse_requests(source: Source, parser: Parser) -> Iterator[tuple[int, Request | LineError]]:
    """Each non-empty line's request, or why it is none, with its line number (pass 1, pass 2, `tokenmill serve`)."""
    for number, raw in _lines(source):
        if isinstance(raw, TooLong):
            yield number, LineError("invalid_request", too_long(raw.size, source.max_row_bytes))
            continue
        try:
            yield number, parser.parse(raw)
        except LineError as exc:
            yield number, exc


def _write(source: Source, parser: Parser, checkpoint: Checkpoint, out: Writer, err: Writer, summary: Summary,
           tokenizer: Any) -> None:
    """Pass 2: one line per request, in input order, into the output or the errors file."""
    try:
        for number, request in parse_requests(source, parser):
            outcomes = [] if isinstance(request, LineError) else [stored(checkpoint, u.key) for u in request.units]
            line, error = request_line(number, request, outcomes, tokenizer)
            summary.count_row(getattr(request, "custom_id", None) or f"line {number}", error)
            (out if error is None else err).write_rows([line])
        out.close()
        err.close()
    except BaseException:
        out.abort()
        err.abort()
        raise


def request_line(number: int, request: Request | LineError, outcomes: list[Outcome], tokenizer: Any
                 ) -> tuple[dict[str, Any], str | None]:
    """One request's line of the output file, or of the errors file with the error: the same lines whoever
    computed the outcomes (`tokenmill batch` from its checkpoint, `tokenmill serve` from the job results).
    `outcomes`: one per unit of the request (none for a line that did not parse)."""
    if isinstance(request, LineError):
        line = error_line(f"line{number:020d}", request.custom_id, request.code, f"line {number}: {request.message}")
        return line, request.message
    # as OpenAI answers a structured output cut by max_tokens or a stop: a response, its finish_reason saying so
    failed = next((o for o in outcomes if not o.ok and not o.error.startswith(CONSTRAINT_CODES)), None)
    if failed is not None:
        code, _, message = failed.error.partition(": ")
        return error_line(request.key, request.custom_id, code if message else "server_error", message or code), failed.error
    return result_line(request, outcomes, tokenizer), None


def error_line(key: str, custom_id: str | None, code: str, message: str) -> dict[str, Any]:
    return {"id": f"batch_req_{key[:24]}", "custom_id": custom_id, "response": None, "error": {"code": code, "message": message}}


def result_line(request: Request, outcomes: list[Outcome], tokenizer: Any) -> dict[str, Any]:
    kind = URLS[request.url]
    choices = []
    for index, outcome in enumerate(outcomes):
        logprobs = _logprobs(kind, outcome, tokenizer) if request.logprobs is not None else None
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
    }
    response = {"status_code": 200, "request_id": f"req_{request.key[:24]}", "body": body}
    return {"id": f"batch_req_{request.key[:24]}", "custom_id": request.custom_id, "response": response, "error": None}


def _logprobs(kind: str, outcome: Outcome, tokenizer: Any) -> dict[str, Any] | None:
    """The engine's logprobs (token ids) in OpenAI's shape (token strings and their bytes)."""
    positions = json.loads(outcome.logprobs) if outcome.logprobs else []

    def token(token_id: int) -> str:
        return tokenizer.decode([token_id])

    if kind == "chat.completion":
        content = []
        for p in positions:
            top = [{"token": token(t), "logprob": lp, "bytes": list(token(t).encode())} for t, lp in p["top_logprobs"]]
            text = token(p["token_id"])
            content.append({"token": text, "logprob": p["logprob"], "bytes": list(text.encode()), "top_logprobs": top})
        return {"content": content, "refusal": None}
    tokens = [token(p["token_id"]) for p in positions]
    offsets, at = [], 0
    for text in tokens:
        offsets.append(at)
        at += len(text)
    return {"tokens": tokens, "token_logprobs": [p["logprob"] for p in positions],
            "top_logprobs": [{token(t): lp for t, lp in p["top_logprobs"]} for p in positions], "text_offset": offsets}
