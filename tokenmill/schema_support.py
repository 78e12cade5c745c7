"""JSON Schema for structured outputs: what the grammar backend is given, and the check of every completion.

A grammar backend enforces a subset of JSON Schema. Handing it a whole schema and hoping would serve outputs
that break the keywords it ignores (`{"maximum": 300}` without "type" gave 7462), so the schema is analysed
first (`prepare`), and every completion is validated after decoding (`completion_error`):

* `_Bundler`: every `$ref` (local pointers, `$anchor`s, `$id`-relative, URNs) is resolved with `referencing`
  and rewritten to a local `#/$defs/tm<N>` pointer; remote references (nothing is fetched), `$dynamicRef` and
  `$recursiveRef` are refused. Draft-7 `$ref` siblings are dropped, as draft 7 ignores them.
* `_Normaliser`: the bundled schema is rewritten into a core subset that xgrammar 0.2.9 and llguidance enforce in
  full (one "type" per branch with only that type's keywords, `enum`, `anyOf`, local `$ref`; a pattern beside a
  length bound and patternProperties are llguidance's only, `xgrammar_gap` says so to the engine); each keyword is either
  kept, soundly rewritten (allOf and sibling keywords merged, if/then/else and not where the complement is a
  set of types, enum/const narrowed by validation, bounded multipleOf enumerated, contains as prefixItems,
  dependencies split into branches, ...) or refused with `UnsupportedSchema` naming the keyword and its JSON
  pointer. "Sound" means every output the rewritten schema admits is valid under the original one; a
  rewrite may admit fewer outputs (no undeclared properties, `format` dropped as an annotation), never more.
* `completion_error`: strict JSON (no NaN, no raw control characters, no repeated key in any object), valid
  under the declared draft with `jsonschema` (`format` as annotation). The engine marks a completion that
  fails it unsatisfied, with the reason; it is the last line of defence, not the plan.

Torch-free and xgrammar-free: `SamplingParams` runs `prepare` at the client, so refusals happen before queueing.
"""

from __future__ import annotations

import functools
import json
import math
import re
import re._parser as sre  # type: ignore[import-not-found]  # loaded by `re` already: no import cost
from collections.abc import Callable, Iterator
from decimal import Decimal
from typing import Any

from tokenmill.errors import InvalidRequestError

Disj = dict[str, Any]  # one branch of the core form: {"enum": [...]}, {"$ref": name} or {"type": T, ...}
Disjs = list[Disj]  # a disjunction; [] is unsatisfiable

ROOT_URI = "urn:tokenmill:schema"
TYPES = ("null", "boolean", "number", "string", "array", "object")  # "integer" is a kind of number
#: Limits of the analysis: branches per node and nodes walked, past which a schema is refused as too complex.
MAX_BRANCHES = 64
MAX_NODES = 20_000
#: Most values a bounded `multipleOf` (or other finite numeric range) is enumerated into.
MAX_ENUMERATED = 2048
#: Formats xgrammar 0.2.9 knows; other formats are dropped (an annotation in 2020-12 and draft 7 as validated).
XGRAMMAR_FORMATS = frozenset({"email", "date", "time", "date-time", "duration", "ipv4", "ipv6", "hostname", "uuid",
                              "uri", "uri-reference", "uri-template", "json-pointer", "relative-json-pointer"})
_ANNOTATIONS = frozenset({"title", "description", "default", "examples", "deprecated", "readOnly", "writeOnly",
                          "$comment", "contentMediaType", "contentEncoding", "contentSchema", "format",
                          "$schema", "$id", "$anchor", "$dynamicAnchor", "$defs", "definitions", "$vocabulary"})
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems")
_SCHEMA_ONE = ("not", "if", "then", "else", "additionalProperties", "contains", "propertyNames",
               "unevaluatedProperties", "unevaluatedItems", "additionalItems")


class UnsupportedSchema(InvalidRequestError):
    """A keyword no backend enforces in full (or an unsatisfiable schema), at a JSON pointer of the schema."""

    def __init__(self, keyword: str, pointer: str, why: str) -> None:
        super().__init__("json_schema", f"{keyword} at {pointer or '/'}: {why}")
        self.keyword, self.pointer = keyword, pointer or "/"


# -- drafts ------------------------------------------------------------------------------------------------
_DRAFTS = {
    "https://json-schema.org/draft/2020-12/schema": "2020-12",
    "https://json-schema.org/draft/2019-09/schema": "2019-09",
    "http://json-schema.org/draft-07/schema": "7",
    "http://json-schema.org/draft-06/schema": "6",
}


def draft_of(schema: Any) -> str:
    """The draft a schema declares with `$schema` (2020-12 if none); drafts before 6 are refused."""
    declared = schema.get("$schema") if isinstance(schema, dict) else None
    if declared is None:
        return "2020-12"
    draft = _DRAFTS.get(str(declared).rstrip("#"))
    if draft is None:
        raise UnsupportedSchema("$schema", "/$schema", f"{declared!r} is not supported (2020-12, 2019-09, draft 7, draft 6 are)")
    return draft


def validator_class(draft: str) -> Any:
    from jsonschema import Draft6Validator, Draft7Validator, Draft201909Validator, Draft202012Validator

    return {"2020-12": Draft202012Validator, "2019-09": Draft201909Validator, "7": Draft7Validator,
            "6": Draft6Validator}[draft]


def _specification(draft: str) -> Any:
    import referencing.jsonschema as rj

    return {"2020-12": rj.DRAFT202012, "2019-09": rj.DRAFT201909, "7": rj.DRAFT7, "6": rj.DRAFT6}[draft]


# -- the entry points --------------------------------------------------------------------------------------
def prepare(schema: dict[str, Any]) -> dict[str, Any]:
    """The schema a grammar backend can enforce in full, or UnsupportedSchema. Cached by the schema's text."""
    return json.loads(_prepared(json.dumps(schema, sort_keys=False)))


@functools.lru_cache(maxsize=256)
def _prepared(text: str) -> str:
    schema = json.loads(text)
    draft = draft_of(schema)
    root, defs, def_pointers = _Bundler(schema, draft).run()
    return json.dumps(_Normaliser(root, defs, def_pointers, draft).run())


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


