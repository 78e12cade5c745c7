"""Structured outputs: grammar-constrained decoding with xgrammar.

A request with `json_schema`, `choice`, `regex` or `json_object` gets a `Constraint`: an xgrammar
`GrammarMatcher` over a grammar compiled once per engine (`GrammarCache`). Each step the sampler asks the
constrained rows, and only those, for a token bitmask and sets every other logit to -inf before any
sampling filter (`apply_token_masks`), so greedy, seeds, penalties, top-k/p and min-p all act on the
allowed tokens only; the engine then advances the matcher with the sampled token. Unconstrained rows pay a
list scan, nothing more.

Decisions:
* JSON is compact (`any_whitespace=False`, separators "," and ":"): a weak or random model cannot spend its
  `max_tokens` on free whitespace, and every completion has one canonical spelling.
* `choice` is an EBNF alternation of the literal strings (JSON string escaping, which xgrammar's EBNF
  literals share), so any character in a choice is matched literally.
* A sequence finishes as soon as the grammar is complete and only a stop token could follow (the
  closing brace of an object, the last character of a choice): the step that would only sample EOS is
  saved. Where the grammar could go on (`\\d+`), the model decides between more and a stop token.
* Special tokens (BOS, PAD, ...) are removed from the grammar's vocabulary: xgrammar would otherwise
  treat "<s>" as the text "<s>", which decoding with `skip_special_tokens` drops, and the text would no
  longer match the grammar.
* A JSON schema reaches xgrammar only as `tokenmill.schema_support.prepare` rewrote it: a core subset xgrammar
  0.2.9 enforces in full (what it would ignore is merged, rewritten or refused before generation; length
  bounds become patterns, mlc-ai/xgrammar#800). Byte tokens are kept to valid UTF-8 (`_utf8_invalid`,
  `_AFTER_LEAD`).
* Every completed output is checked after decoding (`check_completion`): the last line of defence. An output
  that fails is reported unsatisfied with the reason, never passed off as valid.
* Compiling happens on the cache's threads, off the engine loop: a request whose grammar is new waits (not in
  the scheduler) while the others keep stepping, and fails naming its field past the engine's
  `grammar_compile_timeout`. Grammars are cached by their text, LRU-bounded by bytes (`grammar_cache_bytes`):
  in a batch job one schema serves the whole dataset. Compile errors are cached too, so a bad schema repeated
  in every job is rejected at dict-lookup cost.

xgrammar is imported on first use, so an engine that never sees a structured request does not load it.
"""

from __future__ import annotations

import functools
import json
import os
import threading
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from tokenmill.errors import InvalidRequestError
from tokenmill.schema_support import completion_error, prepare, regex_error

if TYPE_CHECKING:
    from tokenmill.sampling_params import SamplingParams

#: Compact JSON separators (item, key), as `json.dumps(separators=...)`.
JSON_SEPARATORS = (",", ":")


@dataclass(frozen=True)
class GrammarSpec:
    """A grammar in the form it is compiled from; equal specs share one compiled grammar."""

    field: str  # the SamplingParams field it came from, named in errors
    kind: str  # "json_schema" | "json_object" | "regex" | "ebnf"
    source: str

    @classmethod
    def from_params(cls, params: SamplingParams) -> GrammarSpec | None:
        structured = params.structured
        if structured is None:
            return None
        name, value = structured
        if name == "json_schema":
            return cls(name, "json_schema", json.dumps(prepare(value)))  # key order kept: it is the output's
        if name == "json_object":
            return cls(name, "json_object", '{"type": "object"}')
        if name == "regex":
            return cls(name, "regex", value)
        # One C-speed dump of the whole list instead of one per choice (20,000 choices: 47 ms -> a few, in the
        # engine loop's `add_request`). Inside a JSON string a quote is always escaped, so the element separator
        # `", "` occurs only between elements: the result is the choices' own dumps joined by " | ".
        alternatives = json.dumps(list(dict.fromkeys(value)), ensure_ascii=False)[1:-1].replace('", "', '" | "')
        return cls(name, "ebnf", f"root ::= {alternatives}")

    @property
    def is_json(self) -> bool:
        return self.kind in ("json_schema", "json_object")


