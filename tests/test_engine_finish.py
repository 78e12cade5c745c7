"""The step's finish check: it asks `_finish_reason` only of requests that could finish (a stop token, their
length limit, or anything beyond those two: stop strings, a grammar, min_tokens). Nothing it skips is done."""

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
            if request.seq.num_output_tokens:
                assert engine._finish_reason(request) is None, (request.seq.request_id, request.seq.token_ids)
    assert set(finished) == set(params)
    for request_id, output in finished.items():
        p, tokens = params[request_id], output.token_ids
        stop_ids = set(p.stop_token_ids) | (set() if p.ignore_eos else engine.eos_ids)
        if output.finish_reason == "length":
            assert len(tokens) == p.max_tokens, output
        else:
            assert output.finish_reason == "stop" and tokens[-1] in stop_ids and len(tokens) >= p.min_tokens, output
