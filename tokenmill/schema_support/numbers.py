"""Numbers: `minimum`/`maximum` and their exclusive forms, `multipleOf`, and "integer" as a kind of number.

A number branch holds bounds `lo`/`hi` (None: unbounded) with `lo_open`/`hi_open`; an integer branch holds whole,
inclusive bounds only. `multipleOf` is enforced by enumerating the multiples within both bounds (at most
`MAX_ENUMERATED`), else refused.
"""

from __future__ import annotations

import math
from decimal import Decimal
from typing import Any

from tokenmill.schema_support.core import MAX_ENUMERATED, Disj, Disjs, UnsupportedSchema


class NumberRules:
    """The number and integer keywords of `Normaliser` (a mixin: each family's methods are found by name)."""

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


def ranges_disjoint(x: Disj, y: Disj) -> bool:
    """Whether two number or integer branches share no value by their bounds alone."""
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
