"""The engine with the Triton backend (attention, norms, rotary, SiLU-and-mul) gives the reference backend's greedy
tokens (Qwen3: rotary after its per-head norms).

Without CUDA the Triton kernels run through the interpreter, so the model is tiny and the prompts few.
A small token budget forces chunked prefill, so prefill chunks over cached context, decode rows and
mixed steps all go through the kernel. The model comes from model_fixtures.py's wide-init weights, which keep
greedy argmax clear of near-ties that float32 rounding differences could flip.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from model_fixtures import build_model_dir, random_prompts  # noqa: E402
from tokenmill import LLM, SamplingParams  # noqa: E402


def greedy(model_dir: Path, backend: str, block_size: int, prompts: list[list[int]]) -> list[list[int]]:
    llm = LLM(str(model_dir), dtype="float32", attention_backend=backend, block_size=block_size,
              max_num_batched_tokens=32, num_kv_blocks=64)
    assert llm.engine.runner.backend.name == backend
    assert llm.engine.runner.native  # the native model: the Triton backend's norm, rotary and SiLU kernels run too
    outputs = llm.generate(prompts, SamplingParams(max_tokens=6, temperature=0.0), use_tqdm=False)
    assert all(o.finish_reason in ("stop", "length") for o in outputs), [o.error for o in outputs]
    return [o.token_ids for o in outputs]


@pytest.mark.parametrize(("arch", "block_size"), [("llama", 16), ("llama", 5), ("qwen3", 16)])
def test_triton_engine_matches_torch_backend(tmp_path: Path, arch: str, block_size: int):
    model_dir = build_model_dir(arch, tmp_path)
    prompts = random_prompts(4, 1, 50, seed=block_size)
    assert greedy(model_dir, "triton", block_size, prompts) == greedy(model_dir, "torch", block_size, prompts)
