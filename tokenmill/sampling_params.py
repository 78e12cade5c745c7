"""Per-request sampling settings. Torch-free, so the client validates with the same rules as the engine."""

from __future__ import annotations

import functools
import json
import math
import re
import warnings
from dataclasses import dataclass, field, fields
from typing import Any

import orjson

from tokenmill.errors import InvalidRequestError
from tokenmill.schema_support import prepare

#: Upper bound of every integer count and token id: what an int32 tensor holds, far above any vocabulary
#: or context length, so a value the client accepts never overflows inside the engine.
MAX_INT = 2**31 - 1
#: Seeds are unsigned 64-bit, like numpy's and vLLM's; the sampler folds them into its int64 tensors.
MAX_SEED = 2**64 - 1
#: Size limits of structured-output options, past which a grammar would take too long or too much memory to
#: compile (tens of thousands of short choices take seconds of a core and tens of megabytes): refused naming the field.
MAX_CHOICES = 50_000
MAX_CHOICE_CHARS = 1 << 20  # all choices together
MAX_SCHEMA_BYTES = 256 << 10  # the schema as compact JSON
MAX_REGEX_LENGTH = 10_000
#: Temperatures below this sample greedily (as in vLLM): dividing logits by ~1e-300 overflows float32 and
#: would turn every probability into NaN, so a tiny temperature means "argmax", as its limit does.
GREEDY_TEMPERATURE = 1e-5
#: Deepest nesting accepted in a `json_schema` (JSON objects and arrays), in a `regex` (groups) and in a job's
#: `metadata`. Checked before anything recursive touches the value: validating deeper input can recurse past
#: Python's limit (a RecursionError, not an error naming the field), and a very deep schema takes xgrammar
#: seconds to compile. Real schemas nest a few levels.
MAX_NESTING = 64
#: Most stop strings per request, and most characters in them all. The engine matches each one against every
#: request's new text each step, on the step every other request waits for: one job with many thousands of stop
#: strings slows every neighbour several times. OpenAI's API takes 4.
MAX_STOP_STRINGS = 64
MAX_STOP_CHARS = 4096
#: `max_tokens` of a request that sets none, through every door (`LLM`, client jobs, generate, annotate, batch files,
#: serve): room for a paragraph. A `choice` request that sets none gets `choice_max_tokens` instead.
DEFAULT_MAX_TOKENS = 256


def choice_max_tokens(choice: list[str]) -> int:
    """Enough tokens for any of `choice` whatever its tokenization: one per UTF-8 byte of the longest, plus the end.
    The grammar ends the completion as soon as a choice is complete, so the room unused costs nothing."""
    return max((len(c.encode()) for c in choice if isinstance(c, str)), default=0) + 1


