"""`async_scheduling`: a step is planned and launched before the last one's tokens are read back.

What it must keep: every output exactly as the engine gives it step by step (tokens, finish reasons), through stop
tokens and lengths reached while a step is in flight, preemption and recomputation, prefix caching, requests that
cannot overlap (stop strings, logprobs, sampling, min_tokens) running beside those that can, the padded decode path,
and cancels and aborts between steps. Each test also checks that steps did overlap, so that it cannot pass by running
everything step by step.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from model_fixtures import random_prompts
from test_engine_parity import assert_same, hf_greedy
from tokenmill import LLM, SamplingParams
from tokenmill.errors import InvalidRequestError
from tokenmill.engine.llm_engine import PLACEHOLDER, LLMEngine
from tokenmill.engine.padded_decode import PaddedDecode

STOPS = [5, 7, 11, 13]  # builtin:tiny's random weights sample these now and then: stop tokens met in flight


def plain_requests(count: int, seed: int, shared_prefix: int = 0) -> tuple[list[list[int]], list[SamplingParams]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(20, 200) for _ in range(shared_prefix)]
    prompts = [prefix + [rng.randrange(20, 200) for _ in range(rng.randint(1, 50))] for _ in range(count)]
    params = [SamplingParams(max_tokens=rng.randint(1, 40), temperature=0.0, stop_token_ids=STOPS) for _ in prompts]
    return prompts, params


def mixed_requests(count: int, seed: int) -> tuple[list[list[int]], list[SamplingParams]]:
    """Plain greedy requests beside ones whose steps cannot overlap (one in eight)."""
    prompts, params = plain_requests(count, seed)
    others = [dict(logprobs=2), dict(temperature=0.8, seed=3), dict(min_tokens=4), dict(repetition_penalty=1.3),
              dict(stop=["ab"]), dict(top_k=5, temperature=1.0, seed=9)]
    for i in range(0, count, 8):
        params[i] = SamplingParams(max_tokens=params[i].max_tokens, stop_token_ids=STOPS, **others[(i // 8) % 6])
    return prompts, params


def steps(engine: LLMEngine, count: int, until_done: bool = False) -> list:
    finished = []
    for _ in range(count):
        if until_done and not engine.has_unfinished():
            break
        finished += engine.step()
    return finished


def generate(async_on: bool, prompts: list[list[int]], params: list[SamplingParams], model: str = "builtin:tiny",
             padded: bool = False, **options: object) -> tuple[list[tuple], dict[str, int]]:
    """Each output's tokens, finish reason and logprobs, and how many steps were launched to overlap and read after."""
    llm = LLM(model, async_scheduling=async_on, **options)
    runner = llm.engine.runner
    if padded:
        runner.decode = PaddedDecode(runner, llm.engine.max_model_len, capture=False)
    counts = {"overlapped": 0, "padded": 0}
    launch = runner.launch

    def counted(batch, feed=None):  # noqa: ANN001, ANN202
        counts["overlapped"] += 1
        counts["padded"] += runner.decode is not None and runner.decode.fits(batch)
        return launch(batch, feed)

    runner.launch = counted
    engine = llm.engine
    for i, (prompt, param) in enumerate(zip(prompts, params)):
        engine.add_request(str(i), prompt, param)
    outputs = steps(engine, 3000, until_done=True)  # bounded: a request that never finishes fails, not hangs
    assert not engine.has_unfinished() and len(outputs) == len(prompts)
    outputs.sort(key=lambda output: int(output.request_id))
    assert llm.engine.scheduler.block_manager.num_free_blocks == llm.engine.scheduler.block_manager.num_blocks
    return [(o.token_ids, o.finish_reason, o.logprobs) for o in outputs], counts


@pytest.mark.parametrize("case", ["plain", "preempting", "shared-prefix", "mixed"])
def test_outputs_equal_the_step_by_step_engine(case: str) -> None:
    options: dict[str, object] = dict(max_num_seqs=8, max_num_batched_tokens=64)
    if case == "preempting":  # 40 blocks of 4 tokens for 8 sequences of up to 90: decodes preempt others
        options.update(block_size=4, num_kv_blocks=40)
    requests = mixed_requests(40, 1) if case == "mixed" else plain_requests(40, 2, 30 if case == "shared-prefix" else 0)
    expected, _ = generate(False, *requests, **options)
    actual, counts = generate(True, *requests, **options)
    assert actual == expected
    assert counts["overlapped"] >= (5 if case == "mixed" else 20), counts
    assert {reason for _, reason, _ in expected} == {"stop", "length"}  # both finishes met, some in flight


