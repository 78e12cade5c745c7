"""Structured outputs: every completion forced to a JSON schema, a choice or a regex, on builtin:tiny (random
weights, byte tokens: the hardest case) and on a tiny model with a real subword tokenizer."""

from __future__ import annotations

import json
import re

import jsonschema
import pydantic
import pytest
from hypothesis import example, given
from hypothesis import strategies as st
from model_fixtures import random_prompts
from subword_model import build_subword_model_dir

from tokenmill import LLM, InvalidRequestError, SamplingParams
from tokenmill.queue.schemas import Job

# Nested objects, an array of objects, enums, bounded integers, an optional field, required fields, bounded
# strings (pattern, maxLength: random bytes there must still be valid UTF-8 of at most 5 characters). Every value is bounded, so a random model must finish well within
# max_tokens: a "length" finish here would mean the grammar let it wander.
SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 999},
        "label": {"enum": ["cat", "dog", "bird"]},
        "score": {"type": "integer", "minimum": -5, "maximum": 5},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "minItems": 1, "maxItems": 3},
        "owner": {
            "type": "object",
            "properties": {"name": {"type": "string", "pattern": "^[a-z]{1,8}$"}, "verified": {"type": "boolean"}},
            "required": ["name", "verified"],
        },
        "items": {
            "type": "array",
            "maxItems": 2,
            "items": {"type": "object", "properties": {"sku": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{2}$"},
                                                       "qty": {"type": "integer", "minimum": 1, "maximum": 99}},
                      "required": ["sku", "qty"]},
        },
        "note": {"type": "string", "maxLength": 5},
    },
    "required": ["id", "label", "tags", "owner", "items", "note"],
}
CHOICES = ["positive", "negative", "neutral", 'n/a "quoted"', "größer"]
REGEX = r"\d{4}-(0[1-9]|1[0-2])-[0-3]\d"


@pytest.fixture(scope="module")
def tiny() -> LLM:
    return LLM("builtin:tiny", max_num_batched_tokens=1024)


@pytest.fixture(scope="module")
def subword(tmp_path_factory: pytest.TempPathFactory) -> LLM:
    return LLM(str(build_subword_model_dir(tmp_path_factory.mktemp("subword"))), max_num_batched_tokens=1024)


@pytest.fixture(params=["tiny", "subword"])
def llm(request: pytest.FixtureRequest) -> LLM:
    return request.getfixturevalue(request.param)


def sampled(count: int, seed: int = 0, **options: object) -> list[SamplingParams]:
    return [SamplingParams(temperature=1.0, seed=seed + i, **options) for i in range(count)]


def test_200_json_schema_completions_all_finish_and_validate(llm: LLM) -> None:
    prompts = random_prompts(200, 3, 20, seed=1)
    outs = llm.generate(prompts, sampled(200, max_tokens=192, json_schema=SCHEMA), use_tqdm=False)
    assert [o.finish_reason for o in outs] == ["stop"] * 200, [o.text for o in outs if o.finish_reason != "stop"][:3]
    for out in outs:
        value = json.loads(out.text)
        jsonschema.validate(value, SCHEMA)
        assert out.parsed == value and out.constraint_satisfied is True
        assert not re.search(r"\s", re.sub(r'"(?:[^"\\]|\\.)*"', "", out.text))  # compact: no free whitespace
    assert len({o.text for o in outs}) > 150  # the grammar constrains, the model still chooses


def test_choice_and_regex(llm: LLM) -> None:
    prompts = random_prompts(40, 3, 20, seed=2)
    choices = llm.generate(prompts, sampled(40, max_tokens=32, choice=CHOICES), use_tqdm=False)
    assert all(o.text in CHOICES and o.finish_reason == "stop" and o.constraint_satisfied for o in choices)
    assert len({o.text for o in choices}) >= 3
    dates = llm.generate(prompts, sampled(40, max_tokens=32, regex=REGEX), use_tqdm=False)
    assert all(re.fullmatch(REGEX, o.text) and o.finish_reason == "stop" and o.parsed is None for o in dates)


def test_stream_and_chat_take_constraints(tiny: LLM) -> None:
    streamed = list(tiny.stream(random_prompts(6, 3, 20, seed=10), sampled(6, max_tokens=16, choice=CHOICES)))
    assert sorted(int(o.request_id) for o in streamed) == list(range(6)) and all(o.text in CHOICES for o in streamed)
    chats = tiny.chat([[{"role": "user", "content": f"rate {i}"}] for i in range(4)],
                      sampled(4, max_tokens=192, json_schema=SCHEMA), use_tqdm=False)
    assert all(o.finish_reason == "stop" and jsonschema.validate(o.parsed, SCHEMA) is None for o in chats)