def xgrammar_gap(prepared: Any, pointer: str = "") -> str | None:
    """Why xgrammar 0.2.9 cannot enforce a prepared schema in full (llguidance can), or None: a pattern beside
    minLength/maxLength, where xgrammar would ignore the length; patternProperties."""
    if isinstance(prepared, dict):
        if prepared.get("type") == "string" and "pattern" in prepared and ("minLength" in prepared or "maxLength" in prepared):
            return f"pattern at {pointer or '/'}: beside minLength/maxLength is enforced by llguidance only"
        if prepared.get("type") == "object" and isinstance(prepared.get("patternProperties"), dict):
            return f"patternProperties at {pointer or '/'}: is enforced by llguidance only"
        for key, value in prepared.items():
            if key not in ("enum", "const"):
                found = xgrammar_gap(value, f"{pointer}/{_escape(key)}")
                if found:
                    return found
    elif isinstance(prepared, list):
        for i, value in enumerate(prepared):
            found = xgrammar_gap(value, f"{pointer}/{i}")
            if found:
                return found
    return None


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


# -- bundling ----------------------------------------------------------------------------------------------
def _children(node: dict[str, Any], draft: str) -> Iterator[tuple[str, Any, Callable[[Any], None]]]:
    """(pointer suffix, subschema, setter into a copy) for each subschema of `node`; used to walk and rebuild."""
    del draft
    for key in _SCHEMA_MAPS:
        if isinstance(node.get(key), dict):
            for name, sub in node[key].items():
                yield f"/{key}/{_escape(name)}", sub, (key, name)  # type: ignore[misc]
    for key in ("dependencies",):
        if isinstance(node.get(key), dict):
            for name, sub in node[key].items():
                if isinstance(sub, (dict, bool)):
                    yield f"/{key}/{_escape(name)}", sub, (key, name)  # type: ignore[misc]
    for key in _SCHEMA_LISTS:
        if isinstance(node.get(key), list):
            for i, sub in enumerate(node[key]):
                yield f"/{key}/{i}", sub, (key, i)  # type: ignore[misc]
    items = node.get("items")
    if isinstance(items, list):
        for i, sub in enumerate(items):
            yield f"/items/{i}", sub, ("items", i)  # type: ignore[misc]
    elif items is not None:
        yield "/items", items, ("items", None)  # type: ignore[misc]
    for key in _SCHEMA_ONE:
        if key in node:
            yield f"/{key}", node[key], (key, None)  # type: ignore[misc]


def _escape(name: Any) -> str:
    return str(name).replace("~", "~0").replace("/", "~1")


class _Bundler:
    """Resolve every reference with `referencing` and rewrite it to `#/$defs/tm<N>` (one per target)."""

    def __init__(self, schema: Any, draft: str) -> None:
        from referencing import Registry

        self.schema, self.draft, self.spec = schema, draft, _specification(draft)
        self.registry = Registry().with_resource(ROOT_URI, self.spec.create_resource(schema)).crawl()
        self.pointers: dict[int, str] = {}
        self._index(schema, "")
        self.names: dict[int, str] = {}
        self.defs: dict[str, Any] = {}
        self.def_pointers: dict[str, str] = {}

    def _index(self, node: Any, pointer: str) -> None:
        if isinstance(node, dict):
            self.pointers.setdefault(id(node), pointer)
            for suffix, sub, _ in _children(node, self.draft):
                self._index(sub, pointer + suffix)

    def run(self) -> tuple[Any, dict[str, Any], dict[str, str]]:
        root = self._walk(self.schema, self.registry.resolver(ROOT_URI), "")
        return root, self.defs, self.def_pointers

    def _walk(self, node: Any, resolver: Any, pointer: str) -> Any:
        if not isinstance(node, dict):
            return node
        if isinstance(node.get("$id"), str):
            resolver = resolver.in_subresource(self.spec.create_resource(node))
        for keyword in ("$dynamicRef", "$recursiveRef"):
            if keyword in node:
                raise UnsupportedSchema(keyword, f"{pointer}/{keyword}", "dynamic references are not supported")
        out = {k: v for k, v in node.items() if k not in ("$defs", "definitions", "$id", "$anchor", "$dynamicAnchor")}
        for suffix, sub, (key, name) in _children(node, self.draft):  # type: ignore[misc]
            if key in ("$defs", "definitions"):
                continue
            walked = self._walk(sub, resolver, pointer + suffix)
            if name is None:
                out[key] = walked
            else:
                out[key] = dict(out[key]) if isinstance(out[key], dict) else list(out[key])
                out[key][name] = walked
        if "$ref" in node:
            out["$ref"] = "#/$defs/" + self._target(node["$ref"], resolver, f"{pointer}/$ref")
            if self.draft in ("7", "6"):  # draft 7 ignores the keywords beside $ref
                out = {"$ref": out["$ref"]}
        return out

    def _target(self, ref: Any, resolver: Any, pointer: str) -> str:
        from referencing.exceptions import Unresolvable

        try:
            resolved = resolver.lookup(ref)
        except Unresolvable as exc:
            raise UnsupportedSchema("$ref", pointer, f"{ref!r} cannot be resolved inside the schema "
                                    f"(remote references are not fetched): {exc}") from None
        key = id(resolved.contents)
        if key not in self.names:
            name = self.names[key] = f"tm{len(self.names)}"
            self.def_pointers[name] = self.pointers.get(key, pointer)
            self.defs[name] = True  # a placeholder while walking: cycles end here
            self.defs[name] = self._walk(resolved.contents, resolved.resolver, self.def_pointers[name])
        return self.names[key]


# -- the core form -----------------------------------------------------------------------------------------
def _typed(kind: str) -> Disj:
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


def _any() -> Disjs:
    return [_typed(kind) for kind in TYPES]


def _is_any(disjs: Disjs) -> bool:
    return len(disjs) == len(TYPES) and all(_is_bare(d) for d in disjs) and {d["type"] for d in disjs} == set(TYPES)


def _is_bare(d: Disj) -> bool:
    return "type" in d and d == _typed(d["type"])