@dataclass
class SamplingParams:
    """How to sample one request. Defaults follow vLLM so that its users meet no surprises, but for `max_tokens`:
    unset (None), it is `DEFAULT_MAX_TOKENS`, or `choice_max_tokens` for a `choice` (vLLM's 16 cut most answers).

    `temperature` below `GREEDY_TEMPERATURE` (1e-5, 0 included) means greedy. `top_k <= 0` and `top_p == 1` disable those filters. `seed` makes a
    request's samples reproducible whatever else is in the batch. `logprobs=n` returns the top-n log
    probabilities (plus the chosen token's) at each generated position.

    `choice_probabilities=True` (with `choice`) samples nothing: the engine scores every choice as a whole token
    sequence given the prompt (the product of its tokens' probabilities under the model's log-softmax, temperature
    and filters ignored) in one pass that computes the prompt once, and returns them normalised over the choices
    (`RequestOutput.choice_probabilities`, `JobResult.choice_probabilities`); the text is the most probable choice,
    so the output is deterministic. The other sampling fields do not apply to it.
    """

    max_tokens: int = None  # type: ignore[assignment]  # None: resolved in __post_init__ (see the docstring)
    min_tokens: int = 0
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    skip_special_tokens: bool = True
    # Structured output: at most one of these (see `structured`).
    json_schema: dict[str, Any] | str | None = None
    choice: list[str] | None = None
    regex: str | None = None
    json_object: bool = False
    choice_probabilities: bool = False  # with `choice`: score every choice instead of sampling (see above)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        for name, what in (("stop", "a string or a list of strings"), ("stop_token_ids", "a list of integers")):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), list | tuple):
                raise InvalidRequestError(name, f"must be {what}, got {getattr(self, name)!r}")
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        unset = self.max_tokens is None
        if unset:
            self.max_tokens = choice_max_tokens(list(self.choice)) if isinstance(self.choice, list | tuple) else DEFAULT_MAX_TOKENS
        if unset and isinstance(self.min_tokens, int) and self.min_tokens > self.max_tokens:  # a limit never set
            raise InvalidRequestError("min_tokens", f"must be <= max_tokens, which is {self.max_tokens} when unset; "
                                      f"got {self.min_tokens}: set max_tokens too")
        self._check()
        _check_structured(self)

    @classmethod
    def from_dict(cls, values: dict) -> SamplingParams:
        """Build from a plain dict, naming any field this class does not know.

        Values checked before come from `_CHECKED` without checking them again: the jobs of a batch mostly share
        their settings, and every job's are checked three times (by the client, the worker and the engine process).
        """
        key = _checked_key(values)
        checked = _CHECKED.get(key) if key is not None else None
        if checked is not None:
            params = cls.__new__(cls)
            params.__dict__.update(_own_lists(checked))
            return params
        if not _KNOWN_FIELDS.issuperset(values):  # one set operation per job; the loop only to name the field
            name = next(name for name in values if name not in _KNOWN_FIELDS)
            raise InvalidRequestError(name, f"unknown sampling parameter (known: {', '.join(sorted(_KNOWN_FIELDS))})")
        params = cls(**values)
        if key is not None:
            if len(_CHECKED) >= CHECKED_LIMIT:
                _CHECKED.clear()
            _CHECKED[key] = _own_lists(params.__dict__)
        return params

    def _check(self) -> None:
        _int(self, "max_tokens", low=1, high=MAX_INT)
        _int(self, "min_tokens", low=0, high=MAX_INT)
        if self.min_tokens > self.max_tokens:
            raise InvalidRequestError("min_tokens", f"must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}")
        _float(self, "temperature", low=0.0)
        _int(self, "top_k", low=-1, high=MAX_INT)  # above the vocabulary size it keeps every token
        _float(self, "top_p", low=0.0, low_open=True, high=1.0)
        _float(self, "min_p", low=0.0, high=1.0)
        _float(self, "repetition_penalty", low=0.0, low_open=True)
        if self.seed is not None:
            _int(self, "seed", low=0, high=MAX_SEED)
        if self.logprobs is not None:
            _int(self, "logprobs", low=0, high=20)
        _check_stop(self.stop)
        for i, t in enumerate(self.stop_token_ids):
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t <= MAX_INT:
                raise InvalidRequestError(f"stop_token_ids[{i}]", f"must be an integer in [0, {MAX_INT}], got {t!r}")
        for name in ("ignore_eos", "skip_special_tokens", "choice_probabilities"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidRequestError(name, f"must be a boolean, got {getattr(self, name)!r}")

    def to_dict(self) -> dict[str, Any]:
        """The fields as a plain dict, for the wire. Shallow on purpose: `dataclasses.asdict` deep-copies every
        value and was the largest cost of validating a job (`Client.submit_many`). The instance's own dict holds
        the fields in their order (an instance that was given another attribute is read field by field)."""
        values = self.__dict__.copy()
        if len(values) == len(_FIELD_NAMES):
            return values
        return {name: getattr(self, name) for name in _FIELD_NAMES}

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def structured(self) -> tuple[str, Any] | None:
        """The structured-output option as (field name, value), or None for free text."""
        for name in STRUCTURED_FIELDS:
            value = getattr(self, name)
            if value is not None and value is not False:
                return name, value
        return None


def _int(params: SamplingParams, name: str, low: int | None = None, high: int | None = None) -> None:
    value = getattr(params, name)
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidRequestError(name, f"must be an integer, got {value!r}")
    if low is not None and value < low:
        raise InvalidRequestError(name, f"must be >= {low}, got {value}")
    if high is not None and value > high:
        raise InvalidRequestError(name, f"must be <= {high}, got {value}")


def _float(params: SamplingParams, name: str, low: float, high: float | None = None, low_open: bool = False) -> None:
    value = getattr(params, name)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value) or math.isinf(value):
        raise InvalidRequestError(name, f"must be a finite number, got {value!r}")
    if value < low or (low_open and value == low):
        raise InvalidRequestError(name, f"must be {'>' if low_open else '>='} {low}, got {value}")
    if high is not None and value > high:
        raise InvalidRequestError(name, f"must be <= {high}, got {value}")
    setattr(params, name, float(value))


