"""Values that once broke the engine: bounds on every sampling field, full-range seeds, tiny temperatures,
and request-level failures that fail one request while the engine goes on."""

from __future__ import annotations

import pytest
import torch

from model_fixtures import random_prompts
from tokenmill import LLM, InvalidRequestError, SamplingParams
from tokenmill.engine import sampler as sampler_module
from tokenmill.engine.sampler import exponential_noise, fold_seed


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM("builtin:tiny", max_num_batched_tokens=256)


@pytest.mark.parametrize(
    ("options", "field"),
    [
        (dict(seed=2**64), "seed"),
        (dict(seed=-1), "seed"),
        (dict(top_k=2**63), "top_k"),
        (dict(top_k=2**31), "top_k"),
        (dict(max_tokens=2**31), "max_tokens"),
        (dict(max_tokens=10**30, min_tokens=2**31), "max_tokens"),
        (dict(logprobs=2**63), "logprobs"),
        (dict(stop_token_ids=[2**31]), "stop_token_ids[0]"),
        (dict(stop_token_ids=[5, 2**64]), "stop_token_ids[1]"),
        (dict(temperature=float("inf")), "temperature"),
        (dict(top_p=float("nan")), "top_p"),
        (dict(repetition_penalty=float("inf")), "repetition_penalty"),
        (dict(min_p=-0.0001), "min_p"),
    ],
)
def test_out_of_range_values_name_the_field(options: dict, field: str) -> None:
    with pytest.raises(InvalidRequestError) as caught:
        SamplingParams(**options)
    assert caught.value.field == field


def test_full_range_seeds_sample_reproducibly(llm: LLM) -> None:
    prompt = random_prompts(1, 12, 12, seed=4)[0]
    seeds = [2**63 - 1, 2**63, 2**64 - 1, 0]
    params = [SamplingParams(max_tokens=12, temperature=1.0, top_k=2**31 - 1, seed=s, ignore_eos=True) for s in seeds]
    first = llm.generate([prompt] * 4, params, use_tqdm=False)
    again = llm.generate([prompt] * 4, params, use_tqdm=False)
    assert all(o.finish_reason == "length" for o in first)
    assert [o.token_ids for o in first] == [o.token_ids for o in again]


def test_folding_keeps_seeds_below_2_63_and_the_bits_of_larger_ones() -> None:
    assert [fold_seed(s) for s in (0, 12345, 2**63 - 1)] == [0, 12345, 2**63 - 1]
    assert fold_seed(2**64 - 1) == -1 and fold_seed(2**63) == -(2**63)
    positions = torch.zeros(3, dtype=torch.int64)
    folded = torch.tensor([fold_seed(s) for s in (2**63, 2**63 + 1, 2**64 - 1)])
    noise = exponential_noise(folded, positions, 64)
    assert len({tuple(row.tolist()) for row in noise}) == 3  # distinct seeds, distinct noise
    # The hash sees the same 32-bit halves as an unsigned seed would give.
    low, high = folded & 0xFFFFFFFF, (folded >> 32) & 0xFFFFFFFF
    assert [h * 2**32 + lo for h, lo in zip(high.tolist(), low.tolist())] == [2**63, 2**63 + 1, 2**64 - 1]


@pytest.mark.parametrize("temperature", [1e-300, 1e-6, 5e-324])
def test_tiny_temperatures_are_greedy(llm: LLM, temperature: float) -> None:
    prompts = random_prompts(4, 5, 30, seed=2)
    greedy = llm.generate(prompts, SamplingParams(max_tokens=10, temperature=0.0), use_tqdm=False)
    # Mixed with a sampled row, so the sampler's non-greedy path runs beside the tiny temperature.
    tiny = llm.generate(prompts + prompts[:1], [SamplingParams(max_tokens=10, temperature=temperature, seed=1)] * 4
                        + [SamplingParams(max_tokens=10, temperature=1.0, seed=1)], use_tqdm=False)
    assert [o.token_ids for o in tiny[:4]] == [o.token_ids for o in greedy]
    assert SamplingParams(temperature=temperature).greedy and not SamplingParams(temperature=1e-5).greedy