class _Normaliser:
    """Rewrite the bundled schema into the core form, then emit it as a schema xgrammar enforces in full."""

    def __init__(self, root: Any, defs: dict[str, Any], def_pointers: dict[str, str], draft: str) -> None:
        self.root, self.defs, self.def_pointers, self.draft = root, defs, def_pointers, draft
        self.stack: list[str] = []
        self.opaque: set[str] = set()
        self.nodes = 0
        self.memo: dict[tuple[int, bool], tuple[Disjs, Any]] = {}

    def run(self) -> dict[str, Any]:
        disjs = self.norm(self.root, "")
        out = self.emit(disjs, "")
        if out is False:
            raise UnsupportedSchema("schema", "", "no value is valid under it (unsatisfiable)")
        emitted: dict[str, Any] = {}
        while self.opaque - set(emitted):
            name = min(self.opaque - set(emitted))
            self.stack = [name]
            body = self.emit(self.norm(self.defs[name], self.def_pointers[name]), self.def_pointers[name])
            if body is False:
                raise UnsupportedSchema("$ref", self.def_pointers[name], "the recursive definition matches no value")
            emitted[name] = body
        if emitted:
            out = {**(out if isinstance(out, dict) else {}), "$defs": emitted}
        return out if isinstance(out, dict) else {}

    # validation of values against a bundled or emitted subschema: the oracle for enum narrowing
    def valid(self, schema: Any, value: Any, core: bool = False) -> bool:
        draft = "2020-12" if core else self.draft
        from referencing import Registry

        wrapper = {"$defs": self.defs, "allOf": [schema]}
        return validator_class(draft)(wrapper, registry=Registry()).is_valid(value)

    # -- one node -----------------------------------------------------------------------------------------
    def norm(self, node: Any, ptr: str) -> Disjs:
        self.nodes += 1
        if self.nodes > MAX_NODES:
            raise UnsupportedSchema("schema", ptr, f"too large to analyse (over {MAX_NODES} subschemas walked)")
        if node is True or node == {}:
            return _any()
        if node is False:
            return []
        if not isinstance(node, dict):
            raise UnsupportedSchema("schema", ptr, f"a subschema must be an object or a boolean, got {node!r}")
        if "enum" in node or "const" in node:  # narrowed by the full node: every kept value is valid
            values = list(node["enum"]) if "enum" in node else [node["const"]]
            if "const" in node:
                values = [v for v in values if _same(v, node["const"])]
            return _dedupe([{"enum": [v]} for v in values if self.valid(node, v)])
        parts = [self.typed(node, ptr)]
        if "$ref" in node:
            parts.append(self.ref(node["$ref"], f"{ptr}/$ref"))
        for i, sub in enumerate(node.get("allOf", [])):
            parts.append(self.norm(sub, f"{ptr}/allOf/{i}"))
        if "anyOf" in node:
            parts.append(self.union([self.norm(s, f"{ptr}/anyOf/{i}") for i, s in enumerate(node["anyOf"])], ptr))
        if "oneOf" in node:
            parts.append(self.one_of(node["oneOf"], f"{ptr}/oneOf"))
        if "not" in node:
            parts.append(self.complement(self.norm(node["not"], f"{ptr}/not"), f"{ptr}/not"))
        if "if" in node and self.draft != "6":
            parts.append(self.conditional(node, ptr))
        out = parts[0]
        for part in parts[1:]:
            out = self.intersect(out, part, ptr)
        return self.unevaluated(node, out, ptr)

    def unevaluated(self, node: dict[str, Any], disjs: Disjs, ptr: str) -> Disjs:
        """unevaluatedProperties/Items after this node's in-place applicators are merged: a property declared in
        a merged branch was evaluated by the subschema that declared it (which the value satisfies), so the
        keyword constrains exactly the branch's undeclared properties (items past its prefix)."""
        out = []
        for d in disjs:
            kind = d.get("type")
            if kind == "object" and node.get("unevaluatedProperties", True) is not True and not d["additional_set"]:
                rest = self.norm(node["unevaluatedProperties"], f"{ptr}/unevaluatedProperties")
                d = {**d, "additional": rest, "additional_set": True}
            if kind == "array" and node.get("unevaluatedItems", True) is not True and not d["items_set"]:
                if d["contains"] is not None:
                    raise UnsupportedSchema("unevaluatedItems", f"{ptr}/unevaluatedItems", "beside contains is not supported")
                d = {**d, "items": self.norm(node["unevaluatedItems"], f"{ptr}/unevaluatedItems"), "items_set": True}
            out.append(d)
        return out

    def ref(self, ref: str, ptr: str) -> Disjs:
        name = ref.rsplit("/", 1)[1]
        if name in self.stack:  # recursion: a reference the backend follows
            self.opaque.add(name)
            return [{"$ref": name}]
        self.stack.append(name)
        try:
            return self.norm(self.defs[name], self.def_pointers[name])
        finally:
            self.stack.pop()

    def union(self, branches: list[Disjs], ptr: str) -> Disjs:
        return self._cap(_dedupe([d for b in branches for d in b]), ptr)

    def one_of(self, subs: list[Any], ptr: str) -> Disjs:
        """oneOf is anyOf where the branches provably exclude each other; otherwise refused."""
        branches = [self.norm(s, f"{ptr}/{i}") for i, s in enumerate(subs)]
        live = [b for b in branches if b]
        for i, a in enumerate(live):
            for b in live[i + 1:]:
                if not all(self.disjoint(x, y) for x in a for y in b):
                    raise UnsupportedSchema("oneOf", ptr, "branches that can match the same value are not "
                                            "supported (only mutually exclusive branches are enforced)")
        return self.union(live, ptr)

    def complement(self, disjs: Disjs, ptr: str) -> Disjs:
        """`not`: enforced where the negated schema is a set of whole types (or true/false)."""
        if not all(_is_bare(d) for d in disjs):
            raise UnsupportedSchema("not", ptr, "only a negated set of types (or true/false) can be enforced")
        kinds = {d["type"] for d in disjs}
        if "integer" in kinds and "number" not in kinds:
            raise UnsupportedSchema("not", ptr, "non-integer numbers cannot be enforced")
        return [_typed(k) for k in TYPES if k not in kinds]

    def conditional(self, node: dict[str, Any], ptr: str) -> Disjs:
        """if/then/else as anyOf[allOf[if, then], allOf[not if, else]], the second branch only if needed; without
        `then` it is anyOf[if, else], without both nothing."""
        if "then" not in node and "else" not in node:  # `if` alone constrains nothing
            return _any()
        condition = self.norm(node["if"], f"{ptr}/if")
        then = self.norm(node.get("then", True), f"{ptr}/then")
        other = self.norm(node.get("else", True), f"{ptr}/else")
        if _is_any(then):  # (if and true) or (not if and else) is exactly "if or else": no complement needed
            return self.union([condition, other], ptr)
        branches = [self.intersect(condition, then, ptr)]
        if other:
            try:
                negated = self.complement(condition, f"{ptr}/if")
            except UnsupportedSchema:
                negated = self.discriminator_complement(condition, self.typed(node, ptr), ptr)
                if negated is None:
                    raise
            branches.append(self.intersect(negated, other, ptr))
        return self.union(branches, ptr)

    def discriminator_complement(self, condition: Disjs, base: Disjs, ptr: str) -> Disjs | None:
        """`not if` for the discriminator pattern: `if` constrains one property k of an object
        (`{"properties": {"kind": {"const": "a"}}}`, non-objects pass it) and this node's own object branch
        requires k with a finite enum. Then "not if" within that branch is k's enum less the values `if`
        accepts. None where the pattern does not apply."""
        objects = [d for d in condition if d.get("type") == "object"]
        others = {d["type"] for d in condition if d.get("type") != "object" and _is_bare(d)}
        if len(objects) != 1 or others != set(TYPES) - {"object"} or len(objects[0]["props"]) != 1:
            return None
        (key, accepted), = objects[0]["props"].items()
        if {**objects[0], "props": {}, "required": objects[0]["required"] - {key}} != _typed("object"):
            return None
        out = []
        for branch in base:
            if branch.get("type") != "object":
                continue  # non-objects pass `if`: none of them is in "not if"
            values = branch["props"].get(key)
            if values is None or key not in branch["required"] or not all("enum" in v for v in values):
                return None
            rest = [v for v in values if not self.valid(self.emit(accepted, ptr, check=False), v["enum"][0], core=True)]
            out.append({**branch, "props": {**branch["props"], key: rest}})
        return out or None

    # -- the type keywords of one node --------------------------------------------------------------------
    def typed(self, node: dict[str, Any], ptr: str) -> Disjs:
        declared = node.get("type")
        kinds = list(TYPES) if declared is None else [declared] if isinstance(declared, str) else list(declared)
        if "number" in kinds and "integer" in kinds:
            kinds.remove("integer")
        out = []
        for kind in kinds:
            d = _typed(kind)
            getattr(self, f"_{kind}", lambda *_: None)(d, node, ptr)
            out.append(d)
        return out

    def _integer(self, d: Disj, node: dict[str, Any], ptr: str) -> None:
        self._number(d, node, ptr)
        _as_integer(d)

    def _number(self, d: Disj, node: dict[str, Any], ptr: str) -> None:
        for key, bound, is_open in (("minimum", "lo", False), ("exclusiveMinimum", "lo", True),
                                    ("maximum", "hi", False), ("exclusiveMaximum", "hi", True)):
            if key in node:
                _tighten(d, bound, node[key], is_open)
        if "multipleOf" in node:
            d["mult"] = [node["multipleOf"]]

    def _string(self, d: Disj, node: dict[str, Any], ptr: str) -> None:
        if "pattern" in node:
            _check_pattern(node["pattern"], f"{ptr}/pattern")
            d["pattern"] = node["pattern"]
        d["minLength"] = int(node.get("minLength", 0))
        d["maxLength"] = None if "maxLength" not in node else int(node["maxLength"])
        d["format"] = node.get("format")

    def _array(self, d: Disj, node: dict[str, Any], ptr: str) -> None:
        items, rest_key = node.get("items"), "items"
        if isinstance(items, list):  # draft 7 / 2019-09 array form
            d["prefix"] = [self.norm(s, f"{ptr}/items/{i}") for i, s in enumerate(items)]
            rest_key = "additionalItems"
        elif "prefixItems" in node:
            d["prefix"] = [self.norm(s, f"{ptr}/prefixItems/{i}") for i, s in enumerate(node["prefixItems"])]
        if rest_key in node and (rest_key != "additionalItems" or isinstance(items, list)):
            d["items"], d["items_set"] = self.norm(node[rest_key], f"{ptr}/{rest_key}"), True
        d["minItems"] = int(node.get("minItems", 0))
        d["maxItems"] = None if "maxItems" not in node else int(node["maxItems"])
        d["unique"] = bool(node.get("uniqueItems", False))
        if "contains" in node:
            if "maxContains" in node:
                raise UnsupportedSchema("maxContains", f"{ptr}/maxContains", "is not supported")
            d["contains"] = (self.norm(node["contains"], f"{ptr}/contains"), int(node.get("minContains", 1)), ptr)

    def _object(self, d: Disj, node: dict[str, Any], ptr: str) -> None:
        d["patterns"] = {}
        for pattern, sub in node.get("patternProperties", {}).items():
            where = f"{ptr}/patternProperties/{_escape(pattern)}"
            _check_pattern(pattern, where)
            d["patterns"][pattern] = self.norm(sub, where)
        if not _patterns_disjoint(list(d["patterns"])):
            raise UnsupportedSchema("patternProperties", ptr, "with patterns a key may match more than one of is not "
                                    "supported (llguidance, which enforces them, needs them disjoint; told apart here "
                                    "only by different literal starts after ^)")
        d["props"] = {k: self.norm(s, f"{ptr}/properties/{_escape(k)}") for k, s in node.get("properties", {}).items()}
        d["props"] = {k: self._matching(d, k, sub, ptr) for k, sub in d["props"].items()}  # a declared key obeys its patterns too
        d["required"] = set(node.get("required", []))
        if "additionalProperties" in node:
            d["additional"] = self.norm(node["additionalProperties"], f"{ptr}/additionalProperties")
            d["additional_set"] = True
        d["minProperties"] = int(node.get("minProperties", 0))
        d["maxProperties"] = None if "maxProperties" not in node else int(node["maxProperties"])
        if "propertyNames" in node:
            d["names"] = (node["propertyNames"], f"{ptr}/propertyNames")
        deps = {**node.get("dependentRequired", {}), **node.get("dependentSchemas", {}), **node.get("dependencies", {})}
        for key, dep in deps.items():
            where = f"{ptr}/dependencies/{_escape(key)}" if key in node.get("dependencies", {}) else ptr
            if isinstance(dep, list):
                d["dependencies"].append((key, "required", dep))
            else:
                d["dependencies"].append((key, "schema", self.norm(dep, where)))

    # -- intersection -------------------------------------------------------------------------------------
    def intersect(self, a: Disjs, b: Disjs, ptr: str) -> Disjs:
        if _is_any(a) or _is_any(b):  # true is the identity (and keeps a recursive $ref opaque)
            return b if _is_any(a) else a
        out = []
        for x in a:
            for y in b:
                out += self.meet(x, y, ptr)
        return self._cap(_dedupe(out), ptr)

    def meet(self, x: Disj, y: Disj, ptr: str) -> Disjs:
        if "enum" in y and "enum" not in x:
            x, y = y, x
        if "enum" in x:
            value = x["enum"][0]
            return [x] if self.valid(self.emit([y], ptr, check=False), value, core=True) else []
        if "$ref" in y and "$ref" not in x:
            x, y = y, x
        if "$ref" in x:
            if "$ref" in y and y == x:
                return [x]
            expanded = self.ref("#/$defs/" + x["$ref"], ptr) if x["$ref"] not in self.stack else None
            if expanded is None or any("$ref" in e for e in expanded):
                raise UnsupportedSchema("$ref", ptr, "a recursive reference combined with other constraints is not supported")
            return self.intersect(expanded, [y], ptr)
        kinds = {x["type"], y["type"]}
        if len(kinds) == 2 and kinds != {"integer", "number"}:
            return []
        if kinds == {"integer", "number"}:
            x, y = (x, y) if x["type"] == "integer" else (y, x)
        return getattr(self, f"_meet_{x['type']}", lambda a, b, p: [dict(a)])(dict(x), y, ptr)

    def _meet_integer(self, x: Disj, y: Disj, ptr: str) -> Disjs:
        self._meet_number(x, y, ptr)
        _as_integer(x)
        return [x]

    def _meet_number(self, x: Disj, y: Disj, ptr: str) -> Disjs:
        if y["lo"] is not None:
            _tighten(x, "lo", y["lo"], y.get("lo_open", False))
        if y["hi"] is not None:
            _tighten(x, "hi", y["hi"], y.get("hi_open", False))
        x["mult"] = x["mult"] + y["mult"]
        return [x]

    def _meet_string(self, x: Disj, y: Disj, ptr: str) -> Disjs:
        if x["pattern"] is not None and y["pattern"] is not None and x["pattern"] != y["pattern"]:
            raise UnsupportedSchema("pattern", ptr, "two different patterns on one string are not supported")
        x["pattern"] = x["pattern"] or y["pattern"]
        x["minLength"] = max(x["minLength"], y["minLength"])
        x["maxLength"] = _min(x["maxLength"], y["maxLength"])
        x["format"] = x["format"] if x["format"] == y["format"] else x["format"] or y["format"]
        return [x]

    def _meet_array(self, x: Disj, y: Disj, ptr: str) -> Disjs:
        length = max(len(x["prefix"]), len(y["prefix"]))
        at = lambda d, i: d["prefix"][i] if i < len(d["prefix"]) else (d["items"] if d["items"] is not None else _any())
        x["prefix"] = [self.intersect(at(x, i), at(y, i), ptr) for i in range(length)]
        x["items"] = y["items"] if x["items"] is None else x["items"] if y["items"] is None else self.intersect(x["items"], y["items"], ptr)
        x["items_set"] = x["items_set"] or y["items_set"]
        x["minItems"], x["maxItems"] = max(x["minItems"], y["minItems"]), _min(x["maxItems"], y["maxItems"])
        if x["contains"] is not None and y["contains"] is not None:
            raise UnsupportedSchema("contains", ptr, "two contains on one array are not supported")
        x["contains"] = x["contains"] or y["contains"]
        x["unique"] = x["unique"] or y["unique"]
        return [x]

    def _matching(self, d: Disj, key: str, sub: Disjs | None, ptr: str) -> Disjs | None:
        """`sub` (a key's own schema, or None for "no constraint") met with every pattern of `d` matching `key`."""
        for pattern, schema in d["patterns"].items():
            if re.search(pattern, key):
                sub = schema if sub is None else self.intersect(sub, schema, ptr)
        return sub

    def _rule(self, d: Disj, key: str) -> Disjs | None:
        """What an object branch says about property `key`: its declared schema, else its matching patterns', else
        its additionalProperties (None: nothing)."""
        if key in d["props"]:
            return d["props"][key]
        if any(re.search(p, key) for p in d["patterns"]):
            return self._matching(d, key, None, "")
        return d["additional"]

    def _meet_object(self, x: Disj, y: Disj, ptr: str) -> Disjs:
        rule = self._rule
        if (x["patterns"] or y["patterns"]) and x["patterns"] != y["patterns"] and not (
                (not y["patterns"] and y["additional"] is None) or (not x["patterns"] and x["additional"] is None)):
            raise UnsupportedSchema("patternProperties", ptr, "combined with another object's patternProperties or "
                                    "additionalProperties is not supported")
        props = {}
        for key in [*x["props"], *(k for k in y["props"] if k not in x["props"])]:
            a, b = rule(x, key), rule(y, key)
            props[key] = a if b is None else b if a is None else self.intersect(a, b, ptr)
        x["props"], x["required"] = props, x["required"] | y["required"]
        x["patterns"] = x["patterns"] or y["patterns"]
        a, b = x["additional"], y["additional"]
        x["additional"] = a if b is None else b if a is None else self.intersect(a, b, ptr)
        x["additional_set"] = x["additional_set"] or y["additional_set"]
        x["minProperties"] = max(x["minProperties"], y["minProperties"])
        x["maxProperties"] = _min(x["maxProperties"], y["maxProperties"])
        if x["names"] is not None and y["names"] is not None and x["names"][0] != y["names"][0]:
            raise UnsupportedSchema("propertyNames", y["names"][1], "two propertyNames on one object are not supported")
        x["names"] = x["names"] or y["names"]
        x["dependencies"] = x["dependencies"] + y["dependencies"]
        return [x]

    # -- disjointness (for oneOf) -------------------------------------------------------------------------
    def disjoint(self, x: Disj, y: Disj) -> bool:
        if "$ref" in x or "$ref" in y:
            return False
        if "enum" in x or "enum" in y:
            return not self.meet(x, y, "")
        kinds = {x["type"], y["type"]}
        if len(kinds) == 2:
            return kinds != {"integer", "number"}
        if x["type"] in ("integer", "number"):
            return _ranges_disjoint(x, y)
        if x["type"] == "object":
            for key in x["required"] & y["required"]:
                a, b = self._rule(x, key), self._rule(y, key)
                if a is not None and b is not None and all(self.disjoint(p, q) for p in a for q in b):
                    return True
        return False

    # -- emission -----------------------------------------------------------------------------------------
    def emit(self, disjs: Disjs, ptr: str, check: bool = True) -> Any:
        """The core form as a JSON Schema for the backend; False if no branch is satisfiable. Memoised by the
        list's identity (lists are never changed once built): finalising asks for children's emission twice."""
        key = (id(disjs), check)
        if key not in self.memo:
            self.memo[key] = (disjs, self._emit(disjs, ptr, check))
        return self.memo[key][1]

    def _emit(self, disjs: Disjs, ptr: str, check: bool) -> Any:
        out = []
        for d in disjs:
            for branch in self.finalise(d, ptr, check):
                out.append(self.emit_one(branch, ptr, check))
        out = [o for o in out if o is not False]
        consts = [o["const"] for o in out if set(o) == {"const"}]
        if len(consts) > 1:
            out = [o for o in out if set(o) != {"const"}] + [{"enum": consts}]
        bare = [o["type"] for o in out if set(o) == {"type"}]
        if set(TYPES) <= set(bare):
            return {}
        if len(bare) > 1:
            out = [o for o in out if set(o) != {"type"}] + [{"type": bare}]
        if not out:
            return False
        return out[0] if len(out) == 1 else {"anyOf": out}

    def finalise(self, d: Disj, ptr: str, check: bool) -> Disjs:
        """Rewrites that need the whole merged branch (bounds, contains, dependencies); [] if unsatisfiable."""
        kind = d.get("type")
        if kind in ("integer", "number"):
            return self._final_number(d, ptr)
        if kind == "string":
            if d["maxLength"] is not None and d["minLength"] > d["maxLength"]:
                return []
            if d["maxLength"] == 0 and d["pattern"] is not None and not _matches_empty(d["pattern"]):
                return []  # only "" has length 0, and the pattern does not match it
            longest = None if d["pattern"] is None else _longest_whole_match(d["pattern"])
            if longest is not None and d["minLength"] > longest:
                return []  # every string the pattern matches is shorter than minLength
            return [d]
        if kind == "array":
            return self._final_array(dict(d), ptr, check)
        if kind == "object":
            return self._final_object(dict(d), ptr, check)
        return [d]

    def _final_number(self, d: Disj, ptr: str) -> Disjs:
        lo, hi = d["lo"], d["hi"]
        if lo is not None and hi is not None and (lo > hi or (lo == hi and (d.get("lo_open") or d.get("hi_open")))):
            return []
        if not d["mult"]:
            return [d]
        values = _enumerate(d)
        if values is None:
            raise UnsupportedSchema("multipleOf", ptr, f"is enforced only with minimum and maximum that leave at most "
                                    f"{MAX_ENUMERATED} multiples")
        return [{"enum": [v]} for v in values]

    def _final_array(self, d: Disj, ptr: str, check: bool) -> Disjs:
        if d["contains"] is not None:
            inner, count, where = d["contains"]
            if count > 0:
                if d["prefix"]:
                    raise UnsupportedSchema("contains", f"{where}/contains", "beside prefixItems is not supported")
                d["prefix"] = [self.intersect(inner, d["items"] if d["items"] is not None else _any(), ptr)] * count
                d["minItems"] = max(d["minItems"], count)
            d["contains"] = None
        for i, sub in enumerate(d["prefix"]):
            if not sub or self.emit(sub, ptr, check) is False:
                d["prefix"], d["maxItems"] = d["prefix"][:i], _min(d["maxItems"], i)
                break
        if d["items"] is not None and self.emit(d["items"], ptr, check) is False:
            d["maxItems"] = _min(d["maxItems"], len(d["prefix"]))
        if d["maxItems"] is not None and d["minItems"] > d["maxItems"]:
            return []
        if check and d["unique"] and (d["maxItems"] is None or d["maxItems"] > 1):
            raise UnsupportedSchema("uniqueItems", ptr, "is not supported (only with maxItems <= 1)")
        return [d]

    def _final_object(self, d: Disj, ptr: str, check: bool) -> Disjs:
        if d["names"] is not None:
            d = dict(d)
            names, where = d["names"]
            finite = None if d["patterns"] else self._finite_names(names, where)
            if finite is not None:  # a closed set of names (dict[Literal[...], V]): each one an optional property
                extra = d["additional"] if d["additional"] is not None else _any()
                d["props"] = {**d["props"], **{n: extra for n in finite if n not in d["props"]}}
                d["additional"], d["additional_set"] = [], True
            elif d["additional"] is not None or d["patterns"] or d["minProperties"] > len(d["props"]):
                raise UnsupportedSchema("propertyNames", where, "is enforced only where additional properties are not allowed")
            for key in [k for k in d["props"] if not self.valid(names, k)]:
                if self._forbid(d, key, ptr) is None:
                    return []
                d = self._forbid(d, key, ptr)
            d["names"] = None
        # after propertyNames, which may declare the names a dependency's branch without its key must then forbid
        if d["dependencies"]:
            key, how, dep = d["dependencies"][0]
            rest = {**d, "dependencies": d["dependencies"][1:]}
            present = {**rest, "required": rest["required"] | {key}}
            if how == "required":
                present["required"] = present["required"] | set(dep)
                branches = [present]
            else:
                branches = self.meet(present, self._as_object(dep, ptr), ptr) if dep else []
            if key not in rest["required"]:
                branches.append(self._forbid(rest, key, ptr))
            return [f for b in branches if b is not None for f in self.finalise(b, ptr, check)]
        for key in sorted(d["required"] - set(d["props"])):
            rule = self._rule(d, key)
            d["props"] = {**d["props"], key: rule if rule is not None else _any()}
        for key, sub in list(d["props"].items()):
            if not sub or self.emit(sub, ptr, check) is False:
                if key in d["required"]:
                    return []
                forbidden = self._forbid(d, key, ptr)
                if forbidden is None:
                    return []
                d = forbidden
        if d["maxProperties"] is not None and (len(d["required"]) > d["maxProperties"] or d["minProperties"] > d["maxProperties"]):
            return []
        return [d]

    def _finite_names(self, names: Any, where: str) -> list[str] | None:
        """The property names `propertyNames` allows, if it is a small finite set of strings (an enum or const)."""
        disjs = self.norm(names, where)
        if not disjs or len(disjs) > MAX_BRANCHES or not all("enum" in x and isinstance(x["enum"][0], str) for x in disjs):
            return None
        return [x["enum"][0] for x in disjs]

    def _as_object(self, disjs: Disjs, ptr: str) -> Disj:
        """A dependent schema applies to this object only: its object branch (refused if it branches)."""
        objects = [x for x in disjs if x.get("type") == "object"]
        if len(objects) != 1:
            raise UnsupportedSchema("dependentSchemas", ptr, "a dependent schema with several object branches is not supported")
        return objects[0]

    def _forbid(self, d: Disj, key: str, ptr: str) -> Disj | None:
        """The branch with property `key` absent; None if that is impossible (it is required)."""
        if key in d["required"]:
            return None
        rest = self._rule({**d, "props": {}}, key)
        if rest is not None and self.emit(rest, ptr, check=False) is not False:
            raise UnsupportedSchema("properties", f"{ptr}/properties/{_escape(key)}", "a forbidden property beside "
                                    "allowed additional or pattern properties is not supported")
        return {**d, "props": {k: v for k, v in d["props"].items() if k != key}}

    def emit_one(self, d: Disj, ptr: str, check: bool) -> Any:
        if "enum" in d:
            return {"const": d["enum"][0]}
        if "$ref" in d:
            return {"$ref": f"#/$defs/{d['$ref']}"}
        kind, out = d["type"], {"type": d["type"]}
        if kind in ("integer", "number"):
            for bound, inclusive, exclusive in (("lo", "minimum", "exclusiveMinimum"), ("hi", "maximum", "exclusiveMaximum")):
                if d[bound] is not None:
                    out[exclusive if d.get(f"{bound}_open") else inclusive] = d[bound]
        elif kind == "string":
            if d["pattern"] is not None:
                out["pattern"] = d["pattern"]
                if d["minLength"]:  # both: llguidance enforces them, xgrammar refuses (`xgrammar_gap`)
                    out["minLength"] = d["minLength"]
                if d["maxLength"] is not None:
                    out["maxLength"] = d["maxLength"]
            elif d["minLength"] or d["maxLength"] is not None:  # mlc-ai/xgrammar#800: a bound as a pattern
                out["pattern"] = f"^.{{{d['minLength']},{'' if d['maxLength'] is None else d['maxLength']}}}$"
            elif d["format"] in XGRAMMAR_FORMATS:
                out["format"] = d["format"]
        elif kind == "array":
            return self._emit_array(d, out, ptr, check)
        elif kind == "object":
            return self._emit_object(d, out, ptr, check)
        return out

    def _emit_array(self, d: Disj, out: dict[str, Any], ptr: str, check: bool) -> Any:
        if d["prefix"]:
            out["prefixItems"] = [self.emit(s, f"{ptr}/prefixItems/{i}", check) for i, s in enumerate(d["prefix"])]
        items = self.emit(d["items"], f"{ptr}/items", check) if d["items"] is not None else None
        if items is False or (d["prefix"] and d["maxItems"] is not None and d["maxItems"] <= len(d["prefix"])):
            out["items"] = False
        elif items is not None and items != {}:
            out["items"] = items
        elif d["minItems"] > len(d["prefix"]):  # xgrammar's strict mode reads absent items as none allowed
            out["items"] = self.emit(_any(), f"{ptr}/items", check)
        if d["minItems"]:
            out["minItems"] = d["minItems"]
        if d["maxItems"] is not None:
            out["maxItems"] = d["maxItems"]
        return out

    def _emit_object(self, d: Disj, out: dict[str, Any], ptr: str, check: bool) -> Any:
        if d["props"]:
            out["properties"] = {k: self.emit(s, f"{ptr}/properties/{_escape(k)}", check) for k, s in d["props"].items()}
        if d["required"]:
            out["required"] = [k for k in d["props"] if k in d["required"]]
        if d["patterns"]:  # llguidance only (`xgrammar_gap`)
            out["patternProperties"] = {p: self.emit(s, f"{ptr}/patternProperties/{_escape(p)}", check)
                                        for p, s in d["patterns"].items()}
        extra = self.emit(d["additional"], f"{ptr}/additionalProperties", check) if d["additional"] is not None else None
        # Undeclared properties only where the schema gives them a constraint, or minProperties needs them: no
        # undeclared property is a sound subset of "any" (and what xgrammar's strict mode generates), said
        # explicitly so that the rewritten schema means, as JSON Schema, exactly what is enforced.
        if extra is not None and extra is not False and (extra != {} or d["minProperties"] > len(d["props"])):
            out["additionalProperties"] = extra
        elif extra is None and d["minProperties"] > len(d["props"]):
            out["additionalProperties"] = True
        else:
            out["additionalProperties"] = False
        if d["minProperties"]:
            out["minProperties"] = d["minProperties"]
        if d["maxProperties"] is not None:
            out["maxProperties"] = d["maxProperties"]
        return out

    def _cap(self, disjs: Disjs, ptr: str) -> Disjs:
        if len(disjs) > MAX_BRANCHES:
            raise UnsupportedSchema("schema", ptr, f"too many alternatives after rewriting (over {MAX_BRANCHES})")
        return disjs


