"""Sampling: seeded reproducibility, filters, penalties, stops, logprobs, and bad input per request."""

from __future__ import annotations

import math
import random
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from model_fixtures import random_prompts
from tokenmill import LLM, InvalidRequestError, SamplingParams
from tokenmill.engine.llm_engine import StopMatcher
from tokenmill.engine.sampler import Sampler, SamplingRow, exponential_noise


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM("builtin:tiny", max_num_batched_tokens=256)


def test_seeded_sampling_is_the_same_alone_and_in_a_batch_of_32(llm: LLM) -> None:
    prompts = random_prompts(32, 5, 120, seed=21)
    params = [SamplingParams(max_tokens=24, temperature=0.9, top_p=0.95, top_k=50, seed=1000 + i) for i in range(32)]
    batched = llm.generate(prompts, params, use_tqdm=False)
    for index in (0, 13, 31):
        alone = llm.generate([prompts[index]], [params[index]], use_tqdm=False)[0]
        assert alone.token_ids == batched[index].token_ids
    reseeded = llm.generate([prompts[0]], SamplingParams(max_tokens=24, temperature=0.9, seed=7), use_tqdm=False)[0]
    assert reseeded.token_ids != batched[0].token_ids  # the seed really drives the draw


def test_unseeded_requests_differ_and_greedy_ignores_seed(llm: LLM) -> None:
    prompt = random_prompts(1, 10, 10, seed=5)[0]
    runs = llm.generate([prompt] * 4, SamplingParams(max_tokens=16, temperature=1.0), use_tqdm=False)
    assert len({tuple(o.token_ids) for o in runs}) > 1
    greedy = llm.generate([prompt] * 2, [SamplingParams(max_tokens=16, temperature=0.0, seed=s) for s in (1, 2)],
                          use_tqdm=False)
    assert greedy[0].token_ids == greedy[1].token_ids


@pytest.mark.parametrize("filters", [dict(top_k=1), dict(top_p=1e-6), dict(min_p=1.0)])
def test_filters_that_keep_one_token_equal_greedy(llm: LLM, filters: dict) -> None:
    prompts = random_prompts(6, 5, 40, seed=8)
    greedy = llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0.0), use_tqdm=False)
    filtered = llm.generate(prompts, SamplingParams(max_tokens=12, temperature=1.5, seed=3, **filters), use_tqdm=False)
    assert [o.token_ids for o in filtered] == [o.token_ids for o in greedy]


def test_exponential_race_matches_the_distribution() -> None:
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    seeds = torch.arange(20_000, dtype=torch.int64)
    noise = exponential_noise(seeds, torch.zeros_like(seeds), 4)
    counts = torch.bincount((probs[None, :] / noise).argmax(dim=-1), minlength=4).float() / len(seeds)
    assert torch.allclose(counts, probs, atol=0.015), counts


def test_repetition_penalty_matches_transformers(model_dirs: dict[str, Path]) -> None:
    prompts = random_prompts(4, 10, 60, seed=9)
    model = AutoModelForCausalLM.from_pretrained(model_dirs["llama"], dtype=torch.float32)
    expected = [model.generate(torch.tensor([p]), max_new_tokens=16, do_sample=False, repetition_penalty=1.8)[0, len(p):].tolist()
                for p in prompts]
    engine = LLM(str(model_dirs["llama"]))
    actual = engine.generate(prompts, SamplingParams(max_tokens=16, temperature=0.0, repetition_penalty=1.8), use_tqdm=False)
    assert [o.token_ids for o in actual] == expected
    plain = engine.generate(prompts, SamplingParams(max_tokens=16, temperature=0.0), use_tqdm=False)
    assert [o.token_ids for o in plain] != expected


