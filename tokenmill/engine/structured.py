"""Structured outputs: grammar-constrained decoding with xgrammar or llguidance.

A request with `json_schema`, `choice`, `regex` or `json_object` gets a `Constraint`: a matcher over a grammar
compiled once per engine (`GrammarCache`) by one of two backends, chosen per request (`constraint_backend`,
default "auto": the first of `AUTO_ORDER` that enforces the constraint in full; recorded in the output). Each
step the sampler asks the constrained rows, and only those, for a token bitmask (both backends fill rows of one
bitmask, the same layout) and sets every other logit to -inf before any sampling filter (`mask_logits`; a row
whose mask allows few tokens is instead sampled from the list of them, with the same result), so greedy, seeds,
penalties, top-k/p and min-p all act on the allowed tokens only; the engine then advances the matchers with the
sampled tokens. Unconstrained rows pay a list scan, nothing more.

Decisions:
* JSON is compact (no free whitespace, separators "," and ":"), with both backends: a weak or random model
  cannot spend its `max_tokens` on whitespace. (llguidance admits number spellings such as `-0` and `1E2`.)
* `choice` is an EBNF alternation of the literal strings (JSON string escaping, which xgrammar's EBNF
  literals share), so any character in a choice is matched literally.
* A sequence finishes as soon as the grammar is complete and only a stop token could follow (the
  closing brace of an object, the last character of a choice): the step that would only sample EOS is
  saved. Where the grammar could go on (`\\d+`), the model decides between more and a stop token.
* Special tokens (BOS, PAD, ...) are removed from the grammar's vocabulary: xgrammar would otherwise
  treat "<s>" as the text "<s>", which decoding with `skip_special_tokens` drops, and the text would no
  longer match the grammar.
* A JSON schema reaches a backend only as `tokenmill.schema_support.prepare` rewrote it: a core subset xgrammar
  0.2.9 enforces in full, except a pattern beside a length bound and patternProperties, which only llguidance does
  (`xgrammar_gap`) (what it would ignore is merged, rewritten or refused before generation; length
  bounds become patterns, mlc-ai/xgrammar#800). Byte tokens are kept to valid UTF-8 (`_utf8_invalid`,
  `_AFTER_LEAD`).
* Every completed output is checked after decoding (`check_completion`): the last line of defence. An output
  that fails is reported unsatisfied with the reason, never passed off as valid.
* Compiling happens on the cache's threads, off the engine loop: a request whose grammar is new waits (not in
  the scheduler) while the others keep stepping, and fails naming its field past the engine's
  `grammar_compile_timeout`. Grammars are cached by their text, LRU-bounded by bytes (`grammar_cache_bytes`):
  in a batch job one schema serves the whole dataset. Compile errors are cached too, so a bad schema repeated
  in every job is rejected at dict-lookup cost.
* No repeated key in a JSON object: neither backend forbids one, so the mask does (`json_keys.KeyTracker`).

xgrammar and llguidance are imported on first use, so an engine that never sees a structured request loads
neither.
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

from tokenmill.engine import llguidance_backend as llg_backend
from tokenmill.engine.config import CONSTRAINT_BACKENDS
from tokenmill.engine.json_keys import KeyTracker, TokenPrefixes
from tokenmill.errors import InvalidRequestError
from tokenmill.schema_support import completion_error, prepare, regex_error, xgrammar_gap

if TYPE_CHECKING:
    from tokenmill.sampling_params import SamplingParams

#: Compact JSON separators (item, key), as `json.dumps(separators=...)`.
JSON_SEPARATORS = (",", ":")
# xgrammar first: its masks are precomputed per grammar state, llguidance's computed per step (a slower fill each
# step; `benchmarks/structured.py --backends`), and in a batch job one compile serves the whole dataset. llguidance
# compiles far faster, which pays only for a schema used for a few hundred row-steps or less.
# llguidance where xgrammar cannot enforce the constraint in full: a pattern beside minLength/maxLength,
# patternProperties (`xgrammar_gap`), or what xgrammar fails to compile.
AUTO_ORDER = ("xgrammar", "llguidance")


@dataclass(frozen=True)
class Compiled:
    """A grammar compiled by one backend: an xgrammar CompiledGrammar or an llguidance matcher to copy."""

    backend: str
    grammar: Any


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
        # One C-speed dump of the whole list instead of one per choice (a long list's dumps would hold
        # the engine loop's `add_request`). JSON escapes every control character inside a string, so a newline as
        # the element separator occurs only between elements: the result is the choices' own dumps joined by
        # " | ". (`", "` as the separator was not: it is also the whole dump of the choice ", ".)
        dumped = json.dumps(list(dict.fromkeys(value)), ensure_ascii=False, separators=("\n", ":"))
        alternatives = dumped[1:-1].replace("\n", " | ")
        return cls(name, "ebnf", f"root ::= {alternatives}")

    @property
    def is_json(self) -> bool:
        return self.kind in ("json_schema", "json_object")


class GrammarCache:
    """One per engine: the tokenizer's vocabulary as each backend sees it, xgrammar's compiler, compiled grammars."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_ids: Sequence[int], limit_bytes: int = 512 << 20,
                 backend: str = "auto") -> None:
        import xgrammar as xgr

        if backend not in CONSTRAINT_BACKENDS:
            raise ValueError(f"constraint_backend: must be one of {', '.join(CONSTRAINT_BACKENDS)}, got {backend!r}")
        self.backend = backend
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_ids = sorted(stop_ids)
        self.info, self.vocab = _tokenizer_info(xgr, tokenizer, vocab_size, self.stop_ids)
        # xgrammar's own cache is unbounded (a few dozen long choice lists fill gigabytes): ours is LRU by bytes.
        # One compiler thread per compile: on few cores more only compete with the engine loop.
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=1, cache_enabled=False)
        self.limit_bytes, self.total_bytes = limit_bytes, 0
        self._lock = threading.Lock()
        self._executor = ThreadPoolExecutor(max_workers=2, thread_name_prefix="grammar-compile", initializer=_lower_priority)
        self._inflight: dict[GrammarSpec, Future] = {}
        self.scratch = xgr.allocate_token_bitmask(1, vocab_size)  # for completion checks (one thread owns the engine)
        self.after_lead = _after_lead_words(self.vocab, self.scratch.shape[1])
        self.prefixes = TokenPrefixes(self.vocab)  # for repeated-key masks
        self._compiled: OrderedDict[GrammarSpec, tuple[Any, int]] = OrderedDict()  # spec -> (Compiled or error, bytes)
        self._empty: dict[tuple[GrammarSpec, frozenset[int]], bool] = {}
        self._words: dict[frozenset[int], torch.Tensor] = {}
        self._non_stop: dict[frozenset[int], np.ndarray] = {}
        self._llg: llg_backend.LLGuidanceVocab | InvalidRequestError | None = None
        self._llg_lock = threading.Lock()  # not `_lock`: building it takes up to a second, the engine loop needs that

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
        except InvalidRequestError as exc:
            compiled = exc
        except Exception as exc:  # a backend's own failure: the request's, named, not the engine's
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

    def _compile(self, spec: GrammarSpec) -> Compiled:
        """The first backend (the forced one, or `AUTO_ORDER`) that enforces `spec` in full; else the reasons."""
        order = AUTO_ORDER if self.backend == "auto" else (self.backend,)
        reasons = []
        for backend in order:
            try:
                return Compiled(backend, getattr(self, f"_compile_{backend}")(spec))
            except InvalidRequestError as exc:
                reasons.append(f"{backend}: {exc.message}")
            except (RuntimeError, ValueError) as exc:  # xgrammar's parser messages
                reasons.append(f"{backend}: {_message(exc)}")
        raise InvalidRequestError(spec.field, "cannot be compiled into a grammar: " + "; ".join(reasons))

    def _compile_xgrammar(self, spec: GrammarSpec) -> Any:
        if spec.kind == "json_schema":
            gap = xgrammar_gap(json.loads(spec.source))
            if gap is not None:
                raise InvalidRequestError(spec.field, gap)
            return self.compiler.compile_json_schema(spec.source, any_whitespace=False, separators=JSON_SEPARATORS)
        if spec.kind == "json_object":  # any object: properties beyond the (empty) schema are allowed
            return self.compiler.compile_json_schema(spec.source, any_whitespace=False, separators=JSON_SEPARATORS,
                                                     strict_mode=False)
        if spec.kind == "regex":
            return self.compiler.compile_regex(spec.source)
        return self.compiler.compile_grammar(spec.source)

    def _compile_llguidance(self, spec: GrammarSpec) -> Any:
        return self.llguidance_vocab().compile(spec.field, spec.kind, spec.source)

    def llguidance_vocab(self) -> llg_backend.LLGuidanceVocab:
        """llguidance's view of the tokenizer, built on first use (InvalidRequestError if it cannot be)."""
        with self._llg_lock:
            if self._llg is None:
                try:
                    self._llg = llg_backend.LLGuidanceVocab(self.tokenizer, self.vocab_size, self.stop_ids)
                except ImportError as exc:
                    self._llg = InvalidRequestError("constraint_backend", f"llguidance is not installed ({exc})")
                except InvalidRequestError as exc:
                    self._llg = exc
            if isinstance(self._llg, InvalidRequestError):
                raise self._llg
            return self._llg

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
            words = self._non_stop[stop_ids] = _packed_words(allowed).numpy()
        return words

    def words(self, ids: frozenset[int]) -> torch.Tensor:
        """Bitmask words with a bit for each token of `ids` (cached: one set per stop-token set)."""
        words = self._words.get(ids)
        if words is None:
            allowed = np.zeros(self.scratch.shape[1] * 32, dtype=bool)
            allowed[list(ids)] = True
            words = self._words[ids] = _packed_words(allowed)
        return words