# -- helpers -----------------------------------------------------------------------------------------------
def _same(a: Any, b: Any) -> bool:
    return json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True) and type(a) is type(b) or (
        a == b and not isinstance(a, bool) and not isinstance(b, bool))


def _dedupe(disjs: Disjs) -> Disjs:
    seen, out = set(), []
    for d in disjs:
        key = json.dumps(d, sort_keys=True, default=lambda s: sorted(s) if isinstance(s, set) else repr(s))
        if key not in seen:
            seen.add(key)
            out.append(d)
    return out


def _min(a: int | None, b: int | None) -> int | None:
    return b if a is None else a if b is None else min(a, b)


def _tighten(d: Disj, bound: str, value: float, is_open: bool) -> None:
    """Narrow the lower ("lo") or upper ("hi") bound of a number branch to `value`."""
    current, current_open = d[bound], d.get(f"{bound}_open", False)
    tighter = current is None or (value > current if bound == "lo" else value < current) or (value == current and is_open)
    if tighter:
        d[bound] = value
        if "lo_open" in d:
            d[f"{bound}_open"] = is_open or (value == current and current_open)
        elif is_open:  # integer branch: an open bound is the next integer
            d[bound] = math.floor(value) + 1 if bound == "lo" else math.ceil(value) - 1