def test_a_sampling_failure_fails_that_request_only(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    """Fault injection: the sampler raises for rows of one seed, as it once did for seed 2**63."""
    poison_seed = 424242
    real_row_keys = sampler_module._row_keys

    def row_keys(seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        if bool((seeds == poison_seed).any()):
            raise RuntimeError("Overflow when unpacking long long")
        return real_row_keys(seeds, positions)

    prompts = random_prompts(5, 5, 40, seed=11)
    good = SamplingParams(max_tokens=8, temperature=0.8, seed=9)
    expected = llm.generate(prompts, good, use_tqdm=False)
    monkeypatch.setattr(sampler_module, "_row_keys", row_keys)
    params = [good, good, SamplingParams(max_tokens=8, temperature=0.8, seed=poison_seed), good, good]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert outs[2].finish_reason == "error" and outs[2].error.startswith("sampling: ")
    assert [o.token_ids for i, o in enumerate(outs) if i != 2] == [o.token_ids for i, o in enumerate(expected) if i != 2]
    alone = llm.generate(prompts[2:3], params[2], use_tqdm=False)[0]  # a request alone fails alone, too
    assert alone.finish_reason == "error"
    assert llm.generate(prompts, good, use_tqdm=False)[0].token_ids == expected[0].token_ids
    assert not llm.engine.has_unfinished() and llm.engine.scheduler.block_manager.usage() == 0.0


def test_a_decoding_failure_fails_that_request_only(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    """Fault injection: the tokenizer cannot decode for the one request that keeps special tokens."""
    real_decode = llm.engine.detokenize

    def decode(ids: list[int], skip_special_tokens: bool) -> str:
        if not skip_special_tokens:
            raise ValueError("cannot decode")
        return real_decode(ids, skip_special_tokens)

    monkeypatch.setattr(llm.engine, "detokenize", decode)
    prompts = random_prompts(3, 5, 20, seed=12)
    params = [SamplingParams(max_tokens=6, temperature=0.0), SamplingParams(max_tokens=6, temperature=0.0, stop=["zz"],
              skip_special_tokens=False), SamplingParams(max_tokens=6, temperature=0.0)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.finish_reason for o in outs] == ["length", "error", "length"]
    assert outs[1].error.startswith("stop: ")


def test_a_model_failure_is_the_engines(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    """A failure in the forward pass is not blamed on a request: it is raised (the worker then exits)."""

    def broken(*args: object, **kwargs: object) -> torch.Tensor:
        raise RuntimeError("the model crashed")

    monkeypatch.setattr(llm.engine.runner, "forward", broken)
    with pytest.raises(RuntimeError, match="the model crashed"):
        llm.generate(random_prompts(2, 5, 20, seed=13), SamplingParams(max_tokens=4), use_tqdm=False)


def _trained_tokenizer(pre_tokenizer: object, normalizer: object = None) -> object:
    """A real BPE tokenizer trained here (offline) on a small multilingual corpus."""
    from tokenizers import Tokenizer, decoders, models, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizer
    if normalizer is not None:
        tokenizer.normalizer = normalizer
    tokenizer.decoder = decoders.ByteLevel()
    corpus = ["the mill grinds tokens     from prompts", "naïve café über straße", "数据 处理 模型", "====== ------ ......"] * 50
    tokenizer.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=400, show_progress=False,
                                                              initial_alphabet=pre_tokenizers_alphabet()))
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer)


def pre_tokenizers_alphabet() -> list[str]:
    from tokenizers import pre_tokenizers

    return pre_tokenizers.ByteLevel.alphabet()


def test_prompt_character_bound_only_where_it_is_safe(llm: LLM) -> None:
    from hypothesis import given, settings
    from hypothesis import strategies as st
    from tokenizers import normalizers, pre_tokenizers

    from tokenmill.engine.prompt_limits import max_prompt_chars

    byte_level = _trained_tokenizer(pre_tokenizers.Sequence([
        pre_tokenizers.Split(r"\s+", behavior="isolated"), pre_tokenizers.ByteLevel(add_prefix_space=False)]))
    assert max_prompt_chars(llm.engine.tokenizer, 4096) == 4096 * max(len(t) for t in llm.engine.tokenizer.get_vocab())
    assert max_prompt_chars(_trained_tokenizer(pre_tokenizers.Whitespace()), 10) is None  # drops whitespace
    assert max_prompt_chars(_trained_tokenizer(pre_tokenizers.ByteLevel(), normalizers.NFKC()), 10) is None
    assert max_prompt_chars(_trained_tokenizer(pre_tokenizers.Split(" ", behavior="removed")), 10) is None

    @settings(max_examples=300, deadline=None)
    @given(st.text(min_size=1, max_size=300) | st.sampled_from(["    " * 40, "=" * 200, "数据 处理" * 20, "é" * 99]))
    def bound_holds(text: str) -> None:
        for tokenizer in (byte_level, llm.engine.tokenizer):
            tokens = len(tokenizer.encode(text, add_special_tokens=False))
            assert max_prompt_chars(tokenizer, tokens) >= len(text)

    bound_holds()


def test_the_embedded_engine_refuses_an_over_long_text_prompt_before_tokenizing(llm: LLM,
                                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """`LLM.generate` and `LLM.chat` apply the worker's character rule: a text longer than `max_model_len` tokens can
    cover is refused without running the tokenizer on it (16 MiB took it 30 s and 3.3 GB); its neighbours run."""
    limit = llm.engine.max_prompt_chars
    assert limit == llm.engine.max_model_len * max(len(t) for t in llm.engine.tokenizer.get_vocab())
    encoded: list[int] = []
    encode = llm.engine.tokenizer.encode
    monkeypatch.setattr(llm.engine.tokenizer, "encode", lambda text, **kw: encoded.append(len(text)) or encode(text, **kw))
    outs = llm.generate(["fine", "ab" * (limit // 2 + 1), "also fine"], SamplingParams(max_tokens=2), use_tqdm=False)
    assert [o.finish_reason for o in outs] == ["length", "error", "length"]
    assert outs[1].error == (f"prompt: {limit + 2} characters cannot fit in max_model_len "
                             f"({llm.engine.max_model_len} tokens, at most {limit} characters)")
    chat = llm.chat([[{"role": "user", "content": "x" * limit}]], SamplingParams(max_tokens=2), use_tqdm=False)[0]
    assert chat.finish_reason == "error" and chat.error.startswith("prompt: ") and "cannot fit" in chat.error
    assert max(encoded) < limit, "an over-long prompt went through the tokenizer"


def test_the_engine_loop_refuses_a_request_that_failed_while_running(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    """The worker's engine loop turns such a failure into "refused" for that request: its job fails, the others finish."""
    import json
    import multiprocessing

    from tokenmill.worker.engine_process import _Loop, _Outbox

    real_row_keys = sampler_module._row_keys

    def row_keys(seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        if bool((seeds == 777).any()):
            raise OverflowError("Overflow when unpacking long long")
        return real_row_keys(seeds, positions)

    monkeypatch.setattr(sampler_module, "_row_keys", row_keys)
    worker_end, engine_end = multiprocessing.Pipe()
    outbox = _Outbox(engine_end)
    loop = _Loop(llm.engine, engine_end, outbox)
    for request_id, seed in (("good", 1), ("poison", 777), ("also-good", 2)):
        params = {"max_tokens": 4, "temperature": 1.0, "seed": seed, "ignore_eos": True}
        loop._handle({"op": "add", "id": request_id, "prompt": "hello", "messages": None, "params": params})
    while llm.engine.has_unfinished():
        loop._step()
    outbox.close(timeout=30)  # every message written
    messages = []
    while worker_end.poll(0):
        messages.append(json.loads(worker_end.recv_bytes()))
    refused = [m for m in messages if m["op"] == "refused"]
    done = [o["request_id"] for m in messages if m["op"] == "done" for o in m["outputs"]]
    assert [(m["id"], m["field"]) for m in refused] == [("poison", "sampling")] and "Overflow" in refused[0]["message"]
    assert sorted(done) == ["also-good", "good"] and not loop.live


def test_a_sampling_failure_only_in_a_batch_mix_does_not_jam_the_engine(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    """Fault injection: the sampler fails for any batch of two or more sampled rows and for no row alone.

    Every request must still finish with the tokens of a clean run (the rows' results alone are the step's)."""
    prompts = random_prompts(4, 5, 30, seed=13)
    params = SamplingParams(max_tokens=6, temperature=0.8, seed=5)
    expected = llm.generate(prompts, params, use_tqdm=False)
    real_row_keys = sampler_module._row_keys

    def row_keys(seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        if seeds.numel() > 1:
            raise RuntimeError("fails only in company")
        return real_row_keys(seeds, positions)

    monkeypatch.setattr(sampler_module, "_row_keys", row_keys)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.finish_reason for o in outs] == [o.finish_reason for o in expected]
    assert [o.token_ids for o in outs] == [o.token_ids for o in expected]
    assert not llm.engine.has_unfinished() and llm.engine.scheduler.block_manager.usage() == 0.0
