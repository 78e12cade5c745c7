"""References: every `$ref` of a schema resolved inside it and rewritten to a local `#/$defs/tm<N>` pointer.

Local pointers, `$anchor`s, `$id`-relative URIs and URNs are resolved with `referencing`; remote references
(nothing is fetched), `$dynamicRef` and `$recursiveRef` are refused. Drafts 7 and 6 drop the keywords beside
`$ref`, as those drafts ignore them.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from tokenmill.schema_support.core import UnsupportedSchema, escape
from tokenmill.schema_support.drafts import specification

ROOT_URI = "urn:tokenmill:schema"
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems")
_SCHEMA_ONE = ("not", "if", "then", "else", "additionalProperties", "contains", "propertyNames",
               "unevaluatedProperties", "unevaluatedItems", "additionalItems")


def _children(node: dict[str, Any]) -> Iterator[tuple[str, Any, tuple[str, Any]]]:
    """(pointer suffix, subschema, (keyword, name or index or None)) for each subschema of `node`, None where the
    keyword holds one subschema; used to walk and rebuild."""
    for key in _SCHEMA_MAPS:
        if isinstance(node.get(key), dict):
            for name, sub in node[key].items():
                yield f"/{key}/{escape(name)}", sub, (key, name)
    for key in ("dependencies",):
        if isinstance(node.get(key), dict):
            for name, sub in node[key].items():
                if isinstance(sub, (dict, bool)):
                    yield f"/{key}/{escape(name)}", sub, (key, name)
    for key in _SCHEMA_LISTS:
        if isinstance(node.get(key), list):
            for i, sub in enumerate(node[key]):
                yield f"/{key}/{i}", sub, (key, i)
    items = node.get("items")
    if isinstance(items, list):
        for i, sub in enumerate(items):
            yield f"/items/{i}", sub, ("items", i)
    elif items is not None:
        yield "/items", items, ("items", None)
    for key in _SCHEMA_ONE:
        if key in node:
            yield f"/{key}", node[key], (key, None)


class Bundler:
    """Resolve every reference with `referencing` and rewrite it to `#/$defs/tm<N>` (one per target).

    `run()` gives the rewritten root, the definitions by name and the JSON pointer each came from (for errors)."""

    def __init__(self, schema: Any, draft: str) -> None:
        from referencing import Registry

        self.schema, self.draft, self.spec = schema, draft, specification(draft)
        self.registry = Registry().with_resource(ROOT_URI, self.spec.create_resource(schema)).crawl()
        self.pointers: dict[int, str] = {}
        self._index(schema, "")
        self.names: dict[int, str] = {}
        self.defs: dict[str, Any] = {}
        self.def_pointers: dict[str, str] = {}

    def _index(self, node: Any, pointer: str) -> None:
        if isinstance(node, dict):
            self.pointers.setdefault(id(node), pointer)
            for suffix, sub, _ in _children(node):
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
        for suffix, sub, (key, name) in _children(node):
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