def _as_integer(d: Disj) -> None:
    """An integer branch: whole, inclusive bounds (xgrammar refuses fractional ones)."""
    lo, hi = d["lo"], d["hi"]
    if lo is not None:
        lo = math.floor(lo) + 1 if d.get("lo_open") and lo == math.floor(lo) else math.ceil(lo)
    if hi is not None:
        hi = math.ceil(hi) - 1 if d.get("hi_open") and hi == math.ceil(hi) else math.floor(hi)
    d.update(type="integer", lo=lo, hi=hi)
    d.pop("lo_open", None)
    d.pop("hi_open", None)


def _ranges_disjoint(x: Disj, y: Disj) -> bool:
    def below(a: Disj, b: Disj) -> bool:  # every value of a is below every value of b
        return a["hi"] is not None and b["lo"] is not None and (a["hi"] < b["lo"] or (a["hi"] == b["lo"] and (
            a.get("hi_open", False) or b.get("lo_open", False))))
    return below(x, y) or below(y, x)


def _enumerate(d: Disj) -> list[Any] | None:
    """The values of a bounded number branch with multipleOf, if few enough; None if unbounded or too many."""
    lo, hi = d["lo"], d["hi"]
    if lo is None or hi is None:
        return None
    step = Decimal(str(d["mult"][0]))
    first, last = math.ceil(Decimal(str(lo)) / step), math.floor(Decimal(str(hi)) / step)
    if last - first + 1 > MAX_ENUMERATED:
        return None
    from jsonschema import Draft202012Validator

    schema = {"type": d["type"], "multipleOf": d["mult"][0], "allOf": [{"multipleOf": m} for m in d["mult"][1:]]}
    for key, bound, is_open in (("minimum", "lo", False), ("maximum", "hi", False)):
        schema["exclusive" + key.capitalize() if d.get(f"{bound}_open") else key] = d[bound]
    check = Draft202012Validator(schema)
    values = []
    for k in range(first, last + 1):
        number = step * k
        value: Any = int(number) if number == number.to_integral_value() else float(number)
        if check.is_valid(value):
            values.append(value)
    return values