class GrammarCache:
    """One per engine: the tokenizer's vocabulary as xgrammar sees it, a compiler, and compiled grammars."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_ids: Sequence[int], limit_bytes: int = 512 << 20) -> None:
        import xgrammar as xgr

        self.vocab_size = vocab_size
        self.stop_ids = sorted(stop_ids)
        self.info, vocab = _tokenizer_info(xgr, tokenizer, vocab_size, self.stop_ids)
        # xgrammar's own cache is unbounded (40 distinct 3,000-choice lists kept 1.2 GiB): ours is LRU by bytes.
        # One compiler thread per compile: on few cores more only compete with the engine loop.
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=1, cache_enabled=False)
        self.limit_bytes, self.total_bytes = limit_bytes, 0
        self._lock = threading.Lock()
        self._executor = ThreadPoolExecutor(max_workers=2, thread_name_prefix="grammar-compile", initializer=_lower_priority)
        self._inflight: dict[GrammarSpec, Future] = {}
        self.scratch = xgr.allocate_token_bitmask(1, vocab_size)  # for completion checks (one thread owns the engine)
        self.last_byte = [token[-1] if token else -1 for token in vocab]
        self.after_lead = _after_lead_words(vocab, self.scratch.shape[1])
        self._compiled: OrderedDict[GrammarSpec, tuple[Any, int]] = OrderedDict()  # spec -> (grammar or error, bytes)
        self._empty: dict[tuple[GrammarSpec, frozenset[int]], bool] = {}
        self._non_stop: dict[frozenset[int], np.ndarray] = {}

    def is_ready(self, spec: GrammarSpec) -> bool:
        """Whether `spec` is compiled (or known not to compile): a request with it can start at once."""
        with self._lock:
            return spec in self._compiled

    def compile_async(self, spec: GrammarSpec) -> Future:
        """Compile `spec` on the cache's thread (xgrammar releases the GIL while compiling), so the engine loop
        keeps stepping; one compile per distinct spec however many requests wait for it."""
        with self._lock:
            future = self._inflight.get(spec)
            if future is None:
                future = self._inflight[spec] = self._executor.submit(self._compile_and_store, spec)
            return future

    def _compile_and_store(self, spec: GrammarSpec) -> None:
        try:
            compiled: Any = self._compile(spec)
        except Exception as exc:  # xgrammar raises RuntimeError/ValueError with its parser's message
            compiled = InvalidRequestError(spec.field, f"cannot be compiled into a grammar: {_message(exc)}")
        with self._lock:
            self._store(spec, compiled)
            self._inflight.pop(spec, None)

    def _store(self, spec: GrammarSpec, compiled: Any) -> None:
        """Insert as most recent, then evict least recently used grammars past `limit_bytes` (the newest stays
        even if larger; matchers already built keep their grammar alive on their own)."""
        size = _grammar_bytes(spec, compiled)
        self._compiled[spec] = (compiled, size)
        self._compiled.move_to_end(spec)
        self.total_bytes += size
        while self.total_bytes > self.limit_bytes and len(self._compiled) > 1:
            old, (_, old_size) = self._compiled.popitem(last=False)
            self.total_bytes -= old_size
            for key in [k for k in self._empty if k[0] == old]:
                del self._empty[key]

    def compile(self, spec: GrammarSpec) -> Any:
        """The compiled grammar for `spec`, or InvalidRequestError naming its field. Cached either way (LRU)."""
        with self._lock:
            entry = self._compiled.get(spec)
            if entry is not None:
                self._compiled.move_to_end(spec)
        if entry is None:
            self.compile_async(spec).result()
            with self._lock:
                entry = self._compiled[spec]
        compiled = entry[0]
        if isinstance(compiled, InvalidRequestError):
            raise compiled
        return compiled

    def _compile(self, spec: GrammarSpec) -> Any:
        if spec.kind == "json_schema":
            return self.compiler.compile_json_schema(spec.source, any_whitespace=False, separators=JSON_SEPARATORS)
        if spec.kind == "json_object":  # any object: properties beyond the (empty) schema are allowed
            return self.compiler.compile_json_schema(spec.source, any_whitespace=False, separators=JSON_SEPARATORS,
                                                     strict_mode=False)
        if spec.kind == "regex":
            return self.compiler.compile_regex(spec.source)
        return self.compiler.compile_grammar(spec.source)

    def constraint(self, spec: GrammarSpec, stop_ids: Sequence[int]) -> Constraint:
        """A fresh matcher for one request. `stop_ids` are the tokens that end it (the engine's EOS ids
        unless the request has its own); empty means the request ignores EOS, so the grammar's stops are
        banned and the request ends when nothing else can follow or at max_tokens."""
        constraint = Constraint(self, spec, self.compile(spec), stop_ids)
        key = (spec, constraint.stop_ids)
        empty = self._empty.get(key)  # every fresh matcher of a grammar starts in the same state
        if empty is None:
            empty = self._empty[key] = constraint.only_stops_allowed()
        if empty:
            raise InvalidRequestError(spec.field, "matches only the empty string")
        return constraint

    def non_stop_words(self, stop_ids: frozenset[int]) -> np.ndarray:
        """Bitmask words with a bit for every token in the vocabulary that is not one of `stop_ids`."""
        words = self._non_stop.get(stop_ids)
        if words is None:
            allowed = np.ones(self.scratch.shape[1] * 32, dtype=bool)
            allowed[self.vocab_size:] = False
            allowed[list(stop_ids)] = False
            words = np.packbits(allowed, bitorder="little").view(np.int32)
            self._non_stop[stop_ids] = words
        return words


class Constraint:
    """One request's grammar state: its matcher, advanced by each sampled token (`advance`)."""

    def __init__(self, cache: GrammarCache, spec: GrammarSpec, compiled: Any, stop_ids: Sequence[int]) -> None:
        import xgrammar as xgr

        self.cache = cache
        self.spec = spec
        self.stop_ids = frozenset(stop_ids or cache.stop_ids)
        self.banned_ids = [] if stop_ids else list(cache.stop_ids)  # ignore_eos: the grammar may not stop
        self.matcher = xgr.GrammarMatcher(compiled, override_stop_tokens=sorted(self.stop_ids))
        self.rejected_token: int | None = None
        self.last_byte = -1  # of the output so far: restricts the next byte after some UTF-8 lead bytes

    @property
    def completed(self) -> bool:
        """The output so far is a complete match (a stop token may or may not have been accepted)."""
        return self.rejected_token is None and (self.matcher.is_terminated() or self.matcher.is_completed())

    @property
    def done(self) -> bool:
        """Nothing but a stop token can follow (or the grammar was broken): the sequence ends now."""
        return self.rejected_token is not None or self.matcher.is_terminated() or (
            self.matcher.is_completed() and self.only_stops_allowed())

    def only_stops_allowed(self) -> bool:
        """Asked only where the grammar is complete: at the end of a JSON value or choice, once; after every
        token of an open-ended match such as `\\d+`."""
        self.matcher.fill_next_token_bitmask(self.cache.scratch, 0)
        return not np.any(self.cache.scratch.numpy()[0] & self.cache.non_stop_words(self.stop_ids))

    def error(self) -> str | None:
        if self.rejected_token is None:
            return None
        return f"{self.spec.field}: the grammar rejected sampled token {self.rejected_token}"