def test_preemption_and_prefix_hits_happen_while_steps_overlap() -> None:
    """The preempting case above does preempt, and the shared prefix is served from the cache, with overlap on."""
    for options, stat in ((dict(block_size=4, num_kv_blocks=40), "num_preemptions"), ({}, "num_prefix_hit_tokens")):
        llm = LLM("builtin:tiny", async_scheduling=True, max_num_seqs=8, max_num_batched_tokens=64, **options)
        prompts, params = plain_requests(40, 2, 30 if stat == "num_prefix_hit_tokens" else 0)
        llm.generate(prompts, params, use_tqdm=False)
        assert getattr(llm.engine.stats(), stat) > 0, stat


def test_the_padded_decode_path_overlaps_and_matches_transformers(model_dirs: dict[str, Path]) -> None:
    prompts = random_prompts(6, 1, 60, seed=21)
    max_tokens = [12, 3, 20, 1, 9, 16]
    params = [SamplingParams(max_tokens=n, temperature=0.0) for n in max_tokens]
    options = dict(dtype="float32", max_num_seqs=8, max_num_batched_tokens=64, padded=True)
    outputs, counts = generate(True, prompts, params, str(model_dirs["qwen2"]), **options)
    assert_same([tokens for tokens, _, _ in outputs], hf_greedy(model_dirs["qwen2"], prompts, max_tokens))
    assert counts["padded"] >= 10, counts  # decode steps on the padded path, their input ids fed on the device




def test_cancel_and_abort_between_overlapping_steps() -> None:
    """A cancel reads the step in flight first: the partial output is what the step-by-step engine generated up to
    there, with no placeholder; an aborted request never comes back; the others finish as they would have."""
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    outputs = {}
    for async_on in (False, True):
        engine = LLMEngine("builtin:tiny", async_scheduling=async_on, seed=0)
        for name in ("a", "b", "c"):
            engine.add_request(name, f"prompt {name}", params)
        finished = steps(engine, 8)
        assert engine._in_flight is not None if async_on else engine._in_flight is None
        cancelled = engine.cancel_request("a", "cancelled")
        engine.abort_request("b")
        while engine.has_unfinished():
            finished += engine.step()
        assert [o.request_id for o in finished] == ["c"] and PLACEHOLDER not in cancelled.token_ids
        outputs[async_on] = (cancelled.token_ids, cancelled.finish_reason, finished[0].token_ids)
    assert outputs[True] == outputs[False]


def test_a_cancel_of_a_request_the_step_in_flight_finished_returns_it_finished() -> None:
    """Its last token was in flight: the cancel reads it back and gives the request as it ended (its length), not as
    cancelled; it is not returned again by the next step."""
    engine = LLMEngine("builtin:tiny", async_scheduling=True, seed=0)
    engine.add_request("a", "a prompt", SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    finished = steps(engine, 3)  # prefill, then two decodes: the third token is in flight
    assert finished == [] and engine._in_flight is not None
    output = engine.cancel_request("a", "cancelled")
    assert output.finish_reason == "length" and len(output.token_ids) == 3 and PLACEHOLDER not in output.token_ids
    assert engine.step() == [] and not engine.has_unfinished()


def test_steps_that_cannot_overlap_at_any_moment_keep_outputs_and_the_prefix_cache_right() -> None:
    """Under preemption and shared prefixes, steps refused overlap at random moments (as a logprobs or sampled request
    in the step would): such a step runs first, with the tokens of the step in flight fed on the device, and reads it
    after, so every block it planned is computed. Outputs equal the step-by-step engine's, and follow-up prompts
    (prompt + output + more, served from the cache) the same tokens as on a fresh engine."""
    options: dict[str, object] = dict(max_num_seqs=6, max_num_batched_tokens=12, block_size=2, num_kv_blocks=60)
    prompts, params = plain_requests(30, 4, shared_prefix=6)
    expected, _ = generate(False, prompts, params, **options)
    llm = LLM("builtin:tiny", async_scheduling=True, **options)
    engine, coin = llm.engine, random.Random(5)
    overlaps = engine._overlaps
    engine._overlaps = lambda batch, sampling: overlaps(batch, sampling) and coin.random() < 0.5  # type: ignore
    for i, (prompt, param) in enumerate(zip(prompts, params)):
        engine.add_request(str(i), prompt, param)
    outputs = sorted(steps(engine, 3000, until_done=True), key=lambda output: int(output.request_id))
    assert [(o.token_ids, o.finish_reason, o.logprobs) for o in outputs] == expected
    assert engine.stats().num_preemptions > 0
    follow = [o.prompt_token_ids + o.token_ids + [33, 44] for o in outputs[:12]]
    more = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    served = llm.generate(follow, more, use_tqdm=False)
    fresh = LLM("builtin:tiny", **options).generate(follow, more, use_tqdm=False)
    assert [o.token_ids for o in served] == [o.token_ids for o in fresh]
    assert sum(o.num_cached_tokens for o in served) > 0


def test_generated_blocks_are_registered_with_their_tokens() -> None:
    """A block that a token in flight completes is registered again once the token is read back: a follow-up prompt
    finds the generated text in the prefix cache as with the step-by-step engine."""
    hits = {}
    for async_on in (False, True):
        llm = LLM("builtin:tiny", async_scheduling=async_on, block_size=4, max_num_seqs=8, max_num_batched_tokens=64)
        prompt = list(range(20, 40))
        out = llm.generate([prompt], SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True),
                           use_tqdm=False)[0]
        assert not [b for b in llm.engine.scheduler.block_manager.blocks if PLACEHOLDER in b.token_ids]
        follow = llm.generate([prompt + out.token_ids + [50, 51, 52]], SamplingParams(max_tokens=2, temperature=0.0),
                              use_tqdm=False)[0]
        hits[async_on] = follow.num_cached_tokens
    assert hits[True] == hits[False] == 40