_JSON_ESCAPED = set(range(0x20)) | {ord('"'), ord("\\")}


def _matches_empty(pattern: str) -> bool:
    """Whether `pattern` matches the empty string (True where Python cannot read it: the backend decides)."""
    try:
        return re.search(pattern, "") is not None
    except re.error:
        return True


def _parse(pattern: str) -> Any:
    """Python's parse of `pattern` (`re._parser`'s items), or None where Python cannot read it (the backend decides)."""
    try:
        return sre.parse(pattern)
    except re.error:
        return None


def _longest_whole_match(pattern: str) -> int | None:
    """The most characters of a string `pattern` matches, when it is anchored at both ends (`^...$` without the
    multiline flag: it matches the whole string); None where that has no bound, the pattern is not anchored so, or
    Python cannot read it (the backend decides). Python counts code points; ECMA-262 without the u flag counts UTF-16
    units, so a string it matches has at most as many code points as this bound."""
    parsed = _parse(pattern)
    if parsed is None:
        return None
    items = parsed.data
    if (parsed.state.flags & re.MULTILINE or len(items) < 2 or items[0] != (sre.AT, sre.AT_BEGINNING)
            or items[-1] != (sre.AT, sre.AT_END)):
        return None
    longest = parsed.getwidth()[1]
    return None if longest >= sre.MAXREPEAT else longest


