"""The runner's ragged batch: no pad token computed, logits only for sampling rows, KV pool sizing."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from model_fixtures import random_prompts
from tokenmill import LLM, SamplingParams


@pytest.mark.parametrize("impl", ["native", "transformers"])
def test_flat_batch_has_no_padding_and_logits_only_for_sampling_rows(impl: str) -> None:
    llm = LLM("builtin:tiny", max_num_batched_tokens=40, model_impl=impl)
    model = llm.engine.runner.model
    embedded, projected = [], []
    # the ids: [1, T] for transformers' model, [T] for the native one; the rows projected: [..., R, hidden]
    model.get_input_embeddings().register_forward_hook(lambda m, args, out: embedded.append((1, *args[0].shape[-1:])))
    model.lm_head.register_forward_hook(lambda m, args, out: projected.append(args[0].shape[-2]))
    prompts = random_prompts(6, 1, 70, seed=2)
    max_tokens = [3, 9, 1, 5, 7, 2]
    llm.generate(prompts, [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in max_tokens],
                 use_tqdm=False)
    assert all(shape[0] == 1 and shape[1] <= 40 for shape in embedded)
    # Every prompt token and every generated token but the last goes through the model exactly once.
    assert sum(shape[1] for shape in embedded) == sum(map(len, prompts)) + sum(max_tokens) - len(prompts)
    # One logits row per generated token, none for prompt positions that sample nothing.
    assert sum(projected) == sum(max_tokens)
    projected.clear()
    llm.generate([list(range(100))], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True), use_tqdm=False)
    assert projected == [0, 0, 1, 1]  # chunks 40+40 sample nothing, then the last chunk and one decode step


def test_kv_pool_size_from_block_count_or_bytes() -> None:
    by_count = LLM("builtin:tiny", num_kv_blocks=37, block_size=8)
    k_cache, v_cache = by_count.engine.runner.kv_caches[0]
    assert k_cache.shape == v_cache.shape == (37 + 1, 8, 2, 16)  # and the scratch block of padded decode rows
    assert by_count.engine.runner.scratch_block == 37 == by_count.engine.scheduler.block_manager.num_blocks
    block_bytes = by_count.engine.runner.block_bytes
    assert block_bytes == 2 * 2 * 8 * 2 * 16 * 4  # K and V, 2 layers, 8 tokens, 2 heads, dim 16, float32
    by_bytes = LLM("builtin:tiny", kv_cache_memory=block_bytes * 50 + 7, block_size=8)
    assert by_bytes.engine.scheduler.block_manager.num_blocks == 49  # the scratch block is within the budget


def test_saved_directory_loads_as_is(model_dirs: dict[str, Path]) -> None:
    llm = LLM(str(model_dirs["qwen2"]))
    assert llm.engine.runner.dtype == torch.float32 and llm.engine.runner.device.type == "cpu"
    assert llm.generate("hello", SamplingParams(max_tokens=3, temperature=0.0), use_tqdm=False)[0].finish_reason


def test_dummy_weights_follow_the_config_and_the_seed(model_dirs: dict[str, Path]) -> None:
    def head(**options: object) -> torch.Tensor:
        return LLM(str(model_dirs["llama"]), **options).engine.runner.model.get_input_embeddings().weight

    real, dummy = head(), head(load_format="dummy", seed=5)
    assert dummy.shape == real.shape and not torch.equal(dummy, real)
    assert torch.equal(dummy, head(load_format="dummy", seed=5))  # every worker draws the same weights


def test_importing_the_package_and_client_does_not_import_torch() -> None:
    code = "import sys, tokenmill; from tokenmill import SamplingParams; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_attention_backend_choice(monkeypatch) -> None:
    from tokenmill.kernels import resolve_backend_name

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    monkeypatch.delenv("TOKENMILL_ATTENTION_BACKEND", raising=False)
    assert (resolve_backend_name(None, cpu), resolve_backend_name(None, cuda)) == ("torch", "triton")
    monkeypatch.setenv("TOKENMILL_ATTENTION_BACKEND", "triton")
    assert resolve_backend_name(None, cpu) == "triton"
    assert resolve_backend_name("torch", cpu) == "torch"  # an explicit option wins over the environment
    with pytest.raises(ValueError, match="attention_backend: unknown backend 'flash'"):
        LLM("builtin:tiny", attention_backend="flash")
