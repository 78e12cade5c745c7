"""Label probabilities (`choice_probabilities`) and `LLM.score`: each continuation's log-probability given the prompt
must be transformers' own (float32, CPU, to 1e-5), with the prompt computed once and its K/V shared by the
continuations (forked from it, or found in the prefix cache)."""

from __future__ import annotations

import dataclasses
import math
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from model_fixtures import random_prompts  # noqa: E402
from tokenmill import LLM, SamplingParams  # noqa: E402
from tokenmill.engine import transfer  # noqa: E402
from tokenmill.engine.llm_engine import LLMEngine  # noqa: E402
from tokenmill.engine.scoring import ScoreGroup  # noqa: E402
from tokenmill.errors import InvalidRequestError  # noqa: E402
from tokenmill.queue.schemas import Job, JobResult, message_wire  # noqa: E402
from tokenmill.scheduler.scheduler import Scheduler, SchedulerConfig  # noqa: E402
from tokenmill.scheduler.sequence import Sequence  # noqa: E402
from tokenmill.worker.admission import Attempt  # noqa: E402
from tokenmill.worker.output import EngineOutput, output_fields, result_wire  # noqa: E402

TOLERANCE = 1e-5
# A log-probability is as exact as float32 makes its magnitude: the engine's order of computation (paged, chunked,
# forked attention) is not transformers', so a value or a sum of them may differ by 32 to 64 float32 ulps of itself,
# a relative 32 * 2**-23 (a token's -8.4 or a choice's total of -32 can be off by more than 1e-5).
LOGPROB_REL = 32 * 2**-23
LABELS = ["positive", "negative", "neutral"]


@pytest.fixture(scope="module")
def reference(model_dirs: dict[str, Path]):  # noqa: ANN201 - a function
    """`reference(prompt_ids, continuation_ids) -> (token logprobs, is greedy)` by transformers on the llama model."""
    model = AutoModelForCausalLM.from_pretrained(model_dirs["llama"], dtype=torch.float32, attn_implementation="sdpa")

    @torch.no_grad()
    def score(prompt: list[int], continuation: list[int]) -> tuple[list[float], bool]:
        logits = model(torch.tensor([prompt + continuation])).logits[0].float()
        rows = logits[len(prompt) - 1 : len(prompt) + len(continuation) - 1]
        logprobs = torch.log_softmax(rows, dim=-1)
        target = torch.tensor(continuation)
        return logprobs.gather(1, target[:, None])[:, 0].tolist(), bool((rows.argmax(-1) == target).all())

    return score


def llama(model_dirs: dict[str, Path], **options: object) -> LLM:
    return LLM(str(model_dirs["llama"]), dtype="float32", **options)


def encode(llm: LLM, text: str) -> list[int]:
    return llm.tokenizer.encode(text, add_special_tokens=False)


def expected_distribution(reference, prompt: list[int],  # noqa: ANN001 - the fixture's function
                          choices: list[list[int]]) -> tuple[list[float], list[float]]:
    """(each choice's total log-probability, their normalised probabilities) by transformers."""
    totals = [math.fsum(reference(prompt, choice)[0]) for choice in choices]
    top = max(totals)
    weights = [math.exp(total - top) for total in totals]
    return totals, [weight / sum(weights) for weight in weights]


@pytest.mark.parametrize(("budget", "block_size", "max_num_seqs"), [(4096, 16, 256), (64, 16, 256), (7, 1, 256),
                                                                   (64, 16, 2)])
