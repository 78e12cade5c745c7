"""The Parquet type of `parsed`: a run's JSON schema mapped to an Arrow type, and each parsed value converted to it.

`parsed_column(schema)` reads the schema once and gives a `Column`: its Arrow `type` (the Parquet column's) and
`values(texts)`, the column's values from the rows' JSON texts. What the schema cannot type faithfully is stored
as its JSON text (a string), never reshaped to fit; the one value a typed column cannot hold, an integer beyond
int64, is null there (the row's text column still has it).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote

import pyarrow as pa

#: Most schema nodes mapped, and deepest nesting (references expanded included), before a whole schema is JSON text.
MAX_NODES = 10_000
MAX_DEPTH = 128
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1
#: Keywords that say nothing about a value's shape: allowed beside `$ref`, `anyOf`, `oneOf` and `allOf`.
_ANNOTATIONS = frozenset({"title", "description", "default", "examples", "deprecated", "readOnly", "writeOnly",
                          "$comment", "$schema", "$id", "$anchor", "$defs", "definitions", "format"})


@dataclass(eq=True)
class Column:
    """How one JSON value is stored. `kind`: struct, list, string, int64, float64, bool, or json (a string
    holding the value's JSON text). `fields` (struct) and `item` (list) are the children's columns."""

    kind: str
    type: pa.DataType
    fields: tuple[tuple[str, Column], ...] = ()
    item: Column | None = None

    def values(self, texts: list[str | None]) -> list[Any]:
        """The column's values from the rows' `parsed` JSON texts; None (a failed row) is null."""
        if self.kind == "json":
            return list(texts)
        return [None if text is None else self.convert(json.loads(text)) for text in texts]

    def convert(self, value: Any) -> Any:
        """`value` as this column stores it: JSON text for `json`, an integer as a float in a float64 column, a
        missing property null. A value of another type (which the completion check rules out) or an integer
        beyond int64 is null."""
        if value is None:
            return None
        if self.kind == "json":
            return json.dumps(value, ensure_ascii=False)
        if self.kind == "struct":
            return {name: column.convert(value.get(name)) for name, column in self.fields} if isinstance(value, dict) else None
        if self.kind == "list":
            return [self.item.convert(v) for v in value] if isinstance(value, list) and self.item else None
        return _SCALARS[self.kind](value)


def _string(value: Any) -> str | None:
    return value if isinstance(value, str) else None


def _bool(value: Any) -> bool | None:
    return value if isinstance(value, bool) else None


def _int64(value: Any) -> int | None:
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    ok = isinstance(value, int) and not isinstance(value, bool) and _INT64_MIN <= value <= _INT64_MAX
    return value if ok else None


def _float64(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        return float(value)
    except OverflowError:  # an integer beyond float's range
        return None


_SCALARS = {"string": _string, "bool": _bool, "int64": _int64, "float64": _float64}
JSON = Column("json", pa.string())
STRING, BOOL, INT64, FLOAT64 = (Column("string", pa.string()), Column("bool", pa.bool_()),
                                Column("int64", pa.int64()), Column("float64", pa.float64()))
_TYPES = {"string": STRING, "boolean": BOOL, "integer": INT64, "number": FLOAT64}


class _TooComplex(Exception):
    """The schema has more nodes or nesting than a column is built for."""


class _Recursive(Exception):
    """A reference back into a definition being expanded (`target`: its id): that definition is JSON text."""

    def __init__(self, target: int) -> None:
        super().__init__(target)
        self.target = target


def parsed_column(schema: dict[str, Any] | None) -> Column:
    """The column of `parsed` for a run's JSON schema (None: no schema, JSON text, as without one).

    Mapping, all fields nullable: an object with properties -> struct (fields in property order); string (and
    an enum or const of strings) -> string; integer -> int64; number -> float64; boolean -> bool; an array with
    items -> list of the items' column; `type: [X, "null"]` and an anyOf/oneOf of X and null -> X; local
    `$ref`s (`#/$defs/...`, `#/definitions/...`, any `#/` pointer) resolved. JSON text (a string) for what
    cannot be mapped faithfully: objects without properties or with schema-valued additionalProperties,
    patternProperties or minProperties past the properties; anyOf/oneOf branches of different columns; mixed
    enums; tuple arrays; a schema without a type; references that do not resolve locally; recursive definitions
    (wherever referenced); a schema past `MAX_NODES` or `MAX_DEPTH` (then the whole value).
    """
    if schema is None:
        return JSON
    try:
        return _Mapper(schema).map(schema, (id(schema),), 0)
    except (_TooComplex, _Recursive):  # too big, or the root refers to itself (`"$ref": "#"`)
        return JSON


def arrow_type(schema: dict[str, Any] | None) -> pa.DataType:
    """The Arrow type of `parsed` for a run's JSON schema (see `parsed_column`)."""
    return parsed_column(schema).type


class _Mapper:
    def __init__(self, root: dict[str, Any]) -> None:
        self.root = root
        self.nodes = 0

    def map(self, node: Any, refs: tuple[int, ...], depth: int) -> Column:
        """`node`'s column; `refs`: the definitions being expanded on the way here (ids of their schemas)."""
        self.nodes += 1
        if self.nodes > MAX_NODES or depth > MAX_DEPTH:
            raise _TooComplex
        if not isinstance(node, dict):
            return JSON  # true/false schemas
        for keyword in ("$ref", "anyOf", "oneOf", "allOf"):
            if keyword in node:
                return self._combined(keyword, node, refs, depth)
        if "enum" in node or "const" in node:
            return _enum(node["enum"] if "enum" in node else [node["const"]])
        kind = node.get("type")
        if isinstance(kind, list):
            named = [k for k in kind if k != "null"]
            kind = named[0] if len(named) == 1 else None
        if kind == "object":
            return self._object(node, refs, depth)
        if kind == "array":
            return self._array(node, refs, depth)
        return _TYPES.get(kind, JSON) if isinstance(kind, str) else JSON

    def _combined(self, keyword: str, node: dict[str, Any], refs: tuple[int, ...], depth: int) -> Column:
        """`$ref`, anyOf, oneOf, allOf: only beside annotations (other keywords could reshape the value)."""
        if set(node) - _ANNOTATIONS != {keyword}:
            return JSON
        if keyword == "$ref":
            return self._ref(node["$ref"], refs, depth)
        branches = node[keyword]
        if not isinstance(branches, list):
            return JSON
        if keyword == "allOf":
            return self.map(branches[0], refs, depth + 1) if len(branches) == 1 else JSON
        columns = [self.map(b, refs, depth + 1) for b in branches if not _is_null(b)]
        return columns[0] if columns and all(c == columns[0] for c in columns) else JSON

    def _ref(self, ref: Any, refs: tuple[int, ...], depth: int) -> Column:
        """The referenced schema's column; a recursive definition (one reaching itself through references) is
        JSON text wherever it is referenced, not a struct cut at some depth."""
        target = _resolve(self.root, ref)
        if target is None:
            return JSON
        if id(target) in refs:
            raise _Recursive(id(target))
        try:
            return self.map(target, (*refs, id(target)), depth + 1)
        except _Recursive as exc:
            if exc.target != id(target):
                raise
            return JSON

    def _object(self, node: dict[str, Any], refs: tuple[int, ...], depth: int) -> Column:
        props = node.get("properties")
        if not isinstance(props, dict) or not props or "patternProperties" in node:
            return JSON
        closed = all(node.get(k, True) in (True, False, {}) for k in ("additionalProperties", "unevaluatedProperties"))
        if not closed or node.get("minProperties", 0) > len(props):
            return JSON  # properties beyond the declared ones could be generated
        fields = tuple((name, self.map(sub, refs, depth + 1)) for name, sub in props.items())
        return Column("struct", pa.struct([pa.field(name, c.type) for name, c in fields]), fields=fields)

    def _array(self, node: dict[str, Any], refs: tuple[int, ...], depth: int) -> Column:
        items = node.get("items", {})
        if "prefixItems" in node or not isinstance(items, (dict, bool)):
            return JSON  # a tuple: its positions can differ in type
        item = self.map(items, refs, depth + 1)
        return Column("list", pa.list_(item.type), item=item)


def _is_null(node: Any) -> bool:
    return isinstance(node, dict) and (node.get("type") == "null" or node.get("enum") == [None]
                                       or ("const" in node and node["const"] is None))


def _enum(values: Any) -> Column:
    """An enum's column: its non-null values all strings, booleans, integers or numbers; else JSON text."""
    present = [v for v in values if v is not None] if isinstance(values, list) else []
    if not present:
        return JSON
    if all(isinstance(v, str) for v in present):
        return STRING
    if all(isinstance(v, bool) for v in present):
        return BOOL
    if any(isinstance(v, bool) or not isinstance(v, (int, float)) for v in present):
        return JSON
    return INT64 if all(_int64(v) is not None and isinstance(v, int) for v in present) else FLOAT64


def _resolve(root: dict[str, Any], ref: Any) -> Any:
    """The schema a local reference (`#`, `#/$defs/name`, any `#/` JSON pointer) points to, or None."""
    if not isinstance(ref, str) or not (ref == "#" or ref.startswith("#/")):
        return None
    node: Any = root
    for part in ref[2:].split("/") if ref != "#" else []:
        part = unquote(part).replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node
