"""Text prompts are tokenized in the worker process with the engine's own tokenizer, loaded through the
`tokenizers` library alone: the ids must be exactly those the engine would have made, and a tokenizer the
worker cannot reproduce must leave tokenizing to the engine."""

from __future__ import annotations

import multiprocessing
import os
import signal
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from subword_model import subword_tokenizer

from tokenmill import LLM
from tokenmill.engine.tiny import tiny_tokenizer
from tokenmill.errors import InvalidRequestError
from tokenmill.sampling_params import SamplingParams
from tokenmill.worker.engine_process import EngineProcess, frontend_tokenizer, tokenizer_for_frontend

TOKENIZERS = {"tiny": tiny_tokenizer(), "subword": subword_tokenizer()}


@pytest.mark.parametrize("name", sorted(TOKENIZERS))
def test_the_worker_encodes_every_text_as_the_engine_does(name: str) -> None:
    tokenizer = TOKENIZERS[name]
    spec = tokenizer_for_frontend(tokenizer)
    assert spec is not None
    worker_side = frontend_tokenizer(spec)
    specials = st.sampled_from([*tokenizer.all_special_tokens, " ", "\n", "é", "🙂"])

    @settings(max_examples=200, deadline=None)
    @given(st.lists(st.text(max_size=40) | specials, max_size=8).map("".join))
    def same_ids(text: str) -> None:
        assert worker_side.encode(text, add_special_tokens=True).ids == tokenizer.encode(text, add_special_tokens=True)

    same_ids()


class _Lowercasing:
    """A tokenizer whose Python side changes the text before its backend sees it (as some slow tokenizers do)."""

    def __init__(self, tokenizer: Any) -> None:
        self.backend_tokenizer = tokenizer.backend_tokenizer
        self.all_special_tokens = tokenizer.all_special_tokens
        self._tokenizer = tokenizer

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tokenizer.encode(text.lower(), add_special_tokens=add_special_tokens)


def test_a_tokenizer_the_worker_cannot_reproduce_stays_in_the_engine() -> None:
    tiny = TOKENIZERS["tiny"]
    assert tokenizer_for_frontend(_Lowercasing(tiny)) is None
    assert tokenizer_for_frontend(object()) is None  # no `tokenizers` backend (a slow tokenizer)
    splitting = tiny_tokenizer()
    splitting.split_special_tokens = True
    assert tokenizer_for_frontend(splitting) is None


def test_the_engine_process_gets_token_ids_and_a_too_long_prompt_never_reaches_it() -> None:
    """With the engine process frozen, a prompt over `max_prompt_chars` is refused at once (the worker
    checked it); a normal one finishes after the thaw with the ids transformers' tokenizer gives."""
    engine = EngineProcess("builtin:tiny", {"max_model_len": 64})
    engine.start(timeout=300)
    try:
        (process,) = multiprocessing.active_children()
        os.kill(process.pid, signal.SIGSTOP)
        prompt = "the worker tokenizes this, é 🙂 </s> included"
        params = SamplingParams(max_tokens=4, ignore_eos=True, temperature=0.0)
        normal, too_long = engine.submit_many([("normal", params, prompt, None, None), ("too-long", params, "x" * 100_000, None, None)])
        error = too_long.exception(timeout=5)
        assert isinstance(error, InvalidRequestError) and error.field == "prompt" and "cannot fit" in error.message
        assert not normal.done()
        os.kill(process.pid, signal.SIGCONT)
        output = normal.result(timeout=60)
        # what the engine got are transformers' ids (it reports their count), and it made of them the tokens the
        # in-process engine makes
        ids = tiny_tokenizer().encode(prompt, add_special_tokens=True)
        assert engine.tokenize([prompt]) == [ids] and output.num_prompt_tokens == len(ids)
        expected = LLM("builtin:tiny", max_model_len=64).generate([prompt], params, use_tqdm=False)[0]
        assert output.token_ids == expected.token_ids and len(output.token_ids) == 4
    finally:
        engine.stop()
