"""Token ids to text, as the model's tokenizer decodes them, without transformers' per-call walk of the ids.

Why: `PreTrainedTokenizerBase.decode` first converts its input to Python objects (`to_py_obj`), which checks every
id in Python, then calls the `tokenizers` backend. For a list of ints that walk is pure overhead, a large share of
the whole decode whatever the length. The engine decodes each request's text when it ends, and a request
with stop strings every step (`StopMatcher`), all on the engine loop between forward passes.

The backend is called directly only where that is what transformers itself would run: a `PreTrainedTokenizerFast`
(a `tokenizers`-backed tokenizer) whose class and instance override neither `decode` nor `_decode` and that does not
clean up tokenization spaces (the one step transformers adds after the backend). Any other tokenizer decodes through
transformers.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from transformers import PreTrainedTokenizerFast

Decoder = Callable[[list[int], bool], str]


def text_decoder(tokenizer: Any) -> Decoder:
    """`decode(ids, skip_special_tokens)`, equal to `tokenizer.decode(ids, skip_special_tokens=...)` for a list of
    ints."""
    if isinstance(tokenizer, PreTrainedTokenizerFast) and not tokenizer.clean_up_tokenization_spaces:
        classes = type(tokenizer).__mro__
        own = [vars(tokenizer), *map(vars, classes[: classes.index(PreTrainedTokenizerFast)])]
        if not any("decode" in names or "_decode" in names for names in own):  # transformers' decode, as it is
            backend = tokenizer.backend_tokenizer
            return lambda ids, skip_special_tokens: backend.decode(ids, skip_special_tokens=skip_special_tokens)
    return lambda ids, skip_special_tokens: tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


def token_texts(tokenizer: Any, decode: Decoder, ids: list[int]) -> dict[int, list[Any]]:
    """Each id's `[text, bytes]`, the one rule for a token shown alone (logprobs). Its text is `decode` of it alone
    (special tokens shown; U+FFFD for part of a UTF-8 character). Its bytes are its own: a byte-level BPE token's
    from its vocabulary string, a `<0xNN>` byte fallback token's byte, any other token's (an added one's too) its
    text in UTF-8. An id the tokenizer does not know (a vocabulary padded past it) is "" with no bytes."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
    byte_of = {c: b for b, c in bytes_to_unicode().items()} if type(decoder).__name__ == "ByteLevel" else {}
    added = set(getattr(tokenizer, "added_tokens_decoder", {}))
    texts: dict[int, list[Any]] = {}
    for token_id, piece in zip(ids, tokenizer.convert_ids_to_tokens(ids)):
        text = "" if piece is None else decode([token_id], False)
        if piece is None:
            raw: list[int] = []
        elif token_id in added:
            raw = list(text.encode())
        elif byte_of and all(c in byte_of for c in piece):
            raw = [byte_of[c] for c in piece]
        elif not byte_of and _BYTE_FALLBACK.fullmatch(piece):
            raw = [int(piece[3:5], 16)]
        else:
            raw = list(text.encode())
        texts[token_id] = [text, raw]
    return texts


_BYTE_FALLBACK = re.compile(r"<0x[0-9A-Fa-f]{2}>")
