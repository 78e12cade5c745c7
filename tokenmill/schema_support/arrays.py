"""Arrays: `items` (and draft 7's array form with `additionalItems`), `prefixItems`, `minItems`/`maxItems`,
`contains`/`minContains`, `uniqueItems`.

`contains` with count n becomes n prefix items (refused beside prefixItems), `maxContains` is refused, and
`uniqueItems` is enforced only where maxItems <= 1. A prefix item no value matches ends the array there.
"""

from __future__ import annotations

from typing import Any

from tokenmill.schema_support.core import Disj, Disjs, UnsupportedSchema, any_value, min_bound


class ArrayRules:
    """The array keywords of `Normaliser` (a mixin: it uses the normaliser's `norm`, `intersect` and `emit`)."""

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

    def _meet_array(self, x: Disj, y: Disj, ptr: str) -> Disjs:
        length = max(len(x["prefix"]), len(y["prefix"]))
        at = lambda d, i: d["prefix"][i] if i < len(d["prefix"]) else (d["items"] if d["items"] is not None else any_value())
        x["prefix"] = [self.intersect(at(x, i), at(y, i), ptr) for i in range(length)]
        x["items"] = y["items"] if x["items"] is None else x["items"] if y["items"] is None else self.intersect(x["items"], y["items"], ptr)
        x["items_set"] = x["items_set"] or y["items_set"]
        x["minItems"], x["maxItems"] = max(x["minItems"], y["minItems"]), min_bound(x["maxItems"], y["maxItems"])
        if x["contains"] is not None and y["contains"] is not None:
            raise UnsupportedSchema("contains", ptr, "two contains on one array are not supported")
        x["contains"] = x["contains"] or y["contains"]
        x["unique"] = x["unique"] or y["unique"]
        return [x]

    def _final_array(self, d: Disj, ptr: str, check: bool) -> Disjs:
        if d["contains"] is not None:
            inner, count, where = d["contains"]
            if count > 0:
                if d["prefix"]:
                    raise UnsupportedSchema("contains", f"{where}/contains", "beside prefixItems is not supported")
                d["prefix"] = [self.intersect(inner, d["items"] if d["items"] is not None else any_value(), ptr)] * count
                d["minItems"] = max(d["minItems"], count)
            d["contains"] = None
        for i, sub in enumerate(d["prefix"]):
            if not sub or self.emit(sub, ptr, check) is False:
                d["prefix"], d["maxItems"] = d["prefix"][:i], min_bound(d["maxItems"], i)
                break
        if d["items"] is not None and self.emit(d["items"], ptr, check) is False:
            d["maxItems"] = min_bound(d["maxItems"], len(d["prefix"]))
        if d["maxItems"] is not None and d["minItems"] > d["maxItems"]:
            return []
        if check and d["unique"] and (d["maxItems"] is None or d["maxItems"] > 1):
            raise UnsupportedSchema("uniqueItems", ptr, "is not supported (only with maxItems <= 1)")
        return [d]

    def _emit_array(self, d: Disj, out: dict[str, Any], ptr: str, check: bool) -> Any:
        if d["prefix"]:
            out["prefixItems"] = [self.emit(s, f"{ptr}/prefixItems/{i}", check) for i, s in enumerate(d["prefix"])]
        items = self.emit(d["items"], f"{ptr}/items", check) if d["items"] is not None else None
        if items is False or (d["prefix"] and d["maxItems"] is not None and d["maxItems"] <= len(d["prefix"])):
            out["items"] = False
        elif items is not None and items != {}:
            out["items"] = items
        elif d["minItems"] > len(d["prefix"]):  # xgrammar's strict mode reads absent items as none allowed
            out["items"] = self.emit(any_value(), f"{ptr}/items", check)
        if d["minItems"]:
            out["minItems"] = d["minItems"]
        if d["maxItems"] is not None:
            out["maxItems"] = d["maxItems"]
        return out
