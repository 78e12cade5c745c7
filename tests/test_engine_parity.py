"""Greedy tokens of tokenmill must equal transformers' `generate`, token for token (float32, CPU)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from model_fixtures import random_prompts
from tokenmill import LLM, SamplingParams

MAX_TOKENS_RANGE = (1, 24)


def workload(count: int, seed: int) -> tuple[list[list[int]], list[int]]:
    """Mixed prompt lengths (1 to 300 tokens) and mixed max_tokens."""
    prompts = random_prompts(count, 1, 300, seed)
    rng = random.Random(seed + 1)
    return prompts, [rng.randint(*MAX_TOKENS_RANGE) for _ in prompts]


def hf_greedy(model_dir: Path, prompts: list[list[int]], max_tokens: list[int]) -> list[list[int]]:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
    outputs = []
    for prompt, n in zip(prompts, max_tokens):
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             max_new_tokens=n, do_sample=False)
        outputs.append(out[0, len(prompt):].tolist())
    return outputs


def tokenmill_greedy(model_dir: Path, prompts: list[list[int]], max_tokens: list[int], **options: object) -> tuple[list[list[int]], LLM]:
    llm = LLM(str(model_dir), dtype="float32", **options)
    params = [SamplingParams(max_tokens=n, temperature=0.0) for n in max_tokens]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert all(o.finish_reason in ("stop", "length") for o in outputs), [o.error for o in outputs]
    return [o.token_ids for o in outputs], llm


def assert_same(actual: list[list[int]], expected: list[list[int]]) -> None:
    mismatched = [i for i, (a, e) in enumerate(zip(actual, expected)) if a != e]
    assert not mismatched, f"requests {mismatched} differ; first: {actual[mismatched[0]]} vs {expected[mismatched[0]]}"
    assert len(actual) == len(expected)


@pytest.fixture(scope="module")
def mixed_reference(model_dirs: dict[str, Path]) -> dict[str, tuple]:
    """32 mixed requests and their transformers outputs, per architecture, computed once."""
    cache: dict[str, tuple] = {}

    def get(arch: str) -> tuple:
        if arch not in cache:
            prompts, max_tokens = workload(32, seed=7)
            cache[arch] = (prompts, max_tokens, hf_greedy(model_dirs[arch], prompts, max_tokens))
        return cache[arch]

    return get  # type: ignore[return-value]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral", "qwen3"])
def test_single_request_matches_transformers(model_dirs: dict[str, Path], arch: str) -> None:
    prompts, max_tokens = [random_prompts(1, 40, 40, seed=3)[0]], [32]
    expected = hf_greedy(model_dirs[arch], prompts, max_tokens)
    actual, _ = tokenmill_greedy(model_dirs[arch], prompts, max_tokens)
    assert_same(actual, expected)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral", "qwen3"])
def test_mixed_batch_matches_transformers(model_dirs: dict[str, Path], mixed_reference, arch: str) -> None:
    prompts, max_tokens, expected = mixed_reference(arch)
    actual, _ = tokenmill_greedy(model_dirs[arch], prompts, max_tokens, max_num_batched_tokens=64)
    assert_same(actual, expected)


#: Requests of the mixed workload run per token budget. A step holds at most `budget` tokens, so the tiny
#: budgets cost one engine step per token or few tokens: they run the first requests only (prompts of 80 to
#: 292 tokens, still chunked into hundreds of pieces, beside other requests' decode rows), the rest all 32.
BUDGET_REQUESTS = {1: 4, 7: 8}


@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("budget", [1, 7, 64, 4096])
def test_token_budgets_and_block_sizes(model_dirs: dict[str, Path], mixed_reference, budget: int, block_size: int) -> None:
    prompts, max_tokens, expected = (part[:BUDGET_REQUESTS.get(budget, 32)] for part in mixed_reference("llama"))
    actual, llm = tokenmill_greedy(model_dirs["llama"], prompts, max_tokens, max_num_batched_tokens=budget,
                                   block_size=block_size)
    assert_same(actual, expected)
    longest = max(len(p) for p in prompts)
    if budget < longest:  # the long prompts really were split into chunks
        assert llm.engine.stats().num_steps > sum(max_tokens) / len(prompts) + longest / budget - 1


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_preemption_under_a_small_kv_pool(model_dirs: dict[str, Path], mixed_reference, arch: str) -> None:
    prompts, max_tokens, expected = mixed_reference(arch)
    # 24 blocks of 16 tokens: room for one of the longest requests, so decode must preempt.
    actual, llm = tokenmill_greedy(model_dirs[arch], prompts, max_tokens, max_num_batched_tokens=512,
                                   num_kv_blocks=24, block_size=16)
    assert_same(actual, expected)
    assert llm.engine.stats().num_preemptions > 0
    assert llm.engine.scheduler.block_manager.num_free_blocks == 24


@pytest.mark.parametrize("budget", [64, 4096])
def test_shared_prefix_is_computed_once(model_dirs: dict[str, Path], budget: int) -> None:
    system = random_prompts(1, 200, 200, seed=11)[0]
    prompts = [system + suffix for suffix in random_prompts(8, 1, 30, seed=12)]
    max_tokens = [12] * len(prompts)
    expected = hf_greedy(model_dirs["mistral"], prompts, max_tokens)
    actual, llm = tokenmill_greedy(model_dirs["mistral"], prompts, max_tokens, max_num_batched_tokens=budget)
    assert_same(actual, expected)
    full_blocks = len(system) // 16 * 16
    # Every request after the first finds the shared blocks already computed.
    assert llm.engine.stats().num_prefix_hit_tokens >= (len(prompts) - 1) * full_blocks