def check_completion(structured: tuple[str, Any], text: str) -> tuple[Any, str | None]:
    """(parsed JSON value or None, None) if `text` satisfies the request's constraint in full, else (None,
    "<field>: why"): the JSON Schema of the declared draft (`jsonschema`), no repeated keys, strict JSON; a
    full regex match (Python `re`); one of the choices."""
    name, value = structured
    if name == "json_schema":
        parsed, error = completion_error(value, text)
    elif name == "json_object":
        parsed, error = completion_error({"type": "object"}, text)
    elif name == "regex":
        parsed, error = None, regex_error(value, text)
    else:
        parsed, error = None, None if text in value else f"{text!r} is not one of the choices"
    return (parsed, None) if error is None else (None, f"{name}: {error}")


def advance(constraints: Sequence[Constraint], token_ids: Sequence[int]) -> None:
    """Advance each matcher by its row's sampled token, all in one call into xgrammar. The mask makes a
    rejection impossible short of a bug; if one happens the request ends with an error, never off-grammar."""
    import xgrammar as xgr

    accepted = xgr.BatchGrammarMatcher.batch_accept_token([c.matcher for c in constraints], list(token_ids))
    for constraint, token_id, ok in zip(constraints, token_ids, accepted):
        if not ok and constraint.rejected_token is None:
            constraint.rejected_token = token_id
        if token_id < len(constraint.cache.last_byte) and constraint.cache.last_byte[token_id] >= 0:
            constraint.last_byte = constraint.cache.last_byte[token_id]