def _patterns_disjoint(patterns: list[str]) -> bool:
    """Whether no key can match two of `patterns`, proved the simple way: each is anchored with `^` (or `\\A`) and
    starts with literal characters, and no pattern's literal start begins another's. llguidance refuses patterns
    that overlap; this check may refuse some it would take, never one it refuses for overlapping."""
    if len(patterns) < 2:
        return True
    starts = [_literal_start(pattern) for pattern in patterns]
    if any(start is None for start in starts):
        return False
    return not any(a.startswith(b) for i, a in enumerate(starts) for j, b in enumerate(starts) if i != j)


def _literal_start(pattern: str) -> str | None:
    """The literal characters every match of `pattern` starts with, where it is anchored at the start and matched
    case-sensitively; else None."""
    parsed = _parse(pattern)
    if parsed is None or parsed.state.flags & re.IGNORECASE or not parsed.data or \
            parsed.data[0] not in ((sre.AT, sre.AT_BEGINNING), (sre.AT, sre.AT_BEGINNING_STRING)):
        return None
    start = []
    for op, arg in parsed.data[1:]:
        if op is not sre.LITERAL:
            break
        start.append(chr(arg))
    return "".join(start) or None


def _check_pattern(pattern: Any, ptr: str) -> None:
    """Refuse a pattern that can match a character JSON must escape (control characters, quote, backslash):
    xgrammar would write it raw, which is not JSON. Also `\\W` and `\\D`, where xgrammar's ASCII classes
    (ECMA-262) admit letters and digits that Python's Unicode `re`, the validator's, does not."""
    parsed = _parse(pattern)
    if parsed is None:
        return  # the metaschema check or the backend names it
    bad = _pattern_danger(parsed, sre)
    if bad:
        raise UnsupportedSchema("pattern", ptr, f"{bad} is not supported (JSON strings would need escapes "
                                "xgrammar does not write, or Python and ECMA-262 classes differ)")