class Constraint:
    """One request's grammar state: its matcher (xgrammar's or llguidance's), advanced by each sampled token
    (`advance`), and for JSON the keys written so far (`KeyTracker`)."""

    def __init__(self, cache: GrammarCache, spec: GrammarSpec, compiled: Compiled, stop_ids: Sequence[int]) -> None:
        self.cache = cache
        self.spec = spec
        self.backend = compiled.backend
        self.stop_ids = frozenset(stop_ids or cache.stop_ids)
        self.banned_ids = [] if stop_ids else list(cache.stop_ids)  # ignore_eos: the grammar may not stop
        if self.backend == "xgrammar":
            import xgrammar as xgr

            self.matcher = xgr.GrammarMatcher(compiled.grammar, override_stop_tokens=sorted(self.stop_ids))
        else:
            self.matcher = compiled.grammar.deep_copy()
            # llguidance allows the engine's EOS ids where the grammar may end: swap in this request's stops, which
            # are then allowed only there (a stop that is also text, such as "5", may not end a match mid-way).
            engine_eos = frozenset(cache.stop_ids)
            self.stop_fix = None if self.stop_ids == engine_eos else (
                ~cache.words(engine_eos | self.stop_ids), cache.words(self.stop_ids))
        self.stopped = False  # llguidance: a stop token was sampled (it is not fed to the matcher)
        self.keys = KeyTracker() if spec.is_json else None
        self.rejected_token: int | None = None
        self.last_byte = -1  # of the output so far: restricts the next byte after some UTF-8 lead bytes

    @property
    def completed(self) -> bool:
        """The output so far is a complete match (a stop token may or may not have been accepted)."""
        if self.rejected_token is not None:
            return False
        if self.backend == "xgrammar":
            return self.matcher.is_terminated() or self.matcher.is_completed()
        return self.stopped or self.matcher.is_accepting()

    @property
    def done(self) -> bool:
        """Nothing but a stop token can follow (or the grammar was broken): the sequence ends now."""
        if self.rejected_token is not None:
            return True
        if self.backend == "xgrammar":
            return self.matcher.is_terminated() or (self.matcher.is_completed() and self.only_stops_allowed())
        return self.stopped or self.matcher.is_error() or self.matcher.is_stopped() or (
            self.matcher.is_accepting() and self.only_stops_allowed())

    def only_stops_allowed(self) -> bool:
        """Asked only where the grammar is complete: at the end of a JSON value or choice, once; after every
        token of an open-ended match such as `\\d+`."""
        if self.backend == "xgrammar":
            self.matcher.fill_next_token_bitmask(self.cache.scratch, 0)
        else:
            llg_backend.fill_one(self.matcher, self.cache.scratch, 0)
        self.adjust(self.cache.scratch, 0)
        return not np.any(self.cache.scratch.numpy()[0] & self.cache.non_stop_words(self.stop_ids))

    def adjust(self, bitmask: torch.Tensor, row: int) -> None:
        """What the backend's mask of `row` lacks: UTF-8 continuation rules (xgrammar), this request's stop
        tokens (llguidance), no repeated object key (both)."""
        if self.backend == "xgrammar":
            allowed = self.cache.after_lead.get(self.last_byte)
            if allowed is not None:
                bitmask[row] &= allowed
        elif self.stop_fix is not None:
            keep, stops = self.stop_fix
            ending = self.matcher.is_accepting()
            bitmask[row] &= keep
            if ending:
                bitmask[row] |= stops
        if self.keys is not None:
            repeats = self.keys.closing_repeats(self.cache.prefixes)
            if repeats:
                _ban(bitmask, row, repeats)

    def error(self) -> str | None:
        if self.rejected_token is not None:
            return f"{self.spec.field}: the grammar rejected sampled token {self.rejected_token}"
        if self.backend == "llguidance" and self.matcher.is_error():
            return f"{self.spec.field}: {self.matcher.get_error()}"
        return None