def test_a_request_that_cannot_be_decoded_fails_alone_when_read_back() -> None:
    """As step by step (tests/test_engine_poison.py): the tokenizer failing on one request's tokens fails that request
    only, also when its last token comes back from a step in flight."""
    reasons = {}
    for async_on in (False, True):
        llm = LLM("builtin:tiny", max_num_batched_tokens=256, async_scheduling=async_on)
        real = llm.engine.detokenize

        def decode(ids, skip, real=real):  # noqa: ANN001, ANN202
            if not skip:
                raise ValueError("cannot decode")
            return real(ids, skip)

        llm.engine.detokenize = decode
        params = [SamplingParams(max_tokens=6, temperature=0.0, skip_special_tokens=skip)
                  for skip in (True, False, True)]
        outputs = llm.generate(random_prompts(3, 5, 20, seed=12), params, use_tqdm=False)
        reasons[async_on] = [o.finish_reason for o in outputs]
        assert not llm.engine.has_unfinished()
    assert reasons[True] == reasons[False] == ["length", "error", "length"]


def test_a_request_id_is_taken_until_its_output_is_returned() -> None:
    """A request that its length finished while its last token is in flight has left the scheduler: its id stays taken
    until the step that reads the token returns its output."""
    engine = LLMEngine("builtin:tiny", seed=0, async_scheduling=True)
    engine.add_request("x", [30, 31, 32], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    assert steps(engine, 2) == [] and engine._in_flight is not None and "x" not in engine.requests
    with pytest.raises(InvalidRequestError, match="'x' is already in flight"):
        engine.add_request("x", [40, 41], SamplingParams(max_tokens=3, temperature=0.0))
    [output] = steps(engine, 1)
    assert output.request_id == "x" and len(output.token_ids) == 2
    engine.add_request("x", [40, 41], SamplingParams(max_tokens=3, temperature=0.0))  # free again


def test_a_step_that_cannot_overlap_runs_what_it_planned_before_reading_the_one_in_flight() -> None:
    """The step planned while a step is in flight runs whole, the requests that the read-back then finishes
    included: it registered their blocks when planned, and blocks registered but never computed would serve wrong
    K/V from the prefix cache. Their output is the one the read-back finished; the step's tokens are not theirs."""
    prompt, plain = [30, 31, 32, 33], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    reference = LLMEngine("builtin:tiny", seed=0)
    reference.add_request("a", prompt, plain)
    tokens = steps(reference, 20, until_done=True)[0].token_ids
    stop = tokens[3]
    assert stop not in tokens[:3]
    engine = LLMEngine("builtin:tiny", seed=0, async_scheduling=True)
    engine.add_request("a", prompt, SamplingParams(max_tokens=12, temperature=0.0, stop_token_ids=[stop]))
    assert steps(engine, 4) == []  # prefill, three decodes: the fourth token (the stop) is in flight
    ran: list[list[str]] = []
    execute = engine.runner.execute
    engine.runner.execute = lambda batch, *args: ran.append([s.request_id for s in batch.seqs]) or execute(batch, *args)
    engine.add_request("b", [40, 41], SamplingParams(max_tokens=2, temperature=0.0, logprobs=1))  # cannot overlap
    [output] = steps(engine, 1)
    assert ran == [["a", "b"]], ran
    assert (output.request_id, output.finish_reason, output.token_ids) == ("a", "stop", tokens[:4])
    assert [o.request_id for o in steps(engine, 10, until_done=True)] == ["b"]
