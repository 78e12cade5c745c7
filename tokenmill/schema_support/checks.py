"""The check of every completion after decoding, the last line of defence rather than the plan.

`completion_error`: strict JSON (no NaN, no raw control characters, no repeated key in any object), valid under
the declared draft with `jsonschema` (`format` as an annotation; nothing is fetched). `regex_error`: Python
`re.fullmatch`.
"""

from __future__ import annotations

import functools
import json
import re
from typing import Any

from tokenmill.schema_support.drafts import draft_of, validator_class


def completion_error(schema: dict[str, Any], text: str) -> tuple[Any, str | None]:
    """(the JSON value, None) if `text` is one strict JSON value valid under `schema`, else (None, why)."""
    try:
        value = json.loads(text, object_pairs_hook=_no_repeated_keys, parse_constant=_no_constant)
    except _RepeatedKey as exc:
        return None, f"repeated key {exc.args[0]!r} in an object (JSON object names must be unique)"
    except ValueError as exc:
        return None, f"not valid JSON: {exc}"
    from jsonschema.exceptions import best_match

    try:
        error = best_match(_validator(json.dumps(schema)).iter_errors(value))
    except (OverflowError, ValueError) as exc:  # `multipleOf` on a number beyond float64 (`1e999` parses to inf)
        return None, f"a number beyond float64's range cannot be checked exactly ({exc})"
    if error is None:
        return value, None
    where = "/" + "/".join(str(p) for p in error.absolute_schema_path)
    return None, f"{error.validator} at {where} (value at {error.json_path}): {error.message}"


def regex_error(pattern: str, text: str) -> str | None:
    """Python `re.fullmatch`: the whole completion must match (ECMA-262 differences: see README)."""
    return None if re.fullmatch(pattern, text) else f"the text does not fully match {pattern!r}"


@functools.lru_cache(maxsize=256)
def _validator(text: str) -> Any:
    from referencing import Registry

    schema = json.loads(text)  # no format_checker: format is an annotation; an empty registry: nothing is fetched
    return validator_class(draft_of(schema))(schema, registry=Registry())


class _RepeatedKey(ValueError):
    pass


def _no_repeated_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    seen: set[str] = set()
    for key, _ in pairs:
        if key in seen:
            raise _RepeatedKey(key)
        seen.add(key)
    return dict(pairs)


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")
