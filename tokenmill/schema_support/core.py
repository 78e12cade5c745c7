"""The core form a schema is normalised into, its limits, and the refusal.

A subschema becomes a disjunction (`Disjs`) of branches (`Disj`): `{"enum": [v]}` (one value), `{"$ref": name}`
(a recursive `#/$defs/<name>`) or `{"type": T, ...}` holding only T's keywords, under the internal names
`typed_branch` lists. `[]` is unsatisfiable, `any_value()` is `true`.
"""

from __future__ import annotations

import json
from typing import Any

from tokenmill.errors import InvalidRequestError

Disj = dict[str, Any]  # one branch of the core form: {"enum": [...]}, {"$ref": name} or {"type": T, ...}
Disjs = list[Disj]  # a disjunction; [] is unsatisfiable

TYPES = ("null", "boolean", "number", "string", "array", "object")  # "integer" is a kind of number
#: Limits of the analysis: branches per node and nodes walked, past which a schema is refused as too complex.
MAX_BRANCHES = 64
MAX_NODES = 20_000
#: Most values a bounded `multipleOf` (or other finite numeric range) is enumerated into.
MAX_ENUMERATED = 2048


class UnsupportedSchema(InvalidRequestError):
    """A keyword no backend enforces in full (or an unsatisfiable schema), at a JSON pointer of the schema."""

    def __init__(self, keyword: str, pointer: str, why: str) -> None:
        super().__init__("json_schema", f"{keyword} at {pointer or '/'}: {why}")
        self.keyword, self.pointer = keyword, pointer or "/"


def typed_branch(kind: str) -> Disj:
    """A branch of one type with no constraint yet."""
    base: Disj = {"type": kind}
    if kind == "integer":
        base.update(lo=None, hi=None, mult=[])
    elif kind == "number":
        base.update(lo=None, hi=None, lo_open=False, hi_open=False, mult=[])
    elif kind == "string":
        base.update(pattern=None, minLength=0, maxLength=None, format=None)
    elif kind == "array":
        base.update(prefix=[], items=None, minItems=0, maxItems=None, contains=None, unique=False, items_set=False)
    elif kind == "object":
        base.update(props={}, required=set(), additional=None, additional_set=False, minProperties=0,
                    maxProperties=None, dependencies=[], names=None, patterns={})
    return base


def any_value() -> Disjs:
    return [typed_branch(kind) for kind in TYPES]


def is_any(disjs: Disjs) -> bool:
    return len(disjs) == len(TYPES) and all(is_bare(d) for d in disjs) and {d["type"] for d in disjs} == set(TYPES)


def is_bare(d: Disj) -> bool:
    return "type" in d and d == typed_branch(d["type"])


def same(a: Any, b: Any) -> bool:
    return json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True) and type(a) is type(b) or (
        a == b and not isinstance(a, bool) and not isinstance(b, bool))


def dedupe(disjs: Disjs) -> Disjs:
    seen, out = set(), []
    for d in disjs:
        key = json.dumps(d, sort_keys=True, default=lambda s: sorted(s) if isinstance(s, set) else repr(s))
        if key not in seen:
            seen.add(key)
            out.append(d)
    return out


def min_bound(a: int | None, b: int | None) -> int | None:
    """The tighter of two upper bounds, None meaning none."""
    return b if a is None else a if b is None else min(a, b)


def escape(name: Any) -> str:
    """`name` as one JSON pointer segment."""
    return str(name).replace("~", "~0").replace("/", "~1")
