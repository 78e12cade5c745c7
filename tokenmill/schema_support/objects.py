"""Objects: `properties`, `required`, `additionalProperties`, `patternProperties`, `propertyNames`,
`minProperties`/`maxProperties`, `dependentRequired`/`dependentSchemas`/`dependencies`.

No undeclared property is emitted unless the schema gives undeclared ones a constraint or minProperties needs
them (`additionalProperties: false` otherwise). Each dependency splits a branch in two: key present with its
dependency, key absent. `propertyNames` is enforced as a finite set of names, or where no undeclared property
is allowed; patternProperties must be provably disjoint (`patterns_disjoint`), and are llguidance's only.
"""

from __future__ import annotations

import re
from typing import Any

from tokenmill.schema_support.core import MAX_BRANCHES, Disj, Disjs, UnsupportedSchema, any_value, escape, min_bound
from tokenmill.schema_support.patterns import check_pattern, patterns_disjoint


class ObjectRules:
    """The object keywords of `Normaliser` (a mixin: it uses the normaliser's `norm`, `intersect`, `meet`, `emit`,
    `finalise` and `valid`)."""

    def _object(self, d: Disj, node: dict[str, Any], ptr: str) -> None:
        d["patterns"] = {}
        for pattern, sub in node.get("patternProperties", {}).items():
            where = f"{ptr}/patternProperties/{escape(pattern)}"
            check_pattern(pattern, where)
            d["patterns"][pattern] = self.norm(sub, where)
        if not patterns_disjoint(list(d["patterns"])):
            raise UnsupportedSchema("patternProperties", ptr, "with patterns a key may match more than one of is not "
                                    "supported (llguidance, which enforces them, needs them disjoint; told apart here "
                                    "only by different literal starts after ^)")
        d["props"] = {k: self.norm(s, f"{ptr}/properties/{escape(k)}") for k, s in node.get("properties", {}).items()}
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
            where = f"{ptr}/dependencies/{escape(key)}" if key in node.get("dependencies", {}) else ptr
            if isinstance(dep, list):
                d["dependencies"].append((key, "required", dep))
            else:
                d["dependencies"].append((key, "schema", self.norm(dep, where)))

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
        x["maxProperties"] = min_bound(x["maxProperties"], y["maxProperties"])
        if x["names"] is not None and y["names"] is not None and x["names"][0] != y["names"][0]:
            raise UnsupportedSchema("propertyNames", y["names"][1], "two propertyNames on one object are not supported")
        x["names"] = x["names"] or y["names"]
        x["dependencies"] = x["dependencies"] + y["dependencies"]
        return [x]

    def _final_object(self, d: Disj, ptr: str, check: bool) -> Disjs:
        if d["names"] is not None:
            d = dict(d)
            names, where = d["names"]
            finite = None if d["patterns"] else self._finite_names(names, where)
            if finite is not None:  # a closed set of names (dict[Literal[...], V]): each one an optional property
                extra = d["additional"] if d["additional"] is not None else any_value()
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
            d["props"] = {**d["props"], key: rule if rule is not None else any_value()}
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
            raise UnsupportedSchema("properties", f"{ptr}/properties/{escape(key)}", "a forbidden property beside "
                                    "allowed additional or pattern properties is not supported")
        return {**d, "props": {k: v for k, v in d["props"].items() if k != key}}

    def _emit_object(self, d: Disj, out: dict[str, Any], ptr: str, check: bool) -> Any:
        if d["props"]:
            out["properties"] = {k: self.emit(s, f"{ptr}/properties/{escape(k)}", check) for k, s in d["props"].items()}
        if d["required"]:
            out["required"] = [k for k in d["props"] if k in d["required"]]
        if d["patterns"]:  # llguidance only (`xgrammar_gap`)
            out["patternProperties"] = {p: self.emit(s, f"{ptr}/patternProperties/{escape(p)}", check)
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