def test_choice_logprobs_equal_transformers(model_dirs, reference, random_seed: int, budget: int, block_size: int,
                                            max_num_seqs: int) -> None:
    """Forked from the prompt's K/V, or (`max_num_seqs=2`: no slot to fork into, at most 2 scored rows a step)
    queued and served from the prefix cache, the same log-probabilities as transformers."""
    llm = llama(model_dirs, max_num_batched_tokens=budget, block_size=block_size, max_num_seqs=max_num_seqs)
    rng = random.Random(random_seed)
    prompts = random_prompts(6 if budget > 7 else 2, 1, 90, seed=random_seed)
    choices = [["".join(rng.choice("abcdefgh ") for _ in range(rng.randint(1, 6))) for _ in range(rng.randint(2, 5))]
               for _ in prompts]
    choices = [list(dict.fromkeys(c)) for c in choices]
    params = [SamplingParams(choice=c, choice_probabilities=True) for c in choices]
    for prompt, labels, out in zip(prompts, choices, llm.generate(prompts, params, use_tqdm=False)):
        tokens = [encode(llm, label) for label in labels]
        totals, probabilities = expected_distribution(reference, prompt, tokens)
        assert out.finish_reason == "stop" and out.error is None
        assert list(out.choice_logprobs) == labels == list(out.choice_probabilities)
        for label, total, probability in zip(labels, totals, probabilities):
            assert out.choice_logprobs[label] == pytest.approx(total, abs=TOLERANCE, rel=LOGPROB_REL)
            assert out.choice_probabilities[label] == pytest.approx(probability, abs=TOLERANCE)
        assert math.fsum(out.choice_probabilities.values()) == pytest.approx(1.0, abs=1e-12)
        best = max(labels, key=out.choice_probabilities.__getitem__)
        assert out.text == best and out.token_ids == encode(llm, best) and out.constraint_satisfied is True
        for score, choice in zip(out.scores, tokens):  # each token, not only their sums
            assert score.token_ids == choice
            assert score.token_logprobs == pytest.approx(reference(prompt, choice)[0], abs=TOLERANCE, rel=LOGPROB_REL)
    assert llm.engine.scheduler.block_manager.num_free_blocks == llm.engine.scheduler.block_manager.num_blocks


def test_choices_sharing_their_first_tokens_get_their_own_probabilities(model_dirs, reference) -> None:
    """First-token logprobs would give "positive", "postal" and "pose" the same score: the whole sequence does not."""
    llm = llama(model_dirs)
    prompt, labels = random_prompts(1, 30, 30, seed=5)[0], ["positive", "postal", "pose"]
    out = llm.generate([prompt], SamplingParams(choice=labels, choice_probabilities=True), use_tqdm=False)[0]
    first = {score.token_logprobs[0] for score in out.scores}
    assert len(first) == 1  # one shared first token ("p"), one logprob
    assert len(set(out.choice_probabilities.values())) == 3
    _, probabilities = expected_distribution(reference, prompt, [encode(llm, label) for label in labels])
    assert list(out.choice_probabilities.values()) == pytest.approx(probabilities, abs=TOLERANCE)


def test_in_a_batch_with_generating_requests(model_dirs) -> None:
    """Plain, constrained and probability requests in one batch: each gets what it gets alone."""
    prompts = random_prompts(8, 5, 60, seed=9)
    params = [SamplingParams(max_tokens=6, temperature=0.0), SamplingParams(choice=LABELS, temperature=0.0),
              SamplingParams(choice=LABELS, choice_probabilities=True), SamplingParams(max_tokens=5, seed=3)] * 2
    together = llama(model_dirs, max_num_batched_tokens=128).generate(prompts, params, use_tqdm=False)
    alone_llm = llama(model_dirs)
    for prompt, p, out in zip(prompts, params, together):
        alone = alone_llm.generate([prompt], p, use_tqdm=False)[0]
        assert (out.text, out.token_ids, out.finish_reason) == (alone.text, alone.token_ids, alone.finish_reason)
        if p.choice_probabilities:
            assert out.choice_probabilities == pytest.approx(alone.choice_probabilities, abs=TOLERANCE)
        else:
            assert out.choice_probabilities is None and out.scores is None


