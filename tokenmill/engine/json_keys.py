"""Repeated object keys prevented while decoding, for every grammar backend.

Neither xgrammar nor llguidance forbids a key an open map (`additionalProperties`, `patternProperties`, any
object) already holds: `{"á":1,"á":0}` is valid for their grammars. RFC 8259 says names SHOULD be unique,
JSON Schema validators see only the last value, and `parsed` would silently drop one. So each constrained JSON
row carries a `KeyTracker`, a small scanner of the output's bytes (the grammar guarantees they are a JSON
prefix) that knows, inside an object key, which keys that object already has. The mask then drops every token
that would close the key as one of those: a token starting with the rest of a seen key and a quote.

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
                self.stack[-1].keys.add(bytes(self.key))  # type: ignore[union-attr]
            return
        if self.in_key:
            self.key.append(byte)

    def closing_repeats(self, prefixes: TokenPrefixes) -> list[int]:
        """Tokens that would end the key being written as one its object already has (usually none)."""
        if not (self.in_string and self.in_key) or self.escaped:
            return []
        seen = self.stack[-1].keys  # type: ignore[union-attr]
        written = bytes(self.key)
        return [t for key in seen if key.startswith(written) for t in prefixes.starting_with(key[len(written):] + b'"')]
