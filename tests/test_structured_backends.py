"""Issue 17: two grammar backends, xgrammar and llguidance, chosen per request (`constraint_backend`: auto, or
one forced), both feeding the same sampler mask; no repeated key in any JSON object; the over-refused schemas
served; generated schemas checked through each backend."""

from __future__ import annotations

import json
from typing import Any, Literal

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from model_fixtures import random_prompts
from test_structured_schemas import as_dict, generate, independently_valid, schema_strategy

from tokenmill import LLM, InvalidRequestError, SamplingParams
from tokenmill.engine.structured import GrammarCache, GrammarSpec, advance, apply_token_masks, check_completion

BACKENDS = ["xgrammar", "llguidance"]
SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99},
                                           "tag": {"enum": ["a", "b"]}}, "required": ["n", "tag"]}


@pytest.fixture(scope="module")
def engines() -> dict[str, LLM]:
    return {name: LLM("builtin:tiny", max_num_batched_tokens=2048, constraint_backend=name) for name in ["auto", *BACKENDS]}


def cache(llm: LLM, backend: str) -> GrammarCache:
    return GrammarCache(llm.tokenizer, llm.engine.runner.vocab_size, sorted(llm.engine.eos_ids), backend=backend)


def allowed_after(cache: GrammarCache, params: SamplingParams, text: str) -> set[int]:
    """The tokens a fresh constraint allows after being fed `text` byte by byte (builtin:tiny: token = byte)."""
    constraint = cache.constraint(GrammarSpec.from_params(params), sorted(cache.stop_ids))
    for byte in text.encode():
        advance([constraint], [byte])
    assert constraint.error() is None, constraint.error()
    row = apply_token_masks(torch.zeros(1, cache.vocab_size), [constraint])[0]
    return set(torch.isfinite(row).nonzero()[:, 0].tolist())


