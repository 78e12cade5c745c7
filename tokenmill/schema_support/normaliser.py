"""The rewrite of a bundled schema into the core form, and its emission as a schema the backends enforce in full.

Every keyword is kept, soundly rewritten or refused with `UnsupportedSchema` naming it and its JSON pointer.
Sound: every value the emitted schema admits is valid under the original one; it may admit fewer (no undeclared
properties, `format` dropped), never more. The emitted form: one "type" per branch with only that type's
keywords, `enum`/`const`, `anyOf`, local `$ref` (recursion), and the llguidance-only forms `xgrammar_gap` names.

Each keyword family is a mixin (`combinators`, `objects`, `arrays`, `strings`, `numbers`). A type's keywords are
read by `_<type>` and met by `_meet_<type>`, both found by name (a type without one has no keywords of its own),
so no other method may be named so.
"""

from __future__ import annotations

from typing import Any

from tokenmill.schema_support.arrays import ArrayRules
from tokenmill.schema_support.combinators import CombinatorRules
from tokenmill.schema_support.core import (MAX_BRANCHES, MAX_NODES, TYPES, Disj, Disjs, UnsupportedSchema, any_value,
                                          dedupe, is_any, same, typed_branch)
from tokenmill.schema_support.drafts import validator_class
from tokenmill.schema_support.numbers import NumberRules
from tokenmill.schema_support.objects import ObjectRules
from tokenmill.schema_support.patterns import longest_whole_match, matches_empty
from tokenmill.schema_support.strings import XGRAMMAR_FORMATS, StringRules


class Normaliser(CombinatorRules, ObjectRules, ArrayRules, StringRules, NumberRules):
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
            return any_value()
        if node is False:
            return []
        if not isinstance(node, dict):
            raise UnsupportedSchema("schema", ptr, f"a subschema must be an object or a boolean, got {node!r}")
        if "enum" in node or "const" in node:  # narrowed by the full node: every kept value is valid
            values = list(node["enum"]) if "enum" in node else [node["const"]]
            if "const" in node:
                values = [v for v in values if same(v, node["const"])]
            return dedupe([{"enum": [v]} for v in values if self.valid(node, v)])
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

    def typed(self, node: dict[str, Any], ptr: str) -> Disjs:
        """The node's type keywords: one branch per declared type (all types if none), by `_<type>`."""
        declared = node.get("type")
        kinds = list(TYPES) if declared is None else [declared] if isinstance(declared, str) else list(declared)
        if "number" in kinds and "integer" in kinds:
            kinds.remove("integer")
        out = []
        for kind in kinds:
            d = typed_branch(kind)
            getattr(self, f"_{kind}", lambda *_: None)(d, node, ptr)
            out.append(d)
        return out

    # -- intersection -------------------------------------------------------------------------------------
    def intersect(self, a: Disjs, b: Disjs, ptr: str) -> Disjs:
        if is_any(a) or is_any(b):  # true is the identity (and keeps a recursive $ref opaque)
            return b if is_any(a) else a
        out = []
        for x in a:
            for y in b:
                out += self.meet(x, y, ptr)
        return self._cap(dedupe(out), ptr)

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
            if d["maxLength"] == 0 and d["pattern"] is not None and not matches_empty(d["pattern"]):
                return []  # only "" has length 0, and the pattern does not match it
            longest = None if d["pattern"] is None else longest_whole_match(d["pattern"])
            if longest is not None and d["minLength"] > longest:
                return []  # every string the pattern matches is shorter than minLength
            return [d]
        if kind == "array":
            return self._final_array(dict(d), ptr, check)
        if kind == "object":
            return self._final_object(dict(d), ptr, check)
        return [d]

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

    def _cap(self, disjs: Disjs, ptr: str) -> Disjs:
        if len(disjs) > MAX_BRANCHES:
            raise UnsupportedSchema("schema", ptr, f"too many alternatives after rewriting (over {MAX_BRANCHES})")
        return disjs
