"""Repeated object keys prevented while decoding, for every grammar backend.

Neither xgrammar nor llguidance forbids a key an open map (`additionalProperties`, `patternProperties`, any
object) already holds: `{"á":1,"á":0}` is valid for their grammars. RFC 8259 says names SHOULD be unique,
JSON Schema validators see only the last value, and `parsed` would silently drop one. So each constrained JSON
row carries a `KeyTracker`, a small scanner of the output's bytes (the grammar guarantees they are a JSON
prefix) that knows which keys each open object already has. The mask then drops every token that would write one
of those keys to its end: inside a key, a token starting with the rest of a seen key and a quote; where a key may
start, a token starting with the whole quoted key (`"id"`); in or after a value, one starting with a comma and
the quoted key (`,"id"`, or `","id"` from inside a value string, `},"id"` closing a nested container), the
spellings a BPE vocabulary holds as single tokens. A token that writes a repeated key some other way (a digit,
then `,"id"`) is left to the final check.

Keys are compared as written (`"a"` and `"\\u0061"` are the same name written twice differently): the final
check parses with a repeated-key hook and catches that case, the last line of defence. Where banning would leave
no token at all (a closed set of names, all used), nothing is banned and the final check decides.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field


@dataclass
class _Object:
    keys: set[bytes] = field(default_factory=set)
    expect_key: bool = True


class TokenPrefixes:
    """The vocabulary's token bytes sorted, to find every token that starts with some bytes (one bisect)."""

    def __init__(self, vocab: list[bytes]) -> None:
        pairs = sorted((token, index) for index, token in enumerate(vocab) if token)
        self.tokens = [token for token, _ in pairs]
        self.ids = [index for _, index in pairs]

    def starting_with(self, prefix: bytes) -> list[int]:
        start = bisect.bisect_left(self.tokens, prefix)
        end = start
        while end < len(self.tokens) and self.tokens[end].startswith(prefix):
            end += 1
        return self.ids[start:end]


class KeyTracker:
    """Where a JSON output is, as far as keys go: its open containers, the keys of each open object, and the key
    being written."""

    def __init__(self) -> None:
        self.stack: list[_Object | None] = []  # None for an array
        self.in_string = False
        self.in_key = False
        self.escaped = False
        self.key = bytearray()
        self.repeated = False  # some object got a key it already had (what the mask prevents; the tests' oracle)

    def feed(self, data: bytes) -> None:
        for byte in data:
            if self.in_string:
                self._string_byte(byte)
            elif byte == 0x7B:  # {
                self.stack.append(_Object())
            elif byte == 0x5B:  # [
                self.stack.append(None)
            elif byte in (0x7D, 0x5D) and self.stack:  # } ]
                self.stack.pop()
            elif byte == 0x22:  # "
                top = self.stack[-1] if self.stack else None
                self.in_string, self.in_key, self.escaped = True, top is not None and top.expect_key, False
                self.key.clear()
            elif byte == 0x3A and self.stack and self.stack[-1] is not None:  # :
                self.stack[-1].expect_key = False
            elif byte == 0x2C and self.stack and self.stack[-1] is not None:  # ,
                self.stack[-1].expect_key = True

    def _string_byte(self, byte: int) -> None:
        if self.escaped:
            self.escaped = False
        elif byte == 0x5C:  # backslash
            self.escaped = True
        elif byte == 0x22:
            self.in_string = False
            if self.in_key:
                keys = self.stack[-1].keys  # type: ignore[union-attr]
                self.repeated |= bytes(self.key) in keys
                keys.add(bytes(self.key))
            return
        if self.in_key:
            self.key.append(byte)

    def closing_repeats(self, prefixes: TokenPrefixes) -> list[int]:
        """Tokens that would write, to its closing quote, a key its object already has (usually none)."""
        if self.escaped or not self.stack:
            return []
        return [token for stem in self._repeat_stems() for token in prefixes.starting_with(stem)]

    def _repeat_stems(self) -> list[bytes]:
        top = self.stack[-1]
        if self.in_string and self.in_key:
            written = bytes(self.key)
            return [key[len(written):] + b'"' for key in top.keys if key.startswith(written)]  # type: ignore[union-attr]
        if self.in_string:  # a value string: of object `top`, or of an array (nothing to repeat)
            return [b'","' + key + b'"' for key in top.keys] if top is not None else []
        stems = []
        if top is not None:
            stems = [(b'"' if top.expect_key else b',"') + key + b'"' for key in top.keys]
        parent = self.stack[-2] if len(self.stack) >= 2 else None
        if parent is not None:  # closing `top`, the value of `parent`, and going on to parent's next key
            closer = b"}" if top is not None else b"]"
            stems += [closer + b',"' + key + b'"' for key in parent.keys]
        return stems
