"""KV memory profile: a worst-case step (token budget, max_num_seqs sampling rows, the sampler's costliest
path) under inference mode, then the device's free memory. The device queries are CUDA-only; on CPU the
step itself runs for real and the arithmetic is checked with the queries replaced."""

from __future__ import annotations

import pytest
import torch

from tokenmill import LLM, SamplingParams
from tokenmill.engine.model_runner import kv_cache_budget

GIB = 2**30


def test_budget_is_utilisation_of_total_less_what_is_in_use() -> None:
    assert kv_cache_budget(total=80 * GIB, free=60 * GIB, utilization=0.9) == int(72 * GIB) - 20 * GIB
    with pytest.raises(ValueError, match=r"gpu_memory_utilization: 0.5 of 80.00 GiB leaves nothing .* use 50.00 GiB"):
        kv_cache_budget(total=80 * GIB, free=30 * GIB, utilization=0.5)


@pytest.mark.parametrize("impl", ["native", "transformers"])
def test_profile_step_is_the_worst_case_under_inference_mode(impl: str) -> None:
    llm = LLM("builtin:tiny", max_num_seqs=8, max_num_batched_tokens=64, model_impl=impl)
    runner = llm.engine.runner
    model = runner.model
    if impl == "transformers":
        assert any(p.requires_grad for p in model.parameters())  # so only inference mode keeps autograd out
    seen: dict[str, object] = {}
    model.get_input_embeddings().register_forward_hook(lambda m, args, out: seen.update(ids=args[0].shape[-1]))
    model.lm_head.register_forward_hook(lambda m, args, out: seen.update(logits=out))
    sampler = runner.sampler

    def recording_sampler(logits: torch.Tensor, rows: list) -> object:
        seen["sampler"] = (tuple(logits.shape), rows)
        return sampler(logits, rows)

    runner.sampler = recording_sampler
    result, cache_bytes = runner.profile_step()
    assert seen["ids"] == 64  # the whole token budget in one step
    logits = seen["logits"]
    assert logits.grad_fn is None and not logits.requires_grad and torch.is_inference(logits)
    shape, rows = seen["sampler"]
    assert shape == (8, runner.vocab_size) and len(result.token_ids) == 8  # max_num_seqs rows sampled
    params = rows[0].params
    assert not params.greedy and params.top_k > 0 and params.top_p < 1 and params.repetition_penalty != 1
    assert params.logprobs == 20 and cache_bytes == -(-(64 - 8 + 1) // 16) * runner.block_bytes
    runner.sampler = sampler
    out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True), use_tqdm=False)
    assert len(out[0].token_ids) == 4  # the engine's own KV cache and inputs are back in place


def test_cuda_profile_reads_free_memory_after_the_step(monkeypatch: pytest.MonkeyPatch) -> None:
    llm = LLM("builtin:tiny", max_num_seqs=4, max_num_batched_tokens=32)
    runner = llm.engine.runner
    calls: list[str] = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("empty_cache"))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: calls.append("synchronize"))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (calls.append("mem_get_info"), (30 * GIB, 80 * GIB))[1])
    profile_step = runner.profile_step
    monkeypatch.setattr(runner, "profile_step", lambda: (calls.append("step"), profile_step())[1])
    cache_bytes = profile_step()[1]
    assert runner._profile_free_cuda_memory() == int(0.9 * 80 * GIB) - (50 * GIB - cache_bytes)
    assert calls == ["empty_cache", "step", "synchronize", "mem_get_info", "empty_cache"]
    runner.config.gpu_memory_utilization = 0.5
    with pytest.raises(ValueError, match="leaves nothing for the KV cache"):
        runner._profile_free_cuda_memory()