def test_stop_token_ids_min_tokens_and_ignore_eos(llm: LLM) -> None:
    prompt = random_prompts(1, 20, 20, seed=4)[0]
    free = llm.generate([prompt], SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True), use_tqdm=False)[0]
    stop_at = free.token_ids[5]
    first = free.token_ids.index(stop_at)
    stopped = llm.generate([prompt], SamplingParams(max_tokens=30, temperature=0.0, stop_token_ids=[stop_at]), use_tqdm=False)[0]
    assert stopped.finish_reason == "stop" and stopped.token_ids == free.token_ids[: first + 1]
    held = llm.generate([prompt], SamplingParams(max_tokens=30, temperature=0.0, stop_token_ids=[stop_at],
                                                 min_tokens=first + 3), use_tqdm=False)[0]
    assert len(held.token_ids) >= first + 3 and stop_at not in held.token_ids[: first + 3]
    assert free.finish_reason == "length" and len(free.token_ids) == 30


def test_stop_strings_cut_the_text(llm: LLM) -> None:
    prompt = "hello there"
    free = llm.generate([prompt], SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True), use_tqdm=False)[0]
    text = free.text
    stop = next(text[i : i + 2] for i in range(5, len(text) - 2) if text[i : i + 2].isprintable() and text[i : i + 2].strip())
    cut = llm.generate([prompt], SamplingParams(max_tokens=40, temperature=0.0, stop=[stop]), use_tqdm=False)[0]
    assert cut.finish_reason == "stop"
    assert cut.text == text[: text.index(stop)]
    assert len(cut.token_ids) < len(free.token_ids)


def test_stop_strings_match_across_steps_overlapping_and_after_min_tokens(llm: LLM) -> None:
    """Engine outputs with several stop strings, one split across tokens (two characters, one byte each), are a
    full search's: the text up to the earliest stop; one seen during min_tokens still stops right after."""
    prompt = "stop strings"
    text = llm.generate([prompt], SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True), use_tqdm=False)[0].text
    late, early = text[40:43], text[20:22]
    for stops in ([late], [late, early], [early + text[22], early], [text[21:23], text[20:23]]):
        expected = min(text.index(s) for s in stops)
        cut = llm.generate([prompt], SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True, stop=stops),
                           use_tqdm=False)[0]
        assert (cut.finish_reason, cut.text) == ("stop", text[:expected]), stops
    held = llm.generate([prompt], SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True, stop=[early],
                                                 min_tokens=30), use_tqdm=False)[0]
    assert (held.finish_reason, held.text, len(held.token_ids)) == ("stop", text[: text.index(early)], 30)


class _Recorded(str):
    """A text that records where each `find` starts searching."""

    starts: list[int]

    def find(self, sub: str, start: int = 0, *rest: int) -> int:  # type: ignore[override]
        self.starts.append(start)
        return super().find(sub, start, *rest)


def test_stop_matching_searches_only_the_new_tail() -> None:
    """Each step searches the new characters plus `longest - 1` (and one the decoder may rewrite), not the text."""
    matcher = StopMatcher(["never", "xyz"])
    text = ""
    for step in range(200):
        previous = len(text)
        text += f"w{step % 10} "
        recorded = _Recorded(text)
        recorded.starts = []
        assert matcher.first_hit(recorded) is None
        assert len(recorded.starts) == 2 and min(recorded.starts) >= max(0, previous - 1 - (len("never") - 1)), step
    assert matcher.first_hit(text + "xy") is None
    assert matcher.first_hit(text + "xyz") == len(text)  # split across steps: "xy", then "z"


def test_stop_matching_equals_a_full_search_when_the_decoder_rewrites_its_tail(random_seed: int) -> None:
    """Random texts grown step by step, sometimes rewriting their end (an incomplete UTF-8 character completed)
    or an earlier character (a clean-up dropping a space): the first hit is always a full search's."""
    rng = __import__("random").Random(random_seed)
    alphabet = "ab \ufffd."
    for _ in range(300):
        stops = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(1, 5))]
        matcher, text = StopMatcher(stops), ""
        for _ in range(60):
            roll = rng.random()
            if roll < 0.15 and text:
                text = text[:-1] + rng.choice(alphabet)
            elif roll < 0.25 and len(text) > 3:
                cut = rng.randrange(len(text) - 3, len(text))
                text = text[:cut] + text[cut + 1 :]
            text += "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 3)))
            hits = [i for i in (text.find(s) for s in stops) if i >= 0]
            expected = min(hits) if hits else None
            assert matcher.first_hit(text) == expected, (stops, text)
            if expected is not None:
                break


