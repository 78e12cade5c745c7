"""What Python's regex parser proves about a `pattern` (or a `patternProperties` key), for refusals and pruning.

Each answer is on the safe side where Python cannot read a pattern: the backend then decides. Python counts
code points; ECMA-262 without the u flag counts UTF-16 units.
"""

from __future__ import annotations

import re
import re._parser as sre  # type: ignore[import-not-found]  # loaded by `re` already: no import cost
from typing import Any

from tokenmill.schema_support.core import UnsupportedSchema

#: Code points JSON must escape inside a string: the control characters, quote and backslash.
_JSON_ESCAPED = set(range(0x20)) | {ord('"'), ord("\\")}


def matches_empty(pattern: str) -> bool:
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


def longest_whole_match(pattern: str) -> int | None:
    """The most characters of a string `pattern` matches, when it is anchored at both ends (`^...$` without the
    multiline flag: it matches the whole string); None where that has no bound, the pattern is not anchored so, or
    Python cannot read it (the backend decides). A string ECMA-262 matches has at most this many code points."""
    parsed = _parse(pattern)
    if parsed is None:
        return None
    items = parsed.data
    if (parsed.state.flags & re.MULTILINE or len(items) < 2 or items[0] != (sre.AT, sre.AT_BEGINNING)
            or items[-1] != (sre.AT, sre.AT_END)):
        return None
    longest = parsed.getwidth()[1]
    return None if longest >= sre.MAXREPEAT else longest


def patterns_disjoint(patterns: list[str]) -> bool:
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


def check_pattern(pattern: Any, ptr: str) -> None:
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
