"""Fair shares in the engine's waiting queue (`LLMEngine.add_request(..., share=)`): every kind of request runs in
its share (generated text, a grammar still compiling, scores, label probabilities, embeddings), a share with nothing
running is admitted before another share's backlog, and the order changes no request's output."""

from __future__ import annotations

import pytest

from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.engine.pooling import PoolingParams
from tokenmill.sampling_params import SamplingParams

BACKLOG = 8


def _run(shares: bool) -> tuple[list[str], dict[str, object]]:
    """Requests of each kind queued behind one share's backlog, on an engine running two at a time: the order they end
    in, and each one's output."""
    engine = LLMEngine("builtin:tiny", max_num_seqs=2, max_model_len=96, block_size=4, seed=0)
    backlog = "run-big" if shares else None
    late = "run-small" if shares else None
    greedy = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    for i in range(BACKLOG):
        engine.add_request(f"big-{i}", f"row {i} of the backlog", greedy, share=backlog)
    engine.add_request("text", "a late prompt", SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True), share=late)
    engine.add_request("json", "a late json", SamplingParams(max_tokens=8, temperature=0.0, json_schema={"type": "integer"}),
                       share=late)
    engine.add_score_request("score", "a late score", [" yes", " no"], share=late)
    engine.add_request("label", "a late label", SamplingParams(choice=[" yes", " no"], choice_probabilities=True),
                       share=late)
    engine.add_request("embed", "a late embedding", pooling=PoolingParams(pooling="mean"), share=late)
    order, outputs = [], {}
    while engine.has_unfinished():
        for output in engine.step():
            order.append(output.request_id)
            scores = [score.logprob for score in output.scores] if output.scores else None
            outputs[output.request_id] = (output.token_ids, output.finish_reason,
                                          scores or output.choice_probabilities or output.embedding)
    return order, outputs


def test_a_share_with_nothing_running_goes_before_another_shares_backlog() -> None:
    order, outputs = _run(shares=True)
    late = ["text", "json", "score", "label", "embed"]
    assert set(order) == {f"big-{i}" for i in range(BACKLOG)} | set(late)
    last_late = max(order.index(request_id) for request_id in late)
    # two running at a time, the late share taking a slot as each backlog job ends: at most half the backlog first
    assert sum(request_id.startswith("big-") for request_id in order[:last_late]) <= BACKLOG // 2, order
    fifo_order, fifo_outputs = _run(shares=False)
    assert fifo_order[:BACKLOG - 1] == [f"big-{i}" for i in range(BACKLOG - 1)], fifo_order  # the backlog first
    # only the order changed: the same tokens, and the same numbers up to the float32 noise of other batches
    assert {key: value[:2] for key, value in outputs.items()} == {key: value[:2] for key, value in fifo_outputs.items()}
    for request_id in ("score", "label", "embed"):
        numbers, fifo_numbers = outputs[request_id][2], fifo_outputs[request_id][2]
        if isinstance(numbers, dict):
            numbers, fifo_numbers = list(numbers.values()), [fifo_numbers[label] for label in numbers]
        assert numbers and numbers == pytest.approx(fifo_numbers, rel=1e-5, abs=1e-5), request_id


def test_every_sequence_of_a_scoring_request_is_in_its_share() -> None:
    """A score or label-probability request runs as several sequences, its forks started later (`ScoreGroup`): each
    is admitted in the request's share, not as work of no share."""
    engine = LLMEngine("builtin:tiny", max_num_seqs=8, max_model_len=96, block_size=4, seed=0)
    engine.add_score_request("score", "a prompt", [" ab", " cd"], share="tenant-a")
    engine.add_request("label", "a prompt", SamplingParams(choice=[" yes", " no"], choice_probabilities=True),
                       share="tenant-b")
    groups = {request_id: engine._groups[request_id] for request_id in ("score", "label")}
    assert all(len(group.sequences) > 1 for group in groups.values())  # forks to come, beside the prompt's
    while engine.has_unfinished():
        engine.step()
    assert {request_id: {seq.share for seq in group.sequences} for request_id, group in groups.items()} == {
        "score": {"tenant-a"}, "label": {"tenant-b"}}