def _pattern_danger(parsed: Any, sre: Any) -> str | None:
    for op, arg in parsed:
        name = str(op)
        if name == "LITERAL" and arg in _JSON_ESCAPED:
            return f"the character {chr(arg)!r}"
        if name == "IN":
            negated = any(str(o) == "NEGATE" for o, _ in arg)
            for o, a in arg:
                if str(o) == "CATEGORY" and str(a) in ("CATEGORY_NOT_WORD", "CATEGORY_NOT_DIGIT") and not negated:
                    return "\\W or \\D"
                if str(o) == "CATEGORY" and str(a) == "CATEGORY_SPACE" and not negated:
                    return "\\s (it matches control characters)"
                if not negated and str(o) == "LITERAL" and a in _JSON_ESCAPED:
                    return f"the character {chr(a)!r}"
                if not negated and str(o) == "RANGE" and any(a[0] <= c <= a[1] for c in _JSON_ESCAPED):
                    return f"the range {chr(a[0])!r}-{chr(a[1])!r}"
        for sub in _sub_patterns(name, arg):
            found = _pattern_danger(sub, sre)
            if found:
                return found
    return None


def _sub_patterns(name: str, arg: Any) -> list[Any]:
    if name in ("MAX_REPEAT", "MIN_REPEAT", "POSSESSIVE_REPEAT"):
        return [arg[2]]
    if name == "SUBPATTERN":
        return [arg[-1]]
    if name == "BRANCH":
        return list(arg[1])
    if name in ("ASSERT", "ASSERT_NOT"):
        return [arg[1]]
    if name == "ATOMIC_GROUP":
        return [arg]
    return []
