"""The engine's text decoding equals the tokenizer's `decode`, and skips transformers only where transformers would
add nothing to the `tokenizers` backend's own decode."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from subword_model import subword_tokenizer
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from tokenmill.engine.detokenize import text_decoder
from tokenmill.engine.tiny import tiny_tokenizer

TOKENIZERS = {"tiny": tiny_tokenizer(), "subword": subword_tokenizer()}


@settings(max_examples=200, deadline=None)
@given(name=st.sampled_from(sorted(TOKENIZERS)), data=st.data(), skip=st.booleans())
def test_decoding_equals_the_tokenizers_decode(name: str, data: st.DataObject, skip: bool) -> None:
    tokenizer = TOKENIZERS[name]
    ids = data.draw(st.lists(st.integers(0, len(tokenizer) - 1), max_size=40))  # special tokens and byte pieces too
    assert text_decoder(tokenizer)(ids, skip) == tokenizer.decode(ids, skip_special_tokens=skip)


@pytest.mark.parametrize("name", sorted(TOKENIZERS))
def test_the_backend_decodes_where_transformers_adds_nothing(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    tokenizer = TOKENIZERS[name]
    expected = tokenizer.decode([5, 6, 7], skip_special_tokens=True)
    decode = text_decoder(tokenizer)
    monkeypatch.setattr(tokenizer, "decode", lambda *args, **kwargs: pytest.fail("decoded through transformers"))
    assert decode([5, 6, 7], True) == expected


class _Rewriting(PreTrainedTokenizerFast):
    def decode(self, token_ids, skip_special_tokens=False, **kwargs):  # noqa: ANN001, ANN003, ANN201
        return "rewritten:" + super().decode(token_ids, skip_special_tokens=skip_special_tokens, **kwargs)


def test_other_tokenizers_decode_through_transformers() -> None:
    words = Tokenizer(models.WordLevel({"[UNK]": 0, "a": 1, ",": 2, "b": 3, ".": 4}, unk_token="[UNK]"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    cleaning = PreTrainedTokenizerFast(tokenizer_object=words, clean_up_tokenization_spaces=True)
    ids = cleaning.encode("a, b.", add_special_tokens=False)
    assert words.decode(ids) == "a , b ." and cleaning.decode(ids) == "a, b."  # transformers cleans up after it
    assert text_decoder(cleaning)(ids, False) == "a, b."
    backend = subword_tokenizer().backend_tokenizer
    rewriting = _Rewriting(tokenizer_object=backend)
    assert text_decoder(rewriting)([5, 6], False) == rewriting.decode([5, 6]) == "rewritten:" + backend.decode([5, 6])