def _check_stop(stop: list[Any]) -> None:
    if len(stop) > MAX_STOP_STRINGS:
        raise InvalidRequestError("stop", f"at most {MAX_STOP_STRINGS} stop strings, got {len(stop)}")
    for i, s in enumerate(stop):
        if not isinstance(s, str) or not s:
            raise InvalidRequestError(f"stop[{i}]", f"must be a non-empty string, got {s!r}")
    total = sum(len(s) for s in stop)
    if total > MAX_STOP_CHARS:
        raise InvalidRequestError("stop", f"at most {MAX_STOP_CHARS} characters in all stop strings, got {total}")


_FIELD_NAMES = tuple(f.name for f in fields(SamplingParams))
_KNOWN_FIELDS = frozenset(_FIELD_NAMES)
STRUCTURED_FIELDS = ("json_schema", "choice", "regex", "json_object")
#: The error codes of a constrained completion that is not what its constraint asked for (`constraint_problem`).
CONSTRAINT_CODES = ("constraint_incomplete", "constraint_failed")


def constraint_problem(params: SamplingParams, finish_reason: str, satisfied: bool | None,
                       check_error: str | None) -> tuple[str, str, str | None] | None:
    """(code, message, field) of a constrained completion that is not what its constraint asked for, else None: one
    that ended inside its grammar (`constraint_incomplete`: `max_tokens` or a stop came first) or failed the final
    check against it (`constraint_failed`). The one rule for job results and annotate's rows: such an output is never
    passed off as a valid one. A cancelled or stopped-by-deadline request is reported as that instead."""
    if satisfied is not False or finish_reason not in ("length", "stop"):
        return None
    if check_error is not None:
        return "constraint_failed", check_error, None
    kind = next((label for name, label in (("choice", "choice"), ("json_schema", "JSON schema"), ("regex", "regex"))
                 if getattr(params, name) is not None), "JSON object")
    if finish_reason == "length":
        return "constraint_incomplete", f"max_tokens {params.max_tokens} reached inside the {kind}", "max_tokens"
    return "constraint_incomplete", f"a stop string or stop token ended the output inside the {kind}", "stop"
#: Most sets of checked values `from_dict` remembers (`_CHECKED`): past it, it starts afresh. Values longer than
#: `CHECKED_KEY_BYTES` as JSON (a job's are ~300 bytes; `choice` alone may hold a megabyte) are not remembered, so
#: what is kept stays within a few megabytes whatever producers send.
CHECKED_LIMIT = 1024
CHECKED_KEY_BYTES = 4096
#: Checked values, by `_checked_key` of what `from_dict` was given, as the fields they made (`_own_lists`).
_CHECKED: dict[tuple[bytes, tuple[type, ...]], dict[str, Any]] = {}


def _own_lists(fields: dict[str, Any]) -> dict[str, Any]:
    """A copy of `fields` with lists of its own (the only mutable fields `_CHECKED` holds: schemas are never kept),
    so what it keeps and what it hands out share none with a caller."""
    copy = fields.copy()
    copy["stop"], copy["stop_token_ids"] = list(copy["stop"]), list(copy["stop_token_ids"])
    if copy["choice"] is not None:
        copy["choice"] = list(copy["choice"])
    return copy


