"""The step's per-request shortcuts lose nothing. The finish check asks `_finish_reason` only of requests that
could finish (a stop token, their length limit, or anything beyond those two: stop strings, a grammar,
min_tokens), so nothing it skips may be done; sampling rows are updated only where they change, so every
row the sampler sees must still hold its request's state."""

from __future__ import annotations

import random

from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.sampling_params import SamplingParams


def test_no_running_request_is_past_its_end_after_any_step(random_seed: int) -> None:
    rng = random.Random(random_seed)
    engine = LLMEngine("builtin:tiny", max_num_seqs=8, max_model_len=48, block_size=4, seed=random_seed)
    vocab = engine.runner.vocab_size
    params = {}
    for i in range(24):
        prompt = [rng.randrange(4, vocab) for _ in range(rng.randint(1, 30))]
        max_tokens = rng.randint(1, 48 - len(prompt)) if rng.random() < 0.7 else 48 - len(prompt)  # at max_model_len
        params[str(i)] = SamplingParams(
            max_tokens=max_tokens, temperature=rng.choice([0.0, 1.0]), seed=i, ignore_eos=rng.random() < 0.5,
            min_tokens=min(max_tokens, rng.choice([0, 0, 0, 2])), stop_token_ids=rng.sample(range(vocab), rng.choice([0, 0, 8])))
        engine.add_request(str(i), prompt, params[str(i)])
    finished = {}
    while engine.has_unfinished():
        for output in engine.step():
            finished[output.request_id] = output
        for request in engine.requests.values():  # nothing still running should have finished
            if request.num_output_tokens:
                assert engine._finish_reason(request) is None, (request.request_id, request.token_ids)
    assert set(finished) == set(params)
    for request_id, output in finished.items():
        p, tokens = params[request_id], output.token_ids
        stop_ids = set(p.stop_token_ids) | (set() if p.ignore_eos else engine.eos_ids)
        if output.finish_reason == "length":
            assert len(tokens) == p.max_tokens, output
        else:
            assert output.finish_reason == "stop" and tokens[-1] in stop_ids and len(tokens) >= p.min_tokens, output


def test_the_sampler_gets_each_row_at_its_current_position_and_suppression(random_seed: int) -> None:
    """Rows are built once and brought up to date only where they change (sampled requests: the output
    position seeds the noise; min_tokens: the stop ids are banned until it is reached). Every row the
    sampler sees must hold the request's state at that step."""
    rng = random.Random(random_seed)
    engine = LLMEngine("builtin:tiny", max_num_seqs=6, block_size=4, seed=random_seed)
    vocab = engine.runner.vocab_size
    for i in range(10):
        prompt = [rng.randrange(4, vocab) for _ in range(rng.randint(1, 12))]
        max_tokens = rng.randint(3, 12)
        engine.add_request(str(i), prompt, SamplingParams(
            max_tokens=max_tokens, temperature=rng.choice([0.0, 0.8]), seed=i,
            min_tokens=rng.choice([0, 3]), stop_token_ids=rng.sample(range(vocab), 4)))
    seen = []
    execute = engine.runner.execute

    def checked(batch, rows, feed=None):  # noqa: ANN001, ANN202 - calls through: the real runner and sampler run
        for seq, row in zip([s for s, f in zip(batch.seqs, batch.sample_mask) if f], rows):
            request = engine.requests[seq.request_id]
            assert row is request.row and row.token_ids is seq.token_ids
            if not seq.params.greedy:
                assert row.num_output_tokens == seq.num_output_tokens, seq.request_id
            banned = seq.params.min_tokens > seq.num_output_tokens
            assert bool(row.suppressed_ids) == banned, (seq.request_id, seq.num_output_tokens)
            assert row.argmax_only == (seq.params.greedy and not banned), seq.request_id
            seen.append((seq.params.greedy, seq.num_output_tokens))
        return execute(batch, rows, feed)

    engine.runner.execute = checked
    while engine.has_unfinished():
        engine.step()
        if engine.requests and rng.random() < 0.05:  # the engine's counts of changing rows follow a cancel too
            engine.cancel_request(rng.choice(sorted(engine.requests)), "cancelled")
    assert any(not greedy and n > 1 for greedy, n in seen)  # sampled rows seen past their first tokens