def apply_token_masks(logits: torch.Tensor, row_constraints: Sequence[Constraint | None]) -> torch.Tensor:
    """The sampler's hook: -inf on every token the grammar of a constrained row does not allow (one constraint
    or None per row of `logits`). Called before any other logits processing; rows without one are not touched."""
    indices = [i for i, constraint in enumerate(row_constraints) if constraint is not None]
    if not indices:
        return logits
    import xgrammar as xgr

    bitmask = xgr.allocate_token_bitmask(len(row_constraints), logits.shape[1])
    constraints: list[Constraint] = [row_constraints[i] for i in indices]  # type: ignore[misc]
    _batch_matcher().batch_fill_next_token_bitmask([c.matcher for c in constraints], bitmask, indices)
    for i, constraint in zip(indices, constraints):
        allowed = constraint.cache.after_lead.get(constraint.last_byte)
        if allowed is not None:
            bitmask[i] &= allowed
    xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device, non_blocking=True), indices=indices)
    return logits


@functools.cache
def _batch_matcher() -> Any:
    """xgrammar's batch filler: one call for all constrained rows (threads: half the cores, xgrammar's default)."""
    import xgrammar as xgr

    return xgr.BatchGrammarMatcher()


def _tokenizer_info(xgr: Any, tokenizer: Any, vocab_size: int, stop_ids: list[int]) -> tuple[Any, list[bytes]]:
    """xgrammar's view of the vocabulary (and its token bytes): special tokens are made unusable as text, and
    so are tokens that can never be part of valid UTF-8 (see `_utf8_invalid`)."""
    detected = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=stop_ids or None)
    special = set(getattr(tokenizer, "all_special_ids", [])) | set(stop_ids)
    vocab = [b"" if index in special or _utf8_invalid(token) else token for index, token in enumerate(detected.decoded_vocab)]
    info = xgr.TokenizerInfo(vocab, xgr.VocabType.RAW, vocab_size=vocab_size, stop_token_ids=stop_ids or None,
                             add_prefix_space=detected.add_prefix_space)
    return info, vocab


# xgrammar 0.2.9 decodes UTF-8 leniently: it accepts overlong forms (E0 80 AF for "/") and surrogates
# (ED A0 80), which Python decodes to U+FFFD, so the text would no longer be what the grammar matched (a
# maxLength would count three replacement characters). A real model practically never emits them, a random
# byte-level one does. RFC 3629: these bytes never occur, and after these lead bytes the next byte is
# restricted. Tokens holding a forbidden byte or pair are removed from the vocabulary; the pair across two
# tokens is masked in `apply_token_masks` from the row's last byte.
_NEVER_IN_UTF8 = frozenset([0xC0, 0xC1, *range(0xF5, 0x100)])
_AFTER_LEAD = {0xE0: range(0xA0, 0xC0), 0xED: range(0x80, 0xA0), 0xF0: range(0x90, 0xC0), 0xF4: range(0x80, 0x90)}


def _utf8_invalid(token: bytes) -> bool:
    return any(b in _NEVER_IN_UTF8 for b in token) or any(
        a in _AFTER_LEAD and b not in _AFTER_LEAD[a] for a, b in zip(token, token[1:]))


def _after_lead_words(vocab: list[bytes], words: int) -> dict[int, torch.Tensor]:
    """Per restricted lead byte: bitmask words of the tokens that may follow a text ending in that byte."""
    out = {}
    for lead, allowed_next in _AFTER_LEAD.items():
        allowed = np.zeros(words * 32, dtype=bool)
        allowed[[i for i, token in enumerate(vocab) if token and token[0] in allowed_next]] = True
        out[lead] = torch.from_numpy(np.packbits(allowed, bitorder="little").view(np.int32).copy())
    return out


def _lower_priority() -> None:
    """Compile threads yield the CPU to the engine loop: on Linux a thread has its own nice value (and the
    threads xgrammar starts from it inherit it). Measured (benchmarks/structured.py --bystander, 2 cores at load
    ~8.5): an 8-token bystander beside a 20,000-choice compile took 5.5x its time alone without this, 2.4-2.6x
    with it and one compiler thread. Elsewhere a no-op."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    except (AttributeError, OSError):
        pass


def _grammar_bytes(spec: GrammarSpec, compiled: Any) -> int:
    """What a cache entry holds: xgrammar's own figure for a grammar, the source text for a cached error."""
    size = getattr(compiled, "memory_size_bytes", None)
    return int(size) if isinstance(size, int) else len(spec.source)


def _message(exc: BaseException) -> str:
    """xgrammar's message without its C++ log prefix ("[time] file.cc:line: ")."""
    lines = [line for line in str(exc).splitlines() if line.strip()]
    last = lines[-1] if lines else type(exc).__name__
    return last.split(": ", 1)[1] if last.startswith("[") and ": " in last else last