def _checked_key(values: dict) -> tuple[bytes, tuple[type, ...]] | None:
    """`values` as a key that equals another's only for the same names and values of the same exact types, in the
    same order: their JSON and their types (in JSON, NaN reads as None and a tuple as a list; by type they differ).
    None for values that cannot be told apart so (an object inside) or JSON cannot hold, and for a schema in any
    form: the check turns it into an object, which copies of the fields would share."""
    if not isinstance(values, dict):
        return None
    kinds = tuple(map(type, values.values()))
    if dict in kinds or values.get("json_schema") is not None:
        return None
    try:
        text = orjson.dumps(values)
    except TypeError:
        return None
    return (text, kinds) if len(text) <= CHECKED_KEY_BYTES else None


def _check_structured(params: SamplingParams) -> None:
    """What can be checked without the model's tokenizer: JSON Schema against its metaschema (the
    `jsonschema` package), choice shape, regex syntax (Python `re`). The engine compiles the grammar
    with xgrammar too and rejects what that cannot handle (e.g. a lookahead) with the same field name."""
    given = [name for name in STRUCTURED_FIELDS if getattr(params, name) not in (None, False)]
    if len(given) > 1:
        raise InvalidRequestError(given[-1], f"at most one of {', '.join(STRUCTURED_FIELDS)} may be given (got {' and '.join(given)})")
    if not isinstance(params.json_object, bool):
        raise InvalidRequestError("json_object", f"must be a boolean, got {params.json_object!r}")
    if params.json_schema is not None:
        params.json_schema = _schema_dict(params.json_schema)
    if params.choice is not None:
        params.choice = _choice_list(params.choice)
    if params.choice_probabilities is True and params.choice is None:
        raise InvalidRequestError("choice_probabilities", "requires choice: the choices whose probabilities to compute")
    if params.regex is not None:
        _check_regex(params.regex)


def nested_deeper_than(value: Any, limit: int) -> bool:
    """Whether `value` has dicts and lists nested more than `limit` levels (`{}` is one level). Iterative, so
    it cannot hit the recursion limit it guards against."""
    stack = [(value, 1)] if isinstance(value, (dict, list, tuple)) else []
    while stack:
        item, depth = stack.pop()
        if depth > limit:
            return True
        children = item.values() if isinstance(item, dict) else item
        stack.extend((child, depth + 1) for child in children if isinstance(child, (dict, list, tuple)))
    return False


def check_nesting(value: Any, field: str) -> None:
    """Refuse `value` for `field` when it nests deeper than `MAX_NESTING` levels of objects and arrays."""
    if nested_deeper_than(value, MAX_NESTING):
        raise InvalidRequestError(field, f"nests deeper than {MAX_NESTING} levels of objects and arrays")


def _schema_dict(schema: Any) -> dict[str, Any]:
    """A JSON Schema as a dict: given as a dict, a JSON string, or a pydantic model class."""
    if isinstance(schema, type) and hasattr(schema, "model_json_schema"):
        schema = schema.model_json_schema()
    elif isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except RecursionError:
            raise InvalidRequestError("json_schema", f"nests deeper than {MAX_NESTING} levels of objects and arrays") from None
        except ValueError as exc:
            raise InvalidRequestError("json_schema", f"is not valid JSON: {exc}") from None
    check_nesting(schema, "json_schema")
    if not isinstance(schema, dict):
        raise InvalidRequestError("json_schema", f"must be a JSON Schema object (a dict, JSON string or pydantic model class), got {type(schema).__name__}")
    try:
        text = json.dumps(schema)
    except (TypeError, ValueError) as exc:
        raise InvalidRequestError("json_schema", f"is not JSON-serialisable: {exc}") from None
    if len(text.encode()) > MAX_SCHEMA_BYTES:
        raise InvalidRequestError("json_schema", f"is {len(text.encode())} bytes as JSON; at most {MAX_SCHEMA_BYTES} are accepted")
    error = _schema_error(text)
    if error is not None:
        raise InvalidRequestError("json_schema", error)
    prepare(schema)  # refuses, naming keyword and pointer, what no backend enforces in full (cached by text)
    return schema