def test_json_object_is_an_object_and_compact(tiny: LLM) -> None:
    outs = tiny.generate(random_prompts(40, 3, 20, seed=3), sampled(40, max_tokens=48, json_object=True), use_tqdm=False)
    done = [o for o in outs if o.finish_reason == "stop"]
    assert done and all(isinstance(json.loads(o.text), dict) and o.parsed == json.loads(o.text) for o in done)
    for out in outs:  # cut ones are prefixes of compact JSON, marked unsatisfied
        assert out.text.startswith("{") and (out.finish_reason == "stop") == out.constraint_satisfied


def test_unconstrained_rows_in_a_mixed_batch_get_the_tokens_they_get_alone(tiny: LLM) -> None:
    prompts = random_prompts(24, 3, 30, seed=4)
    free = [SamplingParams(max_tokens=24, temperature=0.8, seed=50 + i, top_k=40) for i in range(12)]
    free[0] = SamplingParams(max_tokens=24, temperature=0.0)
    alone = tiny.generate(prompts[:12], free, use_tqdm=False)
    constrained = [SamplingParams(max_tokens=96, temperature=1.0, seed=i, **option) for i, option in
                   enumerate([{"json_schema": SCHEMA}, {"choice": CHOICES}, {"regex": REGEX}, {"json_object": True}] * 3)]
    mixed_prompts = [p for pair in zip(prompts[:12], prompts[12:]) for p in pair]
    mixed = tiny.generate(mixed_prompts, [p for pair in zip(free, constrained) for p in pair], use_tqdm=False)
    assert [o.token_ids for o in mixed[0::2]] == [o.token_ids for o in alone]
    assert all(o.constraint_satisfied is None for o in mixed[0::2])
    assert all(o.constraint_satisfied for o in mixed[1::2] if o.finish_reason == "stop")


def test_greedy_is_deterministic_and_seeded_is_the_same_alone_and_in_a_batch_of_32(llm: LLM) -> None:
    prompts = random_prompts(32, 3, 40, seed=5)
    greedy = SamplingParams(max_tokens=64, temperature=0.0, json_schema=SCHEMA)
    first = llm.generate(prompts[:4], greedy, use_tqdm=False)
    again = llm.generate(prompts[:4], greedy, use_tqdm=False)
    assert [o.token_ids for o in first] == [o.token_ids for o in again]
    params = [SamplingParams(max_tokens=64, temperature=0.9, top_p=0.95, seed=700 + i, repetition_penalty=1.1,
                             json_schema=SCHEMA, logprobs=2) for i in range(32)]
    batch = llm.generate(prompts, params, use_tqdm=False)
    for index in (0, 17, 31):
        alone = llm.generate([prompts[index]], [params[index]], use_tqdm=False)[0]
        assert alone.token_ids == batch[index].token_ids and alone.text == batch[index].text
        assert len(alone.logprobs) == len(alone.token_ids)  # logprobs work under the mask