def test_logprobs_are_normalised_and_include_the_chosen_token(llm: LLM) -> None:
    out = llm.generate(["abc"], SamplingParams(max_tokens=5, temperature=0.0, logprobs=3), use_tqdm=False)[0]
    assert len(out.logprobs) == 5
    for token, entry in zip(out.token_ids, out.logprobs):
        assert entry["token_id"] == token
        top = entry["top_logprobs"]
        assert len(top) == 3 and top[0][0] == token  # greedy picks the most likely token
        assert math.isclose(entry["logprob"], top[0][1], rel_tol=1e-6) and entry["logprob"] <= 0


def test_stream_yields_in_finishing_order_and_generate_in_input_order(llm: LLM) -> None:
    prompts = ["a", "b", "c"]
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (20, 2, 8)]
    assert [o.request_id for o in llm.stream(prompts, params)] == ["1", "2", "0"]
    assert [len(o.token_ids) for o in llm.generate(prompts, params, use_tqdm=False)] == [20, 2, 8]


def test_chat_applies_the_template(llm: LLM) -> None:
    out = llm.chat([[{"role": "user", "content": "hi"}]], SamplingParams(max_tokens=4), use_tqdm=False)[0]
    assert bytes(out.prompt_token_ids).decode() == "<|user|>\nhi\n<|assistant|>\n"


@pytest.mark.parametrize(
    ("prompt", "field"),
    [("", "prompt"), ([5, 400], "prompt_token_ids"), ([3, -1], "prompt_token_ids"), ("x" * 5000, "prompt"),
     (None, "prompt"), (3.5, "prompt")],
)
def test_a_bad_prompt_fails_alone(llm: LLM, prompt: object, field: str) -> None:
    outs = llm.generate(["fine", prompt, "also fine"], SamplingParams(max_tokens=4, temperature=0.0), use_tqdm=False)
    assert outs[1].finish_reason == "error" and outs[1].error.startswith(field + ":")
    assert [o.finish_reason for o in (outs[0], outs[2])] == ["length", "length"]
    assert not llm.engine.has_unfinished()


@pytest.mark.parametrize(
    ("options", "field"),
    [(dict(max_tokens=0), "max_tokens"), (dict(max_tokens=-3), "max_tokens"), (dict(temperature=float("nan")), "temperature"),
     (dict(temperature=-0.1), "temperature"), (dict(top_p=0.0), "top_p"), (dict(top_p=1.01), "top_p"),
     (dict(min_tokens=5, max_tokens=2), "min_tokens"), (dict(stop=[""]), "stop[0]"), (dict(seed=-1), "seed"),
     (dict(stop=[f"s{i}" for i in range(65)]), "stop"), (dict(stop=["x" * 4000, "y" * 97]), "stop")],
)
def test_bad_sampling_params_name_the_field(options: dict, field: str) -> None:
    with pytest.raises(InvalidRequestError) as error:
        SamplingParams(**options)
    assert error.value.field == field


def test_a_request_that_cannot_fit_says_how_much_max_tokens_would(llm: LLM) -> None:
    room = llm.engine.max_model_len - 10
    out = llm.generate([list(range(3, 13))], SamplingParams(max_tokens=room + 1), use_tqdm=False)[0]
    assert out.error.startswith("max_tokens:") and out.error.endswith(f"set max_tokens to at most {room} or shorten "
                                                                      "the prompt")


def test_stop_token_ids_outside_the_vocabulary_fail_the_request(llm: LLM) -> None:
    vocab = llm.engine.runner.vocab_size
    params = [SamplingParams(max_tokens=2), SamplingParams(max_tokens=2, stop_token_ids=[vocab])]
    outs = llm.generate(["fine", "not"], params, use_tqdm=False)
    assert outs[0].finish_reason == "length"
    assert outs[1].error == f"stop_token_ids: token {vocab} is outside the vocabulary [0, {vocab})"