def test_auto_picks_per_request_and_records_the_backend(engines: dict[str, LLM]) -> None:
    """xgrammar where it enforces the constraint in full (its masks are faster); llguidance for a pattern beside a
    length bound, which xgrammar would ignore; the result says which."""
    params = [SamplingParams(max_tokens=48, json_schema=SCHEMA), SamplingParams(max_tokens=8, choice=["yes", "no"]),
              SamplingParams(max_tokens=8, regex=r"[0-9]{3}"),
              SamplingParams(max_tokens=48, json_schema={"type": "string", "pattern": "^[a-z]+$", "maxLength": 4}),
              SamplingParams(max_tokens=8)]
    outs = engines["auto"].generate(["x"] * len(params), params, use_tqdm=False)
    assert [o.constraint_backend for o in outs] == ["xgrammar", "xgrammar", "xgrammar", "llguidance", None]
    assert all(o.constraint_satisfied for o in outs[:4]), [(o.text, o.constraint_error) for o in outs]
    assert len(json.loads(outs[3].text)) <= 4


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_forced_backend_serves_every_kind_of_constraint(engines: dict[str, LLM], backend: str) -> None:
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=48, json_schema=SCHEMA) for i in range(8)]
    params += [SamplingParams(temperature=1.0, seed=i, max_tokens=8, choice=["yes", 'n"o', "größer"]) for i in range(4)]
    params += [SamplingParams(temperature=1.0, seed=i, max_tokens=8, regex=r"\d{2}-[a-z]{2}") for i in range(4)]
    outs = engines[backend].generate(["x"] * len(params), params, use_tqdm=False)
    assert {o.constraint_backend for o in outs} == {backend}
    assert all(o.finish_reason == "stop" and o.constraint_satisfied for o in outs), [(o.text, o.error) for o in outs]
    assert all(independently_valid(SCHEMA, o.text) for o in outs[:8])
    assert {o.text for o in outs[8:12]} <= {"yes", 'n"o', "größer"}


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_requests_own_stop_token_and_ignore_eos_apply_with_either_backend(engines: dict[str, LLM], backend: str) -> None:
    """A stop token of the request's own ends it where the grammar may end; with ignore_eos the grammar may not
    end on EOS (it finishes when nothing else can follow)."""
    llm = engines[backend]
    stop = llm.tokenizer.convert_tokens_to_ids("<pad>")
    grammar = cache(llm, backend)
    own = SamplingParams(regex=r"\d+", stop_token_ids=[stop], ignore_eos=True)
    constraint = grammar.constraint(GrammarSpec.from_params(own), [stop])
    advance([constraint], [ord("7")])
    row = apply_token_masks(torch.zeros(1, grammar.vocab_size), [constraint])[0]
    allowed = set(torch.isfinite(row).nonzero()[:, 0].tolist())
    assert stop in allowed and not allowed & set(llm.engine.eos_ids) and ord("8") in allowed
    advance([constraint], [stop])
    assert constraint.completed and constraint.done and constraint.error() is None
    outs = llm.generate(["x"] * 4, [SamplingParams(temperature=1.0, seed=i, max_tokens=48, ignore_eos=True, json_schema=SCHEMA)
                                    for i in range(4)], use_tqdm=False)
    assert all(o.constraint_satisfied and not set(o.token_ids) & set(llm.engine.eos_ids) for o in outs)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_stop_token_that_is_also_text_ends_the_output_only_where_the_grammar_may_end(
        engines: dict[str, LLM], backend: str) -> None:
    """Found in review: llguidance let the request's stop "5" end `[0-9]{3}` after one or two digits."""
    params = [SamplingParams(regex=r"[0-9]{3}", stop_token_ids=[ord("5")], temperature=1.0, seed=i, max_tokens=8)
              for i in range(8)]
    outs = engines[backend].generate(["x"] * len(params), params, use_tqdm=False)
    assert all(o.constraint_satisfied for o in outs), [(o.text, o.constraint_error) for o in outs]


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_open_map_never_repeats_a_key_in_the_mask(engines: dict[str, LLM], backend: str) -> None:
    """Issue: `{"á": 1, "á": 0}` was generated. After `{"ab":1,"a` the token `b` may follow but not a closing quote
    after `ab`; in a nested object the outer keys do not count; a value string may repeat a key."""
    grammar = cache(engines[backend], backend)
    values = {"anyOf": [{"type": "integer"}, {"type": "string"},
                        {"type": "object", "additionalProperties": {"type": "integer"}}]}
    params = SamplingParams(json_schema={"type": "object", "additionalProperties": values, "minProperties": 1})
    assert ord('"') in allowed_after(grammar, params, '{"ab":1,"a')  # "a" is a new key
    assert ord('"') not in allowed_after(grammar, params, '{"ab":1,"ab')
    assert ord('"') not in allowed_after(grammar, params, '{"á":1,"x":{"á":2},"á')
    assert ord('"') in allowed_after(grammar, params, '{"á":1,"x":{"á')
    assert ord('"') in allowed_after(grammar, params, '{"a":"a')
    assert ord('"') in allowed_after(grammar, params, '{"a":1,"a\\"')  # a\" is not a


@pytest.mark.parametrize("backend", BACKENDS)
def test_open_map_completions_have_no_repeated_keys(engines: dict[str, LLM], backend: str) -> None:
    """Greedy and low-temperature random models loop, and a loop repeats a key (on the code before, 2 of these 80
    completions did, caught only by the final check): now none does."""
    schema = {"type": "object", "additionalProperties": {"type": "integer", "minimum": 0, "maximum": 9},
              "minProperties": 4}
    params = [SamplingParams(temperature=t, seed=i, max_tokens=128, json_schema=schema) for i in range(40) for t in (0.0, 0.3)]
    outs = engines[backend].generate(random_prompts(len(params), 1, 4, seed=3), params, use_tqdm=False)
    for out in outs:
        assert out.finish_reason != "error" and out.constraint_error is None, (out.error, out.constraint_error)
        try:
            json.loads(out.text, object_pairs_hook=_unique)
        except json.JSONDecodeError:
            assert not out.constraint_satisfied  # cut by max_tokens