def _ban(bitmask: torch.Tensor, row: int, token_ids: list[int]) -> None:
    """Clear the bits of `token_ids` in `bitmask[row]`, unless that leaves no token allowed (then the final
    check decides, rather than a row with nothing to sample)."""
    words = bitmask[row].numpy()
    before = words.copy()
    ids = np.asarray(token_ids)
    np.bitwise_and.at(words, ids >> 5, ~(np.int32(1) << (ids & 31)).astype(np.int32))
    if not words.any():
        words[:] = before


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
    """Advance each matcher by its row's sampled token, one batched call per backend. The mask makes a rejection
    impossible short of a bug; if one happens the request ends with an error, never off-grammar."""
    live = []
    for constraint, token_id in zip(constraints, token_ids):
        if constraint.backend == "llguidance" and token_id in constraint.stop_ids:
            # The mask allowed a stop token only where the grammar may end; the matcher, which knows only the
            # engine's EOS ids, is not asked about this request's own.
            constraint.stopped = True
        else:
            live.append((constraint, token_id))
    for backend, batch in _by_backend(live).items():
        matchers, tokens = [c.matcher for c, _ in batch], [t for _, t in batch]
        if backend == "xgrammar":
            import xgrammar as xgr

            accepted = xgr.BatchGrammarMatcher.batch_accept_token(matchers, tokens)
        else:
            accepted = llg_backend.consume(matchers, tokens)
        for (constraint, token_id), ok in zip(batch, accepted):
            if not ok and constraint.rejected_token is None:
                constraint.rejected_token = token_id
    for constraint, token_id in zip(constraints, token_ids):
        if token_id < len(constraint.cache.vocab):
            token = constraint.cache.vocab[token_id]
            if token:
                constraint.last_byte = token[-1]
                if constraint.keys is not None:
                    constraint.keys.feed(token)