@pytest.mark.parametrize(("block_size", "budget"), [(16, 4096), (1, 4096), (16, 48), (7, 5)])
def test_the_prompt_is_computed_once(model_dirs, block_size: int, budget: int) -> None:
    """The prompt is computed once, even chunked over several steps, and with it the first choice's tokens but the
    last; then each other choice computes its own tokens but the last, from the prompt's K/V (its full blocks
    shared, its partial last block copied)."""
    llm = llama(model_dirs, block_size=block_size, max_num_batched_tokens=budget)
    prompt = random_prompts(1, 100, 100, seed=4)[0]
    labels = ["alpha", "beta", "gamma", "delta", "epsilon", "z"]
    out = llm.generate([prompt], SamplingParams(choice=labels, choice_probabilities=True), use_tqdm=False)[0]
    stats = llm.engine.stats()
    forked = [label for label in labels[1:] if len(label) > 1]  # a one-token choice is scored by the prompt's row
    assert stats.num_prefix_hit_tokens == len(forked) * len(prompt) == out.num_cached_tokens
    assert stats.num_prompt_tokens == len(prompt) + len(labels[0]) - 1 + sum(len(prompt) + len(label) - 1
                                                                            for label in forked)
    computed = stats.num_prompt_tokens - stats.num_prefix_hit_tokens
    assert computed == len(prompt) + sum(len(label) - 1 for label in labels)
    assert stats.num_generated_tokens == 0  # nothing sampled
    if budget >= len(prompt):
        assert stats.num_steps == 2  # the prompt, then every continuation


SHARED = ["pos", "pose", "positive", "postal", "negative", "neg", "p", "neutral"]


def proper_prefixes(labels: list[str]) -> set[str]:
    return {label[:end] for label in labels for end in range(1, len(label))}


@pytest.mark.parametrize(("block_size", "budget", "max_num_seqs"), [(16, 4096, 256), (1, 4096, 256), (7, 5, 256),
                                                                   (16, 4096, 2)])
def test_shared_prefixes_are_computed_once(model_dirs, reference, block_size: int, budget: int,
                                           max_num_seqs: int) -> None:
    """Labels sharing prefixes, one a prefix of others, one a single token: each distinct proper prefix is computed
    once (`max_num_seqs=2`: the forks queue and recompute the prefix cache's partial block), and every label's
    probability is transformers' own."""
    llm = llama(model_dirs, block_size=block_size, max_num_batched_tokens=budget, max_num_seqs=max_num_seqs)
    prompt = random_prompts(1, 40, 40, seed=11)[0]
    out = llm.generate([prompt], SamplingParams(choice=SHARED, choice_probabilities=True), use_tqdm=False)[0]
    totals, probabilities = expected_distribution(reference, prompt, [encode(llm, label) for label in SHARED])
    assert list(out.choice_logprobs.values()) == pytest.approx(totals, abs=TOLERANCE, rel=LOGPROB_REL)
    assert list(out.choice_probabilities.values()) == pytest.approx(probabilities, abs=TOLERANCE)
    stats = llm.engine.stats()
    if max_num_seqs > 2:
        assert stats.num_prompt_tokens - stats.num_prefix_hit_tokens == len(prompt) + len(proper_prefixes(SHARED))
    scheduler = llm.engine.scheduler
    assert scheduler.block_manager.num_free_blocks == scheduler.block_manager.num_blocks
    assert scheduler.num_reserved == 0 and not llm.engine._groups


def test_forks_find_the_slots_kept_for_them(model_dirs) -> None:
    """More rows than running slots: a request starts only with slots for its forks, so none queues and recomputes
    the prompt's partial block from the prefix cache."""
    llm = llama(model_dirs, max_num_seqs=7)
    prompts = random_prompts(8, 30, 60, seed=12)
    labels = ["alpha", "beta", "gamma"]
    llm.generate(prompts, SamplingParams(choice=labels, choice_probabilities=True), use_tqdm=False)
    stats = llm.engine.stats()
    computed = stats.num_prompt_tokens - stats.num_prefix_hit_tokens
    assert computed == sum(map(len, prompts)) + len(prompts) * sum(len(label) - 1 for label in labels)


