"""Strings: `pattern`, `minLength`/`maxLength` and `format`.

A string branch holds at most one pattern (two different ones on one string are refused), checked by
`check_pattern`. `format` is an annotation: kept for the backend only where xgrammar knows it, else dropped.
"""

from __future__ import annotations

from typing import Any

from tokenmill.schema_support.core import Disj, Disjs, UnsupportedSchema, min_bound
from tokenmill.schema_support.patterns import check_pattern

#: Formats xgrammar 0.2.9 knows; other formats are dropped (an annotation in 2020-12 and draft 7 as validated).
XGRAMMAR_FORMATS = frozenset({"email", "date", "time", "date-time", "duration", "ipv4", "ipv6", "hostname", "uuid",
                              "uri", "uri-reference", "uri-template", "json-pointer", "relative-json-pointer"})


class StringRules:
    """The string keywords of `Normaliser` (a mixin: each family's methods are found by name)."""

    def _string(self, d: Disj, node: dict[str, Any], ptr: str) -> None:
        if "pattern" in node:
            check_pattern(node["pattern"], f"{ptr}/pattern")
            d["pattern"] = node["pattern"]
        d["minLength"] = int(node.get("minLength", 0))
        d["maxLength"] = None if "maxLength" not in node else int(node["maxLength"])
        d["format"] = node.get("format")

    def _meet_string(self, x: Disj, y: Disj, ptr: str) -> Disjs:
        if x["pattern"] is not None and y["pattern"] is not None and x["pattern"] != y["pattern"]:
            raise UnsupportedSchema("pattern", ptr, "two different patterns on one string are not supported")
        x["pattern"] = x["pattern"] or y["pattern"]
        x["minLength"] = max(x["minLength"], y["minLength"])
        x["maxLength"] = min_bound(x["maxLength"], y["maxLength"])
        x["format"] = x["format"] if x["format"] == y["format"] else x["format"] or y["format"]
        return [x]
