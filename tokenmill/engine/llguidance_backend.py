"""The llguidance grammar backend: compiling a `GrammarSpec` into an llguidance matcher and filling its token masks.

llguidance (the library behind vLLM's `guidance` backend) computes masks lazily from a byte-level lexer and an
Earley parser, so compiling a JSON schema takes a fraction of a millisecond where xgrammar precomputes its
token tables for milliseconds to seconds. Its masks have xgrammar's layout (int32 words, bit `i % 32` of word
`i // 32` for token `i`), so both backends fill rows of one bitmask and the sampler applies it once.

* The tokenizer bridge is llguidance's own (`llguidance.hf.from_tokenizer`, fast tokenizers only): special
  tokens are never text, and the lexer only ever produces valid UTF-8.
* A compiled grammar is a fresh matcher; each request gets a `deep_copy` of it (cheap: the grammar is shared).
* Strict mode: a schema keyword llguidance does not implement, or a format it does not know, is an error
  (never ignored), so a grammar that validates enforces its schema in full.
* EOS: the matcher allows the engine's EOS ids where the grammar may end. A request's own stop tokens are
  added there, and EOS ids it does not stop on are removed (see `Constraint`), as xgrammar's override does.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import torch

from tokenmill.errors import InvalidRequestError

#: JSON exactly as the xgrammar path writes it: compact, no free whitespace.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":", "lenient": False}


class LLGuidanceVocab:
    """The engine tokenizer as llguidance sees it (built once per engine: slow for a large vocabulary)."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_ids: Sequence[int]) -> None:
        import llguidance.hf

        if not hasattr(tokenizer, "backend_tokenizer"):
            raise InvalidRequestError("constraint_backend", "llguidance needs a fast (tokenizers) tokenizer")
        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=list(stop_ids) or None)
        self.vocab_size = vocab_size

    def compile(self, field: str, kind: str, source: str) -> Any:
        """A fresh matcher for the grammar, or InvalidRequestError naming `field` with llguidance's message."""
        import llguidance as llg

        grammar = _grammar(kind, source)
        failed, messages = llg.LLMatcher.validate_grammar_with_warnings(grammar, self.tokenizer)
        if failed or messages:  # warnings are keywords or formats it would ignore: not enforced in full
            raise InvalidRequestError(field, "; ".join(m.strip().splitlines()[0] for m in messages))
        matcher = llg.LLMatcher(self.tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise InvalidRequestError(field, matcher.get_error())
        return matcher


def _grammar(kind: str, source: str) -> str:
    import llguidance as llg

    if kind in ("json_schema", "json_object"):
        return llg.LLMatcher.grammar_from_json_schema(source, defaults=JSON_OPTIONS)
    if kind == "regex":  # \\d and \\w as ASCII (ECMA-262, and a subset of Python's): llguidance's are Unicode
        return llg.LLMatcher.grammar_from_regex(llg.regex_to_lark(source, "dw"))
    # A choice: "root ::= <JSON string> | ...", whose literals Lark's string syntax shares.
    return llg.LLMatcher.grammar_from_lark("start: " + source.removeprefix("root ::= "))


def fill_masks(matchers: Sequence[Any], bitmask: torch.Tensor, indices: Sequence[int]) -> None:
    """Fill `bitmask[indices[k]]` from `matchers[k]`, all rows in one call on llguidance's thread pool."""
    import llguidance.torch as lt

    lt.fill_next_token_bitmask_par(_executor(), list(zip(matchers, indices)), bitmask)


def fill_one(matcher: Any, bitmask: torch.Tensor, index: int) -> None:
    import llguidance.torch as lt

    lt.fill_next_token_bitmask(matcher, bitmask, index)


def consume(matchers: Sequence[Any], token_ids: Sequence[int]) -> list[bool]:
    """Advance each matcher by its token in one call; False where a matcher rejected it."""
    import llguidance.torch as lt

    return lt.consume_token_par(_executor(), list(zip(matchers, token_ids)))


@functools.cache
def _executor() -> Any:
    """llguidance's thread pool for batched masks: at most two threads (the engine loop shares a few cores)."""
    import llguidance as llg

    return llg.LLExecutor(num_threads=2)