def test_the_trie_is_split_into_forked_paths() -> None:
    """The prompt's sequence follows the first computed child down the trie; each other computed child at its nodes
    forks from it at that node, and goes on the same way."""
    group = ScoreGroup("r", [9, 9], [[1, 2, 3], [1, 4, 5, 6], [7, 8], [1, 2], [7]], None, 0.0)
    assert [(seq.token_ids, seq.fork_at, seq.targets) for seq in group.sequences] == [
        ([9, 9, 1, 2], 0, ((1, 7), (2, 4), (3,))),
        ([9, 9, 7], 2, ((8,),)),
        ([9, 9, 1, 4, 5], 3, ((5,), (6,))),
    ]
    assert list(group.prompt.forks) == group.sequences[1:] and group.prompt.num_forks == 2
    for seq, value in zip(group.sequences, (-1.0, -2.0, -3.0)):
        seq.logprobs = [[value * (k + 1) - index for index in range(len(tokens))]
                        for k, tokens in enumerate(seq.targets)]
        seq.greedy = [(True,) * len(tokens) for tokens in seq.targets]
    assert [score.token_logprobs for score in group.scores()] == [
        [-1.0, -2.0, -3.0], [-1.0, -3.0, -3.0, -6.0], [-2.0, -2.0], [-1.0, -2.0], [-2.0]]


def test_score_equals_transformers_with_greedy_flags(model_dirs, reference) -> None:
    llm = llama(model_dirs)
    prompt = random_prompts(1, 40, 40, seed=2)[0]
    greedy = llm.generate([prompt], SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True), use_tqdm=False)[0]
    other = greedy.token_ids[:3] + [(greedy.token_ids[3] + 1) % 256]
    continuations = [greedy.token_ids, other, "ab c", [7]]
    scores = llm.score(prompt, continuations)
    assert [s.is_greedy for s in scores[:2]] == [True, False]
    for score, continuation in zip(scores, continuations):
        tokens = encode(llm, continuation) if isinstance(continuation, str) else continuation
        logprobs, is_greedy = reference(prompt, tokens)
        assert score.token_ids == tokens and score.is_greedy == is_greedy
        assert score.logprob == pytest.approx(math.fsum(logprobs), abs=TOLERANCE, rel=LOGPROB_REL)
        assert score.token_logprobs == pytest.approx(logprobs, abs=TOLERANCE, rel=LOGPROB_REL)


def test_score_batch_keeps_order_and_refuses_alone(model_dirs) -> None:
    llm = llama(model_dirs)
    prompts = random_prompts(3, 5, 20, seed=6)
    outs = llm.score_batch([(prompts[0], ["a", "b"]), (prompts[1], []), (prompts[2], [[999999]])], use_tqdm=False)
    assert [o.finish_reason for o in outs] == ["stop", "error", "error"]
    assert outs[1].error.startswith("continuations:") and outs[2].error.startswith("continuations[0]:")
    assert [s.token_ids for s in outs[0].scores] == [encode(llm, "a"), encode(llm, "b")]
    with pytest.raises(InvalidRequestError) as raised:
        llm.score(prompts[0], [""])
    assert raised.value.field == "continuations[0]"


def test_engine_api_preemption_and_cancel(model_dirs, reference) -> None:
    """Through `add_request`/`step`, in a KV pool small enough to preempt: the same probabilities, every block back."""
    engine = LLMEngine(str(model_dirs["llama"]), dtype="float32", num_kv_blocks=24, block_size=16,
                       max_num_batched_tokens=64)
    prompts = random_prompts(6, 120, 200, seed=8)
    for i, prompt in enumerate(prompts):
        params = (SamplingParams(choice=LABELS, choice_probabilities=True) if i % 2 else
                  SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))
        engine.add_request(f"r{i}", prompt, params)
    engine.add_request("gone", prompts[0], SamplingParams(choice=LABELS, choice_probabilities=True))
    cancelled = engine.cancel_request("gone", "cancelled")
    assert cancelled is not None and cancelled.finish_reason == "cancelled" and cancelled.choice_probabilities is None
    outputs = {}
    while engine.has_unfinished():
        outputs.update((o.request_id, o) for o in engine.step())
    assert engine.stats().num_preemptions > 0
    assert engine.scheduler.block_manager.num_free_blocks == 24 and not engine._groups
    tokens = [engine.tokenizer.encode(label, add_special_tokens=False) for label in LABELS]
    for i in range(1, len(prompts), 2):
        _, probabilities = expected_distribution(reference, prompts[i], tokens)
        assert list(outputs[f"r{i}"].choice_probabilities.values()) == pytest.approx(probabilities, abs=TOLERANCE)