def _unique(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    assert len({k for k, _ in pairs}) == len(pairs), pairs
    return dict(pairs)


def test_the_final_check_rejects_a_repeated_key_however_it_is_spelled() -> None:
    parsed, error = check_completion(("json_schema", {"type": "object"}), '{"a":1,"\\u0061":2}')
    assert parsed is None and "repeated key 'a'" in error


@pytest.mark.parametrize("schema", [
    True, {"anyOf": [True, False]},
    {"$schema": "http://json-schema.org/draft-07/schema#", "type": "array",
     "items": [{"type": "integer", "minimum": 0, "maximum": 3}, {"const": "x"}], "additionalItems": False},
    {"type": "array", "prefixItems": [True, {"const": 1}, False]},
    {"$ref": "#num", "$defs": {"n": {"$anchor": "num", "type": "integer", "minimum": 0, "maximum": 5}}},
    {"$id": "https://example.com/root.json", "$ref": "item.json",
     "$defs": {"item": {"$id": "item.json", "enum": ["p", "q"]}}},
    {"$defs": {"node": {"type": "object", "properties": {"v": {"type": "integer", "minimum": 0, "maximum": 9},
                                                         "next": {"$ref": "#/$defs/node"}}, "required": ["v"]}},
     "$ref": "#/$defs/node"},
], ids=["true", "anyOf true false", "draft7 items", "prefixItems booleans", "anchor", "id-relative", "defs recursion"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_over_refused_schemas_are_served_by_each_backend(engines: dict[str, LLM], schema: Any, backend: str) -> None:
    for out in generate(engines[backend], [as_dict(schema)], per_schema=6)[0]:
        assert out.finish_reason != "error", out.error
        assert out.constraint_backend == backend
        if out.constraint_satisfied:
            assert independently_valid(as_dict(schema), out.text), out.text
    assert any(o.constraint_satisfied for o in generate(engines[backend], [as_dict(schema)], per_schema=6)[0])


def test_the_boolean_schema_false_is_refused_naming_it() -> None:
    with pytest.raises(InvalidRequestError, match="^json_schema: .*unsatisfiable"):
        SamplingParams(json_schema={"allOf": [False]})


@pytest.mark.parametrize("backend", BACKENDS)
@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(schema=schema_strategy())
def test_generated_schemas_through_each_backend_claim_satisfaction_only_when_valid(
        engines: dict[str, LLM], backend: str, schema: Any) -> None:
    try:
        SamplingParams(json_schema=as_dict(schema))
    except InvalidRequestError:
        return
    for out in generate(engines[backend], [as_dict(schema)], per_schema=3, max_tokens=48)[0]:
        if out.finish_reason == "error":  # only a backend's refusal, named, before generation
            assert out.error.startswith("json_schema: cannot be compiled") and not out.token_ids, out.error
        elif out.constraint_satisfied:
            assert independently_valid(as_dict(schema), out.text), (schema, out.text)


def test_a_map_keyed_by_a_literal_is_served_as_optional_properties(engines: dict[str, LLM]) -> None:
    """pydantic's dict[Literal["a", "b"], bool] is propertyNames {"enum": ...} beside additionalProperties: refused
    before, now each name an optional property and nothing else."""
    import pydantic

    class Flags(pydantic.BaseModel):
        flags: dict[Literal["hate", "violence", "spam"], bool]

    schema = Flags.model_json_schema()
    outs = generate(engines["auto"], [schema], per_schema=8)[0]
    assert all(o.finish_reason == "stop" and o.constraint_satisfied for o in outs), [(o.text, o.error) for o in outs]
    assert all(independently_valid(schema, o.text) and set(json.loads(o.text)["flags"]) <= {"hate", "violence", "spam"}
               for o in outs)


@pytest.mark.parametrize("schema", [
    {"if": {"type": "integer"}},
    {"type": "integer", "minimum": 0, "maximum": 20, "if": {"maximum": 5}, "else": {"multipleOf": 5}},
    {"if": {"properties": {"a": {"type": "string"}}}, "else": {"type": "boolean"}},
], ids=["if alone", "if else numbers", "if else object"])
def test_if_without_then_is_served_as_if_or_else(engines: dict[str, LLM], schema: dict) -> None:
    """Refused before (the complement of `if` was needed, and is not enforceable for these): without `then`,
    (if and true) or (not if and else) is exactly "if or else"; `if` alone constrains nothing."""
    outs = generate(engines["auto"], [schema], per_schema=8)[0]
    assert all(o.finish_reason != "error" for o in outs), [o.error for o in outs]
    assert any(o.constraint_satisfied for o in outs)
    assert all(independently_valid(schema, o.text) for o in outs if o.constraint_satisfied)


@pytest.mark.parametrize("schema", [
    {"type": "object", "patternProperties": {"^n_": {"type": "integer", "minimum": 0, "maximum": 9}}, "minProperties": 1,
     "additionalProperties": False},
    {"type": "object", "properties": {"id": {"type": "integer"}}, "required": ["id"],
     "patternProperties": {"^x-": {"type": "string", "maxLength": 3}}, "additionalProperties": {"type": "boolean"}},
    {"type": "object", "patternProperties": {"^x-": {"type": "string", "maxLength": 3}, "^y-": {"type": "integer"}},
     "minProperties": 1, "additionalProperties": False},
])
def test_pattern_properties_are_enforced_by_llguidance(engines: dict[str, LLM], schema: dict) -> None:
    """Refused before (`patternProperties at /patternProperties: is not supported`); llguidance enforces them, so
    auto picks it; forced xgrammar refuses naming the keyword."""
    outs = generate(engines["auto"], [schema], per_schema=8)[0]
    assert all(o.finish_reason != "error" and o.constraint_backend == "llguidance" for o in outs), [o.error for o in outs]
    assert any(o.constraint_satisfied for o in outs) and all(o.constraint_error is None for o in outs)
    assert all(independently_valid(schema, o.text) for o in outs if o.constraint_satisfied)
    forced = generate(engines["xgrammar"], [schema], per_schema=1)[0][0]
    assert forced.finish_reason == "error" and "patternProperties at /: is enforced by llguidance only" in forced.error


def test_a_token_that_writes_a_whole_repeated_key_is_banned() -> None:
    """BPE vocabularies hold `"id"`, `,"id"` and `","id"` as single tokens: a token that opens and closes a key its
    object already has must be banned as well as one that closes it (the scanner itself is the oracle)."""
    import copy

    from tokenmill.engine.json_keys import KeyTracker, TokenPrefixes

    vocab = [bytes([b]) for b in range(256)] + [b'"id"', b',"id"', b'","id"', b'},"id"', b'],"id"', b'"idx"',
                                                 b',"idx"', b'"id', b',"x"', b'"x"', b'1,"id"']
    prefixes = TokenPrefixes(vocab)
    # state: (tokens that must be banned, repeating tokens the grammar masks anyway: not JSON after the state)
    cases = {'{"id":1': ({b',"id"'}, set()), '{"id":1,': ({b'"id"'}, {b',"id"', b'1,"id"'}),
             '{"id":"v': ({b'","id"'}, set()), '{"id":{"x":1': ({b',"x"', b'},"id"'}, {b'],"id"'}),
             '{"id":[1': ({b'],"id"'}, {b'},"id"'}), '{"id":1,"x":{': ({b'},"id"'}, {b'],"id"'}),
             '[{"id":1},': (set(), set()), '{"id":1,"i': (set(), {b'","id"'})}
    for text, (must_ban, not_json) in cases.items():
        tracker = KeyTracker()
        tracker.feed(text.encode())
        banned = {vocab[t] for t in tracker.closing_repeats(prefixes)}
        repeating = set()
        for token in vocab:
            probe = copy.deepcopy(tracker)
            probe.feed(token)
            if probe.repeated:
                repeating.add(token)
        assert banned <= repeating, (text, banned - repeating)  # never bans a token that repeats nothing
        assert must_ban <= banned, (text, must_ban - banned)
        assert repeating - banned <= not_json | {b'1,"id"'}, (text, repeating - banned)  # a digit first: final check
