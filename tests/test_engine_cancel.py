"""`LLMEngine.cancel_request`: a running request stops at once with what it generated, its blocks are freed."""

from __future__ import annotations

from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.sampling_params import SamplingParams


def _steps(engine: LLMEngine, count: int) -> list:
    finished = []
    for _ in range(count):
        finished += engine.step()
    return finished


def test_a_cancelled_request_returns_its_partial_output_and_frees_its_slot_and_blocks() -> None:
    engine = LLMEngine("builtin:tiny", max_num_seqs=1, block_size=4, seed=0)
    long = SamplingParams(max_tokens=500, min_tokens=500, temperature=0.0)
    engine.add_request("long", "tell me everything", long)
    engine.add_request("next", "and then", SamplingParams(max_tokens=4, min_tokens=4, temperature=0.0))
    assert _steps(engine, 6) == []
    assert engine.stats().num_running == 1 and engine.stats().num_waiting == 1  # one slot: "next" waits
    used = engine.scheduler.block_manager.num_free_blocks

    output = engine.cancel_request("long", "cancelled")

    assert output is not None and output.finish_reason == "cancelled"
    assert 0 < len(output.token_ids) < 500 and output.text == engine.tokenizer.decode(output.token_ids)
    assert engine.scheduler.block_manager.num_free_blocks > used  # its blocks are back in the pool
    done = _steps(engine, 6)  # the waiting request takes the freed slot at the next step
    assert [o.request_id for o in done] == ["next"] and len(done[0].token_ids) == 4
    assert engine.cancel_request("long", "cancelled") is None  # gone: a second cancel finds nothing
    assert engine.cancel_request("next", "cancelled") is None  # finished already
    assert not engine.has_unfinished()


def test_the_partial_output_is_what_an_uncancelled_run_generated_up_to_that_point() -> None:
    params = SamplingParams(max_tokens=40, min_tokens=40, temperature=0.0)
    full = LLMEngine("builtin:tiny", seed=0)
    full.add_request("a", "the same prompt", params)
    [reference] = _steps(full, 60)
    engine = LLMEngine("builtin:tiny", seed=0)
    engine.add_request("a", "the same prompt", params)
    _steps(engine, 12)
    partial = engine.cancel_request("a", "deadline")
    assert partial is not None and partial.finish_reason == "deadline"
    assert partial.token_ids == reference.token_ids[: len(partial.token_ids)] and 0 < len(partial.token_ids) < 40
