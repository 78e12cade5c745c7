"""Applicators: `anyOf`, `oneOf`, `not`, `if`/`then`/`else`, and `unevaluatedProperties`/`unevaluatedItems`
once they are merged (`allOf` and `$ref` are plain intersections: `Normaliser.norm`).

`oneOf` is served only where its branches provably exclude each other (`disjoint`), `not` only where the
negated schema is a set of whole types; `if`/`then`/`else` needs `not if` in that form (or the discriminator
pattern) unless `then` is true.
"""

from __future__ import annotations

from typing import Any

from tokenmill.schema_support.core import (TYPES, Disj, Disjs, UnsupportedSchema, any_value, dedupe, is_any, is_bare,
                                          typed_branch)
from tokenmill.schema_support.numbers import ranges_disjoint


class CombinatorRules:
    """The applicators of `Normaliser` (a mixin: it uses the normaliser's `norm`, `typed`, `intersect`, `meet`,
    `emit` and `valid`, and `_rule` of the object keywords)."""

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

    def union(self, branches: list[Disjs], ptr: str) -> Disjs:
        return self._cap(dedupe([d for b in branches for d in b]), ptr)

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
        if not all(is_bare(d) for d in disjs):
            raise UnsupportedSchema("not", ptr, "only a negated set of types (or true/false) can be enforced")
        kinds = {d["type"] for d in disjs}
        if "integer" in kinds and "number" not in kinds:
            raise UnsupportedSchema("not", ptr, "non-integer numbers cannot be enforced")
        return [typed_branch(k) for k in TYPES if k not in kinds]

    def conditional(self, node: dict[str, Any], ptr: str) -> Disjs:
        """if/then/else as anyOf[allOf[if, then], allOf[not if, else]], the second branch only if needed; without
        `then` it is anyOf[if, else], without both nothing."""
        if "then" not in node and "else" not in node:  # `if` alone constrains nothing
            return any_value()
        condition = self.norm(node["if"], f"{ptr}/if")
        then = self.norm(node.get("then", True), f"{ptr}/then")
        other = self.norm(node.get("else", True), f"{ptr}/else")
        if is_any(then):  # (if and true) or (not if and else) is exactly "if or else": no complement needed
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
        others = {d["type"] for d in condition if d.get("type") != "object" and is_bare(d)}
        if len(objects) != 1 or others != set(TYPES) - {"object"} or len(objects[0]["props"]) != 1:
            return None
        (key, accepted), = objects[0]["props"].items()
        if {**objects[0], "props": {}, "required": objects[0]["required"] - {key}} != typed_branch("object"):
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

    def disjoint(self, x: Disj, y: Disj) -> bool:
        """Whether no value matches both branches, proved by kind, bounds, or a required property (for oneOf)."""
        if "$ref" in x or "$ref" in y:
            return False
        if "enum" in x or "enum" in y:
            return not self.meet(x, y, "")
        kinds = {x["type"], y["type"]}
        if len(kinds) == 2:
            return kinds != {"integer", "number"}
        if x["type"] in ("integer", "number"):
            return ranges_disjoint(x, y)
        if x["type"] == "object":
            for key in x["required"] & y["required"]:
                a, b = self._rule(x, key), self._rule(y, key)
                if a is not None and b is not None and all(self.disjoint(p, q) for p in a for q in b):
                    return True
        return False