def test_chat_messages_without_a_role_or_content_are_named(llm: LLM) -> None:
    cases = (([{"role": "user"}], "messages[0]"), ([{"role": "user", "content": "a"}, "hi"], "messages[1]"))
    for messages, field in cases:
        out = llm.chat([messages], SamplingParams(max_tokens=2), use_tqdm=False)[0]
        assert out.finish_reason == "error" and out.error.startswith(field + ": must be a dict")


def test_params_that_are_not_sampling_params_are_named(llm: LLM) -> None:
    with pytest.raises(TypeError, match=r"params: must be a SamplingParams .* got dict \(a dict of fields"):
        llm.generate(["a"], {"max_tokens": 2}, use_tqdm=False)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="params: each must be a SamplingParams; got dict"):
        llm.generate(["a"], [{"max_tokens": 2}], use_tqdm=False)  # type: ignore[list-item]


def test_a_min_tokens_over_the_unset_max_tokens_says_so() -> None:
    with pytest.raises(InvalidRequestError, match="max_tokens, which is 2 when unset; got 3: set max_tokens too"):
        SamplingParams(choice=["a", "b"], min_tokens=3)


def test_a_cuda_device_without_cuda_is_one_clear_error() -> None:
    from tokenmill.engine.loader import resolve_device

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(ValueError, match=r"^device: 'cuda' asked for, but this torch sees no CUDA device"):
        resolve_device("cuda")
    with pytest.raises(ValueError, match=r"^device: must be auto, cpu, cuda or cuda:N; got 'gpu'"):
        resolve_device("gpu")
    assert resolve_device("cpu") == torch.device("cpu")


def test_unknown_fields_are_named() -> None:
    with pytest.raises(InvalidRequestError, match="temprature: unknown"):
        SamplingParams.from_dict({"temprature": 0.5})
    with pytest.raises(TypeError, match="temprature"):
        SamplingParams(temprature=0.5)  # type: ignore[call-arg]
    with pytest.raises(TypeError, match="max_batch_tokens"):
        LLM("builtin:tiny", max_batch_tokens=3)


def test_a_batch_of_argmax_rows_samples_as_the_full_path(random_seed: int) -> None:
    """`Sampler` reads an all-greedy plain batch once and takes its argmax: the tokens must be the ones its full
    path (suppression, penalties, logprobs, noise) gives, and a row counts as plain exactly when it is greedy with
    no logprobs, penalty, grammar or suppressed ids, including once `suppress` lifts its ids."""
    generator = torch.Generator().manual_seed(random_seed)
    rng = random.Random(random_seed)
    logits = torch.randn(12, 50, generator=generator)
    options = [{"temperature": 0.0}, {"temperature": 0.8}, {"temperature": 0.0, "logprobs": 2},
               {"temperature": 0.0, "repetition_penalty": 1.3}]
    rows = []
    for i in range(12):  # the first row plain, the others drawn
        params = SamplingParams(max_tokens=4, **(rng.choice(options) if i else options[0]))
        suppressed = rng.choice([[], [3, 7]]) if i else []
        rows.append(SamplingRow(params, i, 0, [rng.randrange(50) for _ in range(5)], suppressed))
    for row in rows:
        assert row.argmax_only == (row.params.greedy and row.params.logprobs is None
                                   and row.params.repetition_penalty == 1.0 and not row.suppressed_ids)
    plain = [row for row in rows if row.argmax_only]
    greedy = SamplingParams(max_tokens=4, temperature=0.0)
    suppressed = [row for row in rows if row.params == greedy and row.suppressed_ids]
    for row in suppressed:  # min_tokens reached: the engine lifts the ids, and the row is plain from then on
        row.suppress([])
        assert row.argmax_only
    plain += suppressed
    fast = Sampler()(logits[: len(plain)], plain)
    for row in plain:
        row.argmax_only = False  # the same rows through the full path
    full = Sampler()(logits[: len(plain)], plain)
    assert fast.token_ids == full.token_ids == logits[: len(plain)].argmax(dim=-1).tolist()
    assert fast.logprobs == full.logprobs == [None] * len(plain)