def test_choice_probabilities_is_checked_and_travels_the_wire() -> None:
    with pytest.raises(InvalidRequestError) as raised:
        SamplingParams(choice_probabilities=True)
    assert raised.value.field == "choice_probabilities"
    with pytest.raises(InvalidRequestError):
        SamplingParams(choice=LABELS, choice_probabilities=1)
    job = Job.from_wire({"prompt": "hi", "choice": LABELS, "choice_probabilities": True})
    assert job.sampling.choice_probabilities is True
    assert SamplingParams.from_dict(job.sampling.to_dict()) == job.sampling
    assert "choice_probabilities" not in message_wire(Job.from_wire({"prompt": "hi"}).to_wire())["sampling"]


def test_the_job_result_carries_the_probabilities() -> None:
    llm = LLM("builtin:tiny")
    out = llm.generate(["Sentiment of: fine"], SamplingParams(choice=LABELS, choice_probabilities=True),
                       use_tqdm=False)[0]
    fields = output_fields(out)
    engine_output = EngineOutput(**fields)
    job = Job.from_wire({"prompt": "Sentiment of: fine", "choice": LABELS, "choice_probabilities": True})
    wire = result_wire(job, Attempt(job, 1.7e9, 1), engine_output, "w1")
    result = JobResult.model_validate(wire)
    assert result.status == "succeeded" and result.text == out.text
    assert result.choice_probabilities == out.choice_probabilities
    assert result.stub("s3://b/j.json").choice_probabilities is None
    plain = EngineOutput(**output_fields(dataclasses.replace(out, choice_probabilities=None)))
    assert result_wire(job, Attempt(job, 1.7e9, 1), plain, "w1")["choice_probabilities"] is None


def test_fork_shares_full_blocks_and_copies_the_partial_one() -> None:
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=3, block_size=4, num_blocks=8))
    params = SamplingParams(max_tokens=1)
    parent = Sequence("p", list(range(10)), params, num_scored_tokens=1)
    scheduler.add(parent)
    batch = scheduler.schedule()
    scheduler.update(batch, [])
    children = [Sequence("p", list(range(10)) + [t, t], params, num_scored_tokens=2) for t in (20, 21, 22)]
    copies = scheduler.fork(parent, children)
    assert copies == [(parent.block_table[2], child.block_table[2]) for child in children[:2]]
    assert children[0].block_table[:2] == children[1].block_table[:2] == parent.block_table[:2]
    assert children[0].num_computed_tokens == 10 and children[2] is scheduler.waiting.first()  # no slot left: queued
    assert [scheduler.block_manager.blocks[b].ref_count for b in parent.block_table] == [3, 3, 1]
    for seq in [parent, *children]:
        scheduler.finish(seq, "stop")
    assert scheduler.block_manager.num_free_blocks == 8