def _by_backend(pairs: Any) -> dict[str, list[tuple[Constraint, Any]]]:
    groups: dict[str, list[tuple[Constraint, Any]]] = {}
    for constraint, value in pairs:
        groups.setdefault(constraint.backend, []).append((constraint, value))
    return groups


def apply_token_masks(logits: torch.Tensor, row_constraints: Sequence[Constraint | None]) -> torch.Tensor:
    """-inf on every token the grammar of a constrained row does not allow (one constraint or None per row of
    `logits`); rows without one are not touched."""
    mask_logits(logits, row_constraints, [False] * len(row_constraints))
    return logits


@dataclass
class AllowedTokens:
    """The allowed tokens of rows whose masks allow few: row `rows[k]` may take `token_ids[k, j]` where
    `valid[k, j]` (ascending, then padding)."""

    rows: list[int]
    token_ids: torch.Tensor  # [len(rows), most allowed] int64
    valid: torch.Tensor  # same shape, bool


#: A row whose mask has at most this many nonzero 32-bit words (so at most 32x as many allowed tokens) is listed
#: instead of masked, when the sampler can take it from the list. On a typical schema most row-steps allow
#: only a few tokens: sampling among them skips the full-vocabulary noise.
LISTED_WORDS = 16


def mask_logits(logits: torch.Tensor, row_constraints: Sequence[Constraint | None],
                listable: Sequence[bool]) -> AllowedTokens | None:
    """The sampler's hook, called before any other logits processing. Each constrained row either gets -inf on
    every token its grammar does not allow, or, where `listable[row]` and its mask allows few tokens (CPU
    only: on a GPU finding them costs device syncs and the dense pass is cheap), is left as it is and listed
    in the returned `AllowedTokens`, from which the sampler must take its token."""
    indices = [i for i, c in enumerate(row_constraints) if c is not None]
    if not indices:
        return None
    bitmask = fill_bitmask(logits, row_constraints)
    candidates = [i for i in indices if listable[i]] if logits.device.type == "cpu" else []
    allowed = _allowed_tokens(bitmask, candidates, logits.shape[1]) if candidates else None
    if allowed is not None:
        listed = set(allowed.rows)
        indices = [i for i in indices if i not in listed]
    if indices:
        apply_bitmask(logits, bitmask, indices)
    return allowed


