"""The longest text prompt worth tokenizing: checked on every path into the engine, before the tokenizer runs.

Tokenizing a huge text takes seconds and gigabytes only to refuse the prompt for `max_model_len`; counting its
characters takes microseconds. The worker checks in its own process too (it tokenizes text prompts there), with
the limit the engine process reports, so both refuse the same prompts with the same message.
"""

from __future__ import annotations

import json
from typing import Any

from tokenmill.errors import InvalidRequestError


def check_prompt_chars(prompt: Any, max_chars: int | None, max_model_len: int) -> None:
    """Refuse, before tokenizing it, a prompt with more characters than `max_model_len` tokens can cover
    (`max_prompt_chars`): tokenizing 1 MB of text takes seconds."""
    if max_chars is not None and isinstance(prompt, str) and len(prompt) > max_chars:
        raise InvalidRequestError("prompt", f"{len(prompt)} characters cannot fit in max_model_len "
                                            f"({max_model_len} tokens, at most {max_chars} characters)")


#: Pre-tokenizers that keep every character of the text (splitting only), as `tokenizers` serialises them.
_KEEPING_PRE_TOKENIZERS = {"ByteLevel", "Split", "Digits", "Punctuation"}


def max_prompt_chars(tokenizer: Any, max_model_len: int) -> int | None:
    """The most characters a prompt of `max_model_len` tokens can have, or None where that cannot be bounded.

    Bounded for byte-level BPE tokenizers (GPT-2, Llama 3, Qwen, the built-in tiny model) with no
    normalizer: each token's vocabulary string then has one character per byte it covers, and a character
    is at least one byte, so no token covers more characters than the longest vocabulary string (added
    tokens are matched literally: the same holds). A normalizer or a pre-tokenizer that drops text
    (BERT's whitespace split, `behavior="removed"`) could shrink the text, so those get no bound.
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    spec = json.loads(backend.to_str())
    pre = spec.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre]
    keeps = all(step.get("type") in _KEEPING_PRE_TOKENIZERS and step.get("behavior") != "Removed" for step in steps)
    if spec.get("normalizer") is not None or not keeps or not any(step.get("type") == "ByteLevel" for step in steps):
        return None
    return max_model_len * max(len(token) for token in tokenizer.get_vocab())
