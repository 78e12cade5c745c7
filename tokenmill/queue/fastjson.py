"""JSON on the worker's per-job path: orjson wherever it reads or writes what the stdlib would, the stdlib elsewhere.

Why: a single job's JSON passes the worker six times (its kombu envelope, its Celery body, the engine-process
message both ways, its stored result, its check), where the stdlib's encoder and decoder were a large share of the
worker's CPU per job; orjson does the same work several times faster (docs/benchmarks/queue.md). Torch-free.

orjson is not the stdlib in a few places, each kept out here so that nothing decodes or stores differently:

* reading, it turns integers past 64 bits into floats, and refuses NaN, Infinity and numbers past float's range
  (the stdlib reads all of these); and kombu's decoder turns objects `{"__type__": ..., "__value__": ...}` into
  datetimes, UUIDs and decimals, a key that `\\u00XX` escapes can spell. Text holding `__type__`, `\\u00` or a
  run of 19 digits is read by the stdlib (or kombu), as is anything orjson refuses.
* writing, it writes non-finite floats as null and refuses integers past 64 bits and keys that are not strings:
  a message whose free-form parts (the ones the caller names: metadata, logprobs, parsed output, a JSON
  schema) hold such values is written by the stdlib.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from typing import Any

import orjson
from kombu import serialization
from kombu.utils.json import dumps as kombu_dumps
from kombu.utils.json import loads as kombu_loads

#: Every digit as "0", every other byte as a space: a run of `_BIG_INT` in the translation is a run of digits
#: in the text (a bytes scan, far cheaper than the equivalent regular expression). The scans here use `bytes.find`,
#: not `in`: `in` first tries its operand as an integer (`65 in b"A"`) and formats the TypeError that a bytes operand
#: raises.
_DIGITS = bytes(0x30 if 0x30 <= byte <= 0x39 else 0x20 for byte in range(256))
_BIG_INT = b"0" * 19
#: As `_DIGITS`, with "e" and "E" as "e": "0e" in the translation is a digit followed by an exponent mark.
_EXPONENTS = bytes(0x65 if byte in b"eE" else digit for byte, digit in enumerate(_DIGITS))
#: The integers orjson writes: signed and unsigned 64-bit.
_INT_RANGE = range(-(2**63), 2**64)


def loads(data: str | bytes, slow: Callable[[Any], Any] = kombu_loads) -> Any:
    """`slow(data)`'s value (kombu's `loads` by default: the codec of every Celery message), through orjson
    when that reads the same."""
    raw = _orjson_input(data)
    # a backslash first: one `memchr` (an envelope has none) before the slower 4-byte search
    if raw is not None and raw.find(b"__type__") < 0 and (raw.find(b"\\") < 0 or raw.find(b"\\u00") < 0):
        try:
            return orjson.loads(raw)
        except orjson.JSONDecodeError:
            pass  # NaN, Infinity, 1e999, bad JSON: the stdlib reads it, or raises its own error
    return slow(data)


def plain_loads(data: str | bytes) -> Any:
    """`json.loads`'s value (no kombu types, so no check for them: a text the engine escaped as `\\u00XX` is
    orjson's too), through orjson when that reads the same."""
    raw = _orjson_input(data)
    if raw is not None:
        try:
            return orjson.loads(raw)
        except orjson.JSONDecodeError:
            pass
    return json.loads(data)


def _orjson_input(data: str | bytes) -> bytes | None:
    """`data` as bytes for orjson, or None where orjson would not read it as the stdlib: a lone surrogate, or a
    run of 19 digits (an integer past 64 bits, which orjson reads as a float)."""
    try:
        raw = data.encode() if isinstance(data, str) else data
    except UnicodeEncodeError:  # a lone surrogate: the stdlib's to read (or refuse)
        return None
    if not isinstance(raw, bytes) or raw.translate(_DIGITS).find(_BIG_INT) >= 0:
        return None
    return raw


def dumps(value: Any, *free: Any, default: Callable[[Any], Any] | None = None) -> bytes:
    """JSON of `value`, as compact UTF-8: orjson, unless one of `free` (parts of `value` that may hold anything
    JSON-like) holds a value orjson writes otherwise, or orjson refuses `value`: then `json.dumps`."""
    if _orjson_writes_as_stdlib(free):
        try:
            return orjson.dumps(value, default=default)
        except (TypeError, orjson.JSONEncodeError):
            pass
    return json.dumps(value, default=default).encode()


def canonical(value: Any, *free: Any) -> bytes:
    """`json.dumps(value, sort_keys=True, separators=(",", ":"))` to the byte (what content hashes are taken of, so
    that every version hashes a job alike): orjson's sorted output where it is the same, which it is when the free
    parts pass the check of `dumps`, and the output is printable ASCII (the stdlib escapes DEL and every non-ASCII
    character) without a number in exponent form (the stdlib writes `1e-05` and `1e+16`, orjson `1e-5`, `1e16`) and
    without `0.0000` (below 1e-4 orjson may write a number out where the stdlib uses an exponent: `0.00006103515625`
    against `6.103515625e-05`; hypothesis found it; a text holding `0.0000` only takes the stdlib's way). These
    checks let through no output that differs from the stdlib's (tests/service/test_fastjson.py)."""
    if _orjson_writes_as_stdlib(free):
        try:
            raw = orjson.dumps(value, option=orjson.OPT_SORT_KEYS)
        except (TypeError, orjson.JSONEncodeError):
            raw = None
        if (raw is not None and raw.isascii() and raw.find(b"\x7f") < 0 and raw.translate(_EXPONENTS).find(b"0e") < 0
                and raw.find(b"0.0000") < 0):
            return raw
    return json.dumps(value, sort_keys=True, separators=(",", ":")).encode()


def _orjson_writes_as_stdlib(value: Any) -> bool:
    if value is None or isinstance(value, str | bool):
        return True
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, int):
        return value in _INT_RANGE
    if isinstance(value, dict):
        return all(isinstance(key, str) for key in value) and _orjson_writes_as_stdlib(tuple(value.values()))
    if isinstance(value, list | tuple):  # a loop, not a call per item: a result has a dozen free parts, mostly None
        for item in value:
            kind = item.__class__
            if item is None or kind is str or (kind is dict or kind is list) and not item:  # empty metadata: no call
                continue
            if kind is float:
                if not math.isfinite(item):
                    return False
            elif not _orjson_writes_as_stdlib(item):
                return False
        return True
    return False  # anything else goes through `default`: the stdlib's way, to be sure


def register_with_kombu() -> None:
    """Decode every JSON message and result of this process (kombu's `application/json` codec) with `loads`:
    the same values, faster. Encoding stays kombu's."""
    serialization.register("json", kombu_dumps, loads, content_type="application/json", content_encoding="utf-8")