def test_rows_sampled_from_their_allowed_tokens_get_the_tokens_of_the_masked_full_row(
        llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    """A row whose mask allows few tokens is sampled from the list of them (`mask_logits`): greedy, seeded and
    with logprobs, each request gets the same tokens as with every row masked in full (`LISTED_WORDS = 0`);
    rows with top-p or a penalty are masked in full either way."""
    from tokenmill.engine import structured

    prompts = random_prompts(24, 3, 40, seed=11)
    params = [SamplingParams(max_tokens=48, json_schema=SCHEMA, temperature=[0.0, 1.0, 0.7][i % 3], seed=900 + i,
                             logprobs=2 if i % 4 == 0 else None) for i in range(20)]
    params += [SamplingParams(max_tokens=48, json_schema=SCHEMA, temperature=1.0, seed=5, top_p=0.9),
               SamplingParams(max_tokens=48, json_schema=SCHEMA, temperature=1.0, seed=6, repetition_penalty=1.2),
               SamplingParams(max_tokens=48, choice=["alpha", "beta", "gamma"], temperature=1.0, seed=7),
               SamplingParams(max_tokens=16, temperature=1.0, seed=8)]
    calls: list[int] = []
    original = structured._allowed_tokens  # noqa: SLF001
    monkeypatch.setattr(structured, "_allowed_tokens", lambda *a: calls.append(1) or original(*a))
    listed = llm.generate(prompts, params, use_tqdm=False)
    monkeypatch.setattr(structured, "LISTED_WORDS", 0)
    masked = llm.generate(prompts, params, use_tqdm=False)
    assert calls  # the listed path ran
    assert [o.token_ids for o in listed] == [o.token_ids for o in masked]
    # the model's own logprobs, either way (to float noise: the second run reads the first's cached prefixes)
    for a, b in zip(listed, masked):
        assert (a.logprobs is None) == (b.logprobs is None)
        for x, y in zip(a.logprobs or [], b.logprobs or []):
            assert x["token_id"] == y["token_id"] and x["logprob"] == pytest.approx(y["logprob"], abs=1e-4)
    assert all(o.constraint_satisfied for o in listed[:-1] if o.finish_reason == "stop")


def test_preemption_prefix_caching_and_chunked_prefill_give_the_same_outputs() -> None:
    """A small KV pool (preemptions, recomputation), a shared prompt prefix (prefix-cache hits) and a 64-token
    budget (chunked prefill) against a large pool without prefix caching: the same tokens, all valid."""
    shared = random_prompts(1, 40, 40, seed=60)[0]
    prompts = [shared + tail for tail in random_prompts(16, 4, 30, seed=6)]
    params = [SamplingParams(max_tokens=128, temperature=0.0 if i % 3 == 0 else 1.0, seed=i,
                             **({"json_schema": SCHEMA} if i % 2 else {"regex": REGEX + r"( [a-z]{1,20}){0,4}"}))
              for i in range(16)]
    plain = LLM("builtin:tiny", num_kv_blocks=512, block_size=4, enable_prefix_caching=False)
    large = plain.generate(prompts, params, use_tqdm=False)
    small_llm = LLM("builtin:tiny", num_kv_blocks=64, block_size=4, max_num_batched_tokens=64)
    small = small_llm.generate(prompts, params, use_tqdm=False)
    stats = small_llm.engine.stats()
    assert stats.num_preemptions > 0 and stats.num_prefix_hit_tokens > 0
    assert [o.token_ids for o in small] == [o.token_ids for o in large]
    assert all(o.constraint_satisfied for o in small if o.finish_reason == "stop")


def test_max_tokens_cut_and_stop_strings_mark_the_output_unsatisfied(tiny: LLM) -> None:
    prompts = random_prompts(8, 3, 20, seed=7)
    cut = tiny.generate(prompts, sampled(8, max_tokens=10, json_schema=SCHEMA), use_tqdm=False)
    assert all(o.finish_reason == "length" and o.constraint_satisfied is False and o.parsed is None for o in cut)
    stopped = tiny.generate(prompts, sampled(8, max_tokens=192, json_schema=SCHEMA, stop=['"tags"']), use_tqdm=False)
    assert all(o.finish_reason == "stop" and o.constraint_satisfied is False and o.parsed is None for o in stopped)
    assert all('"tags"' not in o.text and o.text.startswith('{"id":') for o in stopped)


def test_min_tokens_and_ignore_eos_respect_the_grammar(tiny: LLM) -> None:
    prompts = random_prompts(12, 3, 20, seed=8)
    longer = tiny.generate(prompts, sampled(12, max_tokens=12, min_tokens=6, regex=r"\d{1,10}"), use_tqdm=False)
    assert all(len(o.text) >= 6 and re.fullmatch(r"\d{1,10}", o.text) for o in longer)
    endless = tiny.generate(prompts, sampled(12, max_tokens=8, ignore_eos=True, regex=r"\d+"), use_tqdm=False)
    # eight digits match `\d+`, but the grammar could go on: a cut value is never passed off as complete
    assert all(o.finish_reason == "length" and re.fullmatch(r"\d{8}", o.text) and o.constraint_satisfied is False
               and o.parsed is None for o in endless)
    closed = tiny.generate(prompts, sampled(12, max_tokens=30, ignore_eos=True, choice=["yes", "no"]), use_tqdm=False)
    assert all(o.text in ("yes", "no") and o.finish_reason == "stop" for o in closed)  # nothing can follow: done


class Pet(pydantic.BaseModel):
    name: str = pydantic.Field(pattern="^[a-z]{1,6}$")
    kind: str = pydantic.Field(json_schema_extra={"enum": ["cat", "dog"]})
    age: int = pydantic.Field(ge=0, le=30)


def test_pydantic_model_and_json_string_schemas(tiny: LLM) -> None:
    params = SamplingParams(json_schema=Pet, max_tokens=64)
    assert params.json_schema == Pet.model_json_schema()
    assert SamplingParams(json_schema=json.dumps(SCHEMA)).json_schema == SCHEMA
    outs = tiny.generate(random_prompts(8, 3, 20, seed=9), sampled(8, max_tokens=64, json_schema=Pet), use_tqdm=False)
    assert all(o.finish_reason == "stop" and Pet.model_validate(o.parsed) for o in outs)


@pytest.mark.parametrize("options, field", [
    ({"json_schema": {"type": "objekt"}}, "json_schema"),
    ({"json_schema": {"properties": {"a": {"minimum": "zero"}}}}, "json_schema"),
    ({"json_schema": "{not json"}, "json_schema"),
    ({"json_schema": ["type", "object"]}, "json_schema"),
    ({"choice": []}, "choice"),
    ({"choice": "yes,no"}, "choice"),
    ({"choice": ["yes", ""]}, "choice[1]"),
    ({"choice": ["yes", 3]}, "choice[1]"),
    ({"regex": "(unclosed"}, "regex"),
    ({"regex": ""}, "regex"),
    ({"json_object": "yes"}, "json_object"),
    ({"choice": ["a"], "regex": "a"}, "regex"),
    ({"json_schema": {"type": "object"}, "json_object": True}, "json_object"),
])
def test_invalid_options_are_refused_naming_the_field(options: dict, field: str) -> None:
    with pytest.raises(InvalidRequestError) as error:
        SamplingParams(**options)
    assert error.value.field == field
    with pytest.raises(InvalidRequestError) as error:  # the job schema (client side) applies the same check
        Job.from_wire({"prompt": "hi", **options})
    assert error.value.field == field


def test_the_engine_refuses_what_xgrammar_cannot_compile_and_serves_the_rest(tiny: LLM) -> None:
    bad = [SamplingParams(regex=r"(?=a)b"), SamplingParams(regex=r"(a)\1"),
           SamplingParams(json_schema={"type": "string", "format": "no-such-format", "pattern": "(?<=x)y"})]
    outs = tiny.generate(["x"] * 4, [*bad, SamplingParams(max_tokens=8, choice=["ok"])], use_tqdm=False)
    assert [o.finish_reason for o in outs] == ["error", "error", "error", "stop"] and outs[3].text == "ok"
    assert outs[0].error.startswith("regex: ") and outs[2].error.startswith("json_schema: ")
    with pytest.raises(InvalidRequestError, match="^regex: "):
        tiny.engine.add_request("bad", [1, 2], SamplingParams(regex=r"(?=a)b"))
    assert not tiny.engine.has_unfinished()


@pytest.mark.parametrize("backend", ["xgrammar", "llguidance"])
def test_length_bounded_strings_compile_to_valid_json_strings(tiny: LLM, backend: str) -> None:
    """xgrammar 0.2.9 compiles maxLength to a class that admits raw control characters (invalid JSON); the
    engine hands it the bound as a pattern instead. Checked on the matcher of each backend, byte by byte."""
    from tokenmill.engine.structured import GrammarCache, GrammarSpec, advance

    cache = GrammarCache(tiny.tokenizer, tiny.engine.runner.vocab_size, sorted(tiny.engine.eos_ids), backend=backend)
    spec = GrammarSpec.from_params(SamplingParams(json_schema={"type": "string", "minLength": 1, "maxLength": 3}))

    def accepts(text: str) -> bool:
        constraint = cache.constraint(spec, sorted(tiny.engine.eos_ids))
        for byte in text.encode():
            advance([constraint], [byte])
        return constraint.completed and constraint.backend == backend

    assert accepts('"abc"') and accepts('"é€😀"') and accepts('"a"')
    assert not accepts('"abcd"') and not accepts('""') and not accepts('"\x01"') and not accepts('"a\tb"')


def test_pattern_beside_a_length_bound_is_enforced_by_llguidance_and_refused_by_xgrammar(tiny: LLM) -> None:
    """xgrammar ignores minLength/maxLength beside a pattern; llguidance enforces both, so auto picks it."""
    schema = {"type": "string", "pattern": "^[a-z]*$", "maxLength": 3, "minLength": 1}
    outs = tiny.generate(["x"] * 8, sampled(8, max_tokens=8, json_schema=schema), use_tqdm=False)
    assert {o.constraint_backend for o in outs} == {"llguidance"} and all(o.constraint_satisfied for o in outs)
    assert all(1 <= len(json.loads(o.text)) <= 3 for o in outs)
    forced = LLM("builtin:tiny", constraint_backend="xgrammar").generate(["x"], SamplingParams(json_schema=schema))[0]
    assert forced.finish_reason == "error" and "pattern at /: beside minLength/maxLength" in forced.error


@pytest.mark.parametrize("backend", ["xgrammar", "llguidance"])
def test_masks_keep_byte_tokens_to_valid_utf8(tiny: LLM, backend: str) -> None:
    """xgrammar accepts overlong and surrogate UTF-8 (E0 80 AF, ED A0 80); random byte-level models emit them,
    and they decode to U+FFFD. The mask allows after E0 only A0-BF, after ED only 80-9F, never C0/C1/F5-FF."""
    import torch

    from tokenmill.engine.structured import GrammarCache, GrammarSpec, advance, apply_token_masks

    cache = GrammarCache(tiny.tokenizer, tiny.engine.runner.vocab_size, sorted(tiny.engine.eos_ids), backend=backend)
    spec = GrammarSpec.from_params(SamplingParams(json_schema={"type": "string"}))
    constraints = []
    for lead in (None, 0xE0, 0xED):
        constraint = cache.constraint(spec, sorted(tiny.engine.eos_ids))
        advance([constraint], [ord('"')])
        if lead is not None:
            advance([constraint], [lead])
        constraints.append(constraint)
    allowed = [set(torch.isfinite(row).nonzero()[:, 0].tolist()) for row in apply_token_masks(torch.zeros(3, 320), constraints)]
    assert {0xC0, 0xC1, 0xF5, 0xFF}.isdisjoint(allowed[0]) and {ord("a"), 0xE0, 0xED, 0xF0}.issubset(allowed[0])
    assert allowed[1] == set(range(0xA0, 0xC0)) and allowed[2] == set(range(0x80, 0xA0))


@given(st.lists(st.text(min_size=1, alphabet=st.characters(blacklist_categories=("Cs",))), min_size=1, max_size=30))
@example([", ", "a"])  # found by this test: the choice ", " dumps to the old element separator
@example(["a\nb", "\n", "x"])
def test_a_choice_grammar_is_each_choice_as_a_json_string_joined_by_or(choices: list[str]) -> None:
    """The one-dump construction of a choice grammar (quotes, commas, backslashes and ', ' inside choices
    included) equals dumping each choice on its own."""
    from tokenmill.engine.structured import GrammarSpec

    expected = " | ".join(json.dumps(c, ensure_ascii=False) for c in dict.fromkeys(choices))
    assert GrammarSpec.from_params(SamplingParams(choice=choices)).source == f"root ::= {expected}"


@given(rows=st.integers(1, 9), vocab=st.integers(1, 300), data=st.data())
def test_bitmask_apply_sets_minus_inf_exactly_where_a_constrained_row_has_a_clear_bit(rows: int, vocab: int,
                                                                                     data: st.DataObject) -> None:
    """The CPU bias table against a bit-by-bit reference: token t of a row in `indices` is -inf iff bit t % 32 of
    word t // 32 is clear; every other value, and every row not in `indices`, keeps its logit bit for bit."""
    import torch

    from tokenmill.engine.structured import apply_bitmask

    words = (vocab + 31) // 32
    seed = data.draw(st.integers(0, 2**31 - 1))
    generator = torch.Generator().manual_seed(seed)
    bitmask = torch.randint(-2**31, 2**31 - 1, (rows, words), dtype=torch.int32, generator=generator)
    logits = torch.randn(rows, vocab, generator=generator) * 10
    indices = sorted(data.draw(st.sets(st.integers(0, rows - 1), min_size=1)))
    expected = logits.clone()
    for r in indices:
        for t in range(vocab):
            if not (int(bitmask[r, t // 32]) >> (t % 32)) & 1:
                expected[r, t] = float("-inf")
    out = logits.clone()
    apply_bitmask(out, bitmask, indices)
    assert torch.equal(out, expected)


@pytest.mark.parametrize("rows, vocab, every", [(70, 32_005, 1), (200, 32_005, 3), (15, 151_936, 2)])
def test_bitmask_apply_over_many_row_chunks_matches_the_bitwise_reference(rows: int, vocab: int, every: int) -> None:
    """At real vocabularies the bias is applied a few rows at a time: every chunk, and a subset of rows."""
    import torch

    from tokenmill.engine.structured import apply_bitmask

    bitmask = torch.randint(-2**31, 2**31 - 1, (rows, (vocab + 31) // 32), dtype=torch.int32)
    logits = torch.randn(rows, vocab)
    indices = list(range(0, rows, every))
    tokens = torch.arange(vocab)
    clear = ((bitmask[:, tokens // 32] >> (tokens % 32)) & 1) == 0
    expected = logits.clone()
    expected[indices] = expected[indices].masked_fill(clear[indices], float("-inf"))
    out = logits.clone()
    apply_bitmask(out, bitmask, indices)
    assert torch.equal(out, expected)
