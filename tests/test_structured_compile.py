"""Issue 18 item 4: compiling a grammar never stalls the batch. New grammars compile on the grammar cache's
threads while other requests keep stepping; compiling is bounded in time (grammar_compile_timeout) and the
options in size (validation limits naming the field); compiled grammars are kept LRU by bytes."""

from __future__ import annotations

import random

import pytest

from tokenmill import LLM, InvalidRequestError, SamplingParams
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.engine.structured import GrammarCache, GrammarSpec
from tokenmill.sampling_params import MAX_CHOICES, MAX_REGEX_LENGTH, MAX_SCHEMA_BYTES


def words(count: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return list(dict.fromkeys("".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(6, 14)))
                              for _ in range(count)))


def finish_order(engine: LLMEngine) -> list[str]:
    order = []
    while engine.has_unfinished():
        order += [o.request_id for o in engine.step()]
    return order


def test_a_bystander_finishes_while_a_big_grammar_compiles() -> None:
    engine = LLM("builtin:tiny").engine
    engine.add_request("warm", [1, 2, 3], SamplingParams(max_tokens=2, choice=["x"]))  # the cache, built once
    finish_order(engine)
    engine.add_request("big", [1, 2, 3], SamplingParams(max_tokens=16, choice=words(3000, seed=1)))
    engine.add_request("bystander", [4, 5, 6], SamplingParams(max_tokens=8, ignore_eos=True))
    assert engine.stats().num_waiting >= 1
    order = finish_order(engine)
    assert order.index("bystander") < order.index("big")


def test_compiling_past_the_timeout_fails_the_request_naming_the_field() -> None:
    engine = LLM("builtin:tiny", grammar_compile_timeout=0.001).engine
    engine.add_request("big", [1, 2, 3], SamplingParams(max_tokens=16, choice=words(3000, seed=2)))
    engine.add_request("free", [4, 5], SamplingParams(max_tokens=4))
    outs = {}
    while engine.has_unfinished():
        outs.update((o.request_id, o) for o in engine.step())
    assert outs["big"].finish_reason == "error" and outs["big"].error.startswith("choice: ")
    assert "grammar_compile_timeout" in outs["big"].error and outs["free"].finish_reason == "length"


def test_the_grammar_cache_is_lru_bounded_by_bytes() -> None:
    llm = LLM("builtin:tiny")
    cache = GrammarCache(llm.tokenizer, llm.engine.runner.vocab_size, sorted(llm.engine.eos_ids), limit_bytes=1)
    specs = [GrammarSpec.from_params(SamplingParams(choice=words(50, seed=s))) for s in range(3)]
    for spec in specs:
        cache.compile(spec)
    assert [cache.is_ready(s) for s in specs] == [False, False, True]  # only the newest is kept
    roomy = GrammarCache(llm.tokenizer, llm.engine.runner.vocab_size, sorted(llm.engine.eos_ids))
    for spec in specs + specs[:1]:
        roomy.compile(spec)
    assert all(roomy.is_ready(s) for s in specs) and 0 < roomy.total_bytes <= roomy.limit_bytes


@pytest.mark.parametrize("options, field", [
    ({"choice": [f"c{i}" for i in range(MAX_CHOICES + 1)]}, "choice"),
    ({"choice": ["x" * (1 << 20), "y"]}, "choice"),
    ({"regex": "a" * (MAX_REGEX_LENGTH + 1)}, "regex"),
    ({"json_schema": {"enum": ["x" * 1000] * (MAX_SCHEMA_BYTES // 1000 + 1)}}, "json_schema"),
])
def test_size_limits_name_the_field(options: dict, field: str) -> None:
    with pytest.raises(InvalidRequestError) as error:
        SamplingParams(**options)
    assert error.value.field == field and "at most" in error.value.message


def test_a_request_cancelled_while_its_grammar_compiles_never_runs() -> None:
    """A cancel (or a deadline) that comes while the request's grammar is still compiling finishes it at once, with
    nothing generated; it does not run once the grammar is ready."""
    engine = LLM("builtin:tiny").engine
    engine.add_request("big", [1, 2, 3], SamplingParams(max_tokens=16, choice=words(3000, seed=3)))
    assert engine.stats().num_waiting == 1  # compiling
    cancelled = engine.cancel_request("big", "deadline")
    assert cancelled is not None and cancelled.finish_reason == "deadline" and cancelled.token_ids == []
    assert cancelled.constraint_satisfied is False and not engine.has_unfinished()
    engine.add_request("after", [4, 5], SamplingParams(max_tokens=16, choice=words(3000, seed=3)))  # the same grammar
    assert finish_order(engine) == ["after"]  # "big" never comes back