_BIT = torch.arange(32, dtype=torch.int32)


def _allowed_tokens(bitmask: torch.Tensor, rows: list[int], vocab: int) -> AllowedTokens | None:
    """The allowed tokens of those of `rows` whose masks have 1 to `LISTED_WORDS` nonzero words."""
    words = bitmask.index_select(0, torch.tensor(rows, dtype=torch.int64))[:, : (vocab + 31) // 32]
    if vocab % 32:  # bits past the vocabulary are no tokens
        words[:, -1] &= (1 << (vocab % 32)) - 1
    nonzero = words != 0
    per_row = nonzero.sum(dim=1)
    picked = ((per_row > 0) & (per_row <= LISTED_WORDS)).nonzero()[:, 0]
    if not len(picked):
        return None
    row, word = nonzero.index_select(0, picked).nonzero(as_tuple=True)  # row-major: words ascending per row
    bits = ((words.index_select(0, picked)[row, word][:, None] >> _BIT) & 1).bool()  # [words, 32]
    row_of = row[:, None].expand_as(bits)[bits]
    token = (word[:, None] * 32 + _BIT)[bits]
    counts = torch.bincount(row_of, minlength=len(picked))
    column = torch.arange(len(token)) - (torch.cumsum(counts, 0) - counts)[row_of]
    token_ids = torch.zeros(len(picked), int(counts.max()), dtype=torch.int64)
    valid = torch.zeros(token_ids.shape, dtype=torch.bool)
    token_ids[row_of, column] = token
    valid[row_of, column] = True
    return AllowedTokens([rows[k] for k in picked.tolist()], token_ids, valid)


def fill_bitmask(logits: torch.Tensor, row_constraints: Sequence[Constraint | None]) -> torch.Tensor:
    """One bitmask for the batch: each backend fills its rows in one batched call (the layout is shared), then
    each row gets what its backend lacks (`Constraint.adjust`)."""
    import xgrammar as xgr

    rows = [(c, i) for i, c in enumerate(row_constraints) if c is not None]
    bitmask = xgr.allocate_token_bitmask(len(row_constraints), logits.shape[1])
    for backend, pairs in _by_backend(rows).items():
        matchers, indices = [c.matcher for c, _ in pairs], [i for _, i in pairs]
        if backend == "xgrammar":
            _batch_matcher().batch_fill_next_token_bitmask(matchers, bitmask, indices)
        else:
            llg_backend.fill_masks(matchers, bitmask, indices)
    for constraint, i in rows:
        constraint.adjust(bitmask, i)
    return bitmask


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, indices: list[int]) -> None:
    """-inf on the tokens whose bit is 0, in the rows `indices` (in place).

    On CPU as a bias: each byte of the bitmask selects its 8 biases (0 or -inf) from a 256 x 8 table, and the
    biases are added to the logits: several times faster than xgrammar's CPU kernel, which tests bit by bit.
    On a GPU, xgrammar's kernel."""
    if logits.device.type != "cpu":
        import xgrammar as xgr

        xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device, non_blocking=True), indices=indices)
        return
    rows, vocab = logits.shape
    codes = bitmask.view(torch.uint8)  # little-endian: byte j of word w holds tokens 32w + 8j .. 32w + 8j + 7
    biases = _byte_biases(logits.dtype)
    index = None if len(indices) == rows else torch.tensor(indices, dtype=torch.int64)
    if index is not None:
        codes = codes.index_select(0, index)
    step = max(1, (1 << 20) // vocab)  # rows at a time: a 4 MiB bias, reused from the allocator's free list
    for a in range(0, len(codes), step):
        bias = torch.index_select(biases, 0, codes[a : a + step].reshape(-1).int()).view(-1, codes.shape[1] * 8)
        if index is None:
            logits[a : a + step].add_(bias[:, :vocab])
        else:
            logits.index_add_(0, index[a : a + step], bias[:, :vocab])


@functools.cache
def _byte_biases(dtype: torch.dtype) -> torch.Tensor:
    """[256, 8]: for each byte value, 0 for each set bit (lowest first) and -inf for each clear one."""
    bits = (torch.arange(256)[:, None] >> torch.arange(8)[None, :]) & 1
    return torch.zeros(256, 8, dtype=dtype).masked_fill_(bits == 0, float("-inf"))


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
# tokens is masked in `Constraint.adjust` from the row's last byte.
_NEVER_IN_UTF8 = frozenset([0xC0, 0xC1, *range(0xF5, 0x100)])
_AFTER_LEAD = {0xE0: range(0xA0, 0xC0), 0xED: range(0x80, 0xA0), 0xF0: range(0x90, 0xC0), 0xF4: range(0x80, 0x90)}


def _utf8_invalid(token: bytes) -> bool:
    return any(b in _NEVER_IN_UTF8 for b in token) or any(
        a in _AFTER_LEAD and b not in _AFTER_LEAD[a] for a, b in zip(token, token[1:]))


def _packed_words(allowed: np.ndarray) -> torch.Tensor:
    """Bitmask words (int32, token t at bit t % 32 of word t // 32, as the backends fill them) of a bool per token."""
    return torch.from_numpy(np.packbits(allowed, bitorder="little").view(np.int32).copy())


def _after_lead_words(vocab: list[bytes], words: int) -> dict[int, torch.Tensor]:
    """Per restricted lead byte: bitmask words of the tokens that may follow a text ending in that byte."""
    out = {}
    for lead, allowed_next in _AFTER_LEAD.items():
        allowed = np.zeros(words * 32, dtype=bool)
        allowed[[i for i, token in enumerate(vocab) if token and token[0] in allowed_next]] = True
        out[lead] = _packed_words(allowed)
    return out


def _lower_priority() -> None:
    """Compile threads yield the CPU to the engine loop: on Linux a thread has its own nice value (and the
    threads xgrammar starts from it inherit it). With it and one compiler thread, a short job beside a large compile
    is slowed about half as much (`benchmarks/structured.py --bystander`). Elsewhere a no-op."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    except (AttributeError, OSError):
        pass


def _grammar_bytes(spec: GrammarSpec, compiled: Any) -> int:
    """What a cache entry holds: xgrammar's own figure for a grammar; for llguidance (which gives none: its grammar
    is built lazily) and a cached error, a multiple of the source text."""
    size = getattr(getattr(compiled, "grammar", None), "memory_size_bytes", None)
    return int(size) if isinstance(size, int) else 4 * len(spec.source)


def _message(exc: BaseException) -> str:
    """xgrammar's message without its C++ log prefix ("[time] file.cc:line: ")."""
    lines = [line for line in str(exc).splitlines() if line.strip()]
    last = lines[-1] if lines else type(exc).__name__
    return last.split(": ", 1)[1] if last.startswith("[") and ": " in last else last