def test_forks_to_come_keep_their_slots_and_fork_at_their_length() -> None:
    """A sequence with forks to come is admitted only with slots for them (alone, always); a fork takes the parent's
    K/V up to its own length: the full blocks before it shared, the partial one copied."""
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=4, block_size=4, num_blocks=16))
    params = SamplingParams(max_tokens=1)
    first = Sequence("a", list(range(10)), params, num_scored_tokens=1, num_forks=2)
    second = Sequence("b", list(range(20, 30)), params, num_scored_tokens=1, num_forks=2)
    scheduler.add(first)
    scheduler.add(second)
    batch = scheduler.schedule()
    assert batch.seqs == [first] and scheduler.num_reserved == 2  # the second needs 3 slots: 1 is left
    scheduler.update(batch, [])
    children = [Sequence("a", list(range(10)) + [40, 41], params, num_scored_tokens=2),
                Sequence("a", list(range(5)) + [42, 43], params, num_scored_tokens=2)]
    copies = scheduler.fork(first, children, [10, 5])
    assert scheduler.num_reserved == 0 and [child.num_computed_tokens for child in children] == [10, 5]
    assert copies == [(first.block_table[2], children[0].block_table[2]),
                      (first.block_table[1], children[1].block_table[1])]
    assert children[0].block_table[:2] == first.block_table[:2] and children[1].block_table[:1] == first.block_table[:1]
    scheduler.finish(first, "stop")
    assert scheduler.schedule().seqs == children  # 2 running + 3 for the second > 4
    for child in children:
        scheduler.finish(child, "stop")
    alone = Scheduler(SchedulerConfig(max_num_seqs=2, block_size=4, num_blocks=16))
    alone.add(Sequence("c", list(range(6)), params, num_scored_tokens=1, num_forks=5))
    assert len(alone.schedule().seqs) == 1 and alone.num_reserved == 5


def test_each_step_reads_the_device_once(model_dirs) -> None:
    """Scores come back in the sampler's one read-back, also in steps that sample nothing."""
    engine = llama(model_dirs, max_num_batched_tokens=32).engine
    for i, prompt in enumerate(random_prompts(3, 20, 60, seed=1)):
        engine.add_request(f"p{i}", prompt, SamplingParams(choice=LABELS, choice_probabilities=True))
        engine.add_request(f"g{i}", prompt, SamplingParams(max_tokens=4, temperature=0.0))
    while engine.has_unfinished():
        before = transfer.read_backs
        engine.step()
        assert transfer.read_backs - before == 1


def test_the_triton_backend_scores_as_the_torch_one(model_dirs) -> None:
    """The Triton kernels (the interpreter without CUDA) over forked continuations: partial blocks copied."""
    prompts = random_prompts(2, 9, 30, seed=3)
    params = SamplingParams(choice=["ab", "abc", "b d"], choice_probabilities=True)
    outputs = {backend: llama(model_dirs, attention_backend=backend, block_size=5, max_num_batched_tokens=32,
                              num_kv_blocks=64).generate(prompts, params, use_tqdm=False)
               for backend in ("triton", "torch")}
    for triton, reference in zip(outputs["triton"], outputs["torch"]):
        assert triton.choice_logprobs == pytest.approx(reference.choice_logprobs, abs=TOLERANCE, rel=LOGPROB_REL)


def test_the_benchmark_runs(tmp_path: Path) -> None:
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "label_probabilities.py"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, str(script), "--models", "tiny", "--rows", "4", "--repeats", "1"],
                          capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert [line.split("|")[1:3] for line in done.stdout.splitlines() if line.startswith("| tiny")] == [
        [" tiny ", " 3 "], [" tiny ", " 10 "], [" tiny ", " 10 nested "]]


def test_a_step_scores_at_most_max_num_seqs_positions() -> None:
    """Scored rows are logits rows: the planner cuts a scoring chunk to the `max_num_seqs` the memory profile allows."""
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=3, block_size=4, num_blocks=16))
    seqs = [Sequence("s", list(range(k, k + 12)), SamplingParams(max_tokens=1), num_scored_tokens=5) for k in (0, 50)]
    for seq in seqs:
        scheduler.add(seq)
    chunks = []
    while scheduler.has_unfinished():
        batch = scheduler.schedule()
        scored = [max(0, s.num_computed_tokens + n - max(s.num_computed_tokens, 7)) for s, n in
                  zip(batch.seqs, batch.num_new_tokens)]
        assert sum(scored) <= 3 and not any(batch.sample_mask)
        chunks.append(batch.num_new_tokens)
        scheduler.update(batch, [])
        for seq in [s for s in seqs if s.num_computed_tokens == s.num_tokens and not s.is_finished]:
            scheduler.finish(seq, "stop")
    assert chunks == [[10, 7], [2, 1], [3], [1]]  # positions 7-11 score: 3, then 2 + 1, 3, 1