@functools.lru_cache(maxsize=256)
def _schema_error(text: str) -> str | None:
    """The metaschema check, cached by the schema's text: a job is validated at the client, the worker and
    the engine process, and a dataset's jobs usually share one schema."""
    from jsonschema.exceptions import SchemaError  # imported only when a schema is given

    from tokenmill.schema_support import draft_of, validator_class

    schema = json.loads(text)
    try:
        validator_class(draft_of(schema)).check_schema(schema)
    except SchemaError as exc:
        where = "/".join(str(part) for part in exc.path)
        return f"is not a valid JSON Schema{f' at {where}' if where else ''}: {exc.message}"
    return None


def _choice_list(choice: Any) -> list[str]:
    if isinstance(choice, str) or not isinstance(choice, (list, tuple)):
        raise InvalidRequestError("choice", f"must be a list of strings, got {type(choice).__name__}")
    if not choice:
        raise InvalidRequestError("choice", "must not be empty")
    if len(choice) > MAX_CHOICES:
        raise InvalidRequestError("choice", f"has {len(choice)} strings; at most {MAX_CHOICES} are accepted")
    for index, item in enumerate(choice):
        if not isinstance(item, str) or not item:
            raise InvalidRequestError(f"choice[{index}]", f"must be a non-empty string, got {item!r}")
    total = sum(map(len, choice))
    if total > MAX_CHOICE_CHARS:
        raise InvalidRequestError("choice", f"has {total} characters in all; at most {MAX_CHOICE_CHARS} are accepted")
    return list(choice)


def _check_regex(pattern: Any) -> None:
    if not isinstance(pattern, str) or not pattern:
        raise InvalidRequestError("regex", f"must be a non-empty string, got {pattern!r}")
    if len(pattern) > MAX_REGEX_LENGTH:
        raise InvalidRequestError("regex", f"is {len(pattern)} characters long; at most {MAX_REGEX_LENGTH} are accepted")
    if (depth := _group_depth(pattern)) > MAX_NESTING:  # `re`'s parser recurses per group
        raise InvalidRequestError("regex", f"groups nest {depth} deep, more than {MAX_NESTING}")
    try:
        with warnings.catch_warnings():  # e.g. "possible nested set": valid, and xgrammar decides in the end
            warnings.simplefilter("ignore")
            re.compile(pattern)
    except re.error as exc:
        raise InvalidRequestError("regex", f"does not compile: {exc}") from None


def _group_depth(pattern: str) -> int:
    """How deep a regular expression's groups nest: unescaped parentheses outside character classes. (Parentheses
    inside a `(?#...)` or verbose-mode comment count too, which can only overstate the depth.)"""
    depth = deepest = 0
    class_start = -1  # inside a character class: where a `]` would still be literal, else -1
    index = 0
    while index < len(pattern):
        char = pattern[index]
        if char == "\\":
            index += 2
            continue
        if class_start >= 0:
            if char == "]" and index > class_start:
                class_start = -1
        elif char == "[":
            class_start = index + 2 if pattern.startswith("^", index + 1) else index + 1
        elif char == "(":
            depth += 1
            deepest = max(deepest, depth)
        elif char == ")":
            depth = max(depth - 1, 0)
        index += 1
    return deepest


#: Each field's default, as a checked instance holds it (`without_defaults` leaves these out).
_DEFAULTS = SamplingParams().to_dict()
_NO_DEFAULT = object()


def without_defaults(values: dict[str, Any]) -> dict[str, Any]:
    """`values` (a checked instance's `to_dict()`) without the fields that hold their default, of its type: what a
    message carries (a job's to its worker, a request's to the engine process); `from_dict` fills them back in, so the
    same parameters arrive, in a smaller message (a typical job sets few of the fields; `benchmarks/job_queue.py`)."""
    kept = {}
    for name, value in values.items():
        default = _DEFAULTS.get(name, _NO_DEFAULT)
        if value.__class__ is not default.__class__ or value != default:
            kept[name] = value
    return kept
