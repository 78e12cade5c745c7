"""The native Llama-family models (`tokenmill.engine.models`) against transformers' modeling code.

tests/test_engine_parity.py runs every family (Llama, Qwen2, Mistral, Qwen3) through the engine, which chooses the
native implementation for them, against transformers' `generate`. Here: the variants those configs leave out (tied
embeddings as in Qwen2.5-0.5B, Llama 3's rope scaling, attention biases, a sharded checkpoint), the logits of both
implementations side by side in one engine, and the choice between them.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, GPTNeoXConfig, LlamaConfig, Qwen2Config, Qwen3Config

from model_fixtures import COMMON, random_prompts
from test_engine_parity import assert_same, hf_greedy, tokenmill_greedy
from tokenmill import LLM, SamplingParams
from tokenmill.engine.models.llama import LlamaFamily
from tokenmill.engine.tiny import tiny_tokenizer

VARIANTS = {
    "qwen2-tied": lambda: Qwen2Config(**{**COMMON, "tie_word_embeddings": True}, use_sliding_window=False),
    "llama3-rope": lambda: LlamaConfig(**COMMON, rope_parameters={
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64}),
    "llama-bias": lambda: LlamaConfig(**COMMON, attention_bias=True),
    "qwen3-bias": lambda: Qwen3Config(**COMMON, head_dim=16, attention_bias=True, use_sliding_window=False),
}


def _save(config: Any, path: Path, seed: int = 0, **save: Any) -> Path:
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # biases start at zero: give them values, so a bias dropped on the way shows
        for name, parameter in model.named_parameters():
            if name.endswith("bias"):
                parameter.normal_(0, 0.2)
    model.save_pretrained(path, **save)
    tiny_tokenizer().save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def variant_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("variants")
    dirs = {name: _save(make(), root / name) for name, make in VARIANTS.items()}
    dirs["llama-sharded"] = _save(VARIANTS["llama-bias"](), root / "llama-sharded", seed=1, max_shard_size="20KB")
    return dirs


@pytest.mark.parametrize("variant", [*VARIANTS, "llama-sharded"])
def test_variants_match_transformers(variant_dirs: dict[str, Path], variant: str) -> None:
    if variant == "llama-sharded":
        assert len(list(variant_dirs[variant].glob("*.safetensors"))) > 1, "the checkpoint is not sharded"
    prompts = random_prompts(6, 1, 120, seed=5)
    max_tokens = [16, 1, 24, 8, 12, 20]
    expected = hf_greedy(variant_dirs[variant], prompts, max_tokens)
    actual, llm = tokenmill_greedy(variant_dirs[variant], prompts, max_tokens, max_num_batched_tokens=64)
    assert isinstance(llm.engine.runner.model, LlamaFamily)
    assert_same(actual, expected)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral", "qwen3"])
def test_logits_match_the_transformers_implementation(model_dirs: dict[str, Path], arch: str) -> None:
    """The same step through both implementations in the engine: logits within float32 rounding."""
    prompts = random_prompts(4, 5, 60, seed=9)
    logits = {}
    for impl in ("native", "transformers"):
        llm = LLM(str(model_dirs[arch]), dtype="float32", model_impl=impl)
        outputs = llm.generate(prompts, SamplingParams(max_tokens=4, temperature=0.0, logprobs=5), use_tqdm=False)
        logits[impl] = [step["top_logprobs"] for o in outputs for step in o.logprobs]
    assert len(logits["native"]) == len(logits["transformers"]) == 16
    for mine, theirs in zip(logits["native"], logits["transformers"]):
        assert [token for token, _ in mine] == [token for token, _ in theirs]  # the same top tokens, in order
        assert max(abs(a - b) for (_, a), (_, b) in zip(mine, theirs)) < 1e-4


def test_the_implementation_is_chosen_and_logged(model_dirs: dict[str, Path], tmp_path: Path,
                                                 caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="tokenmill.engine.models"):
        native = LLM(str(model_dirs["qwen2"]), dtype="float32")
        forced = LLM(str(model_dirs["qwen2"]), dtype="float32", model_impl="transformers")
    assert isinstance(native.engine.runner.model, LlamaFamily)
    assert not isinstance(forced.engine.runner.model, LlamaFamily)
    assert "Qwen2ForCausalLM: native implementation" in caplog.text
    assert "Qwen2ForCausalLM: transformers' modeling code (model_impl='transformers')" in caplog.text

    other = _save(GPTNeoXConfig(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                num_attention_heads=4, max_position_embeddings=256), tmp_path / "neox")
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="tokenmill.engine.models"):
        fallback = LLM(str(other), dtype="float32")
    assert not isinstance(fallback.engine.runner.model, LlamaFamily)
    assert "GPTNeoXForCausalLM: transformers' modeling code (native: architecture GPTNeoXForCausalLM is not" in caplog.text
    expected = hf_greedy(other, [[5, 6, 7, 8]], [6])
    assert [o.token_ids for o in fallback.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=6, temperature=0.0),
                                                   use_tqdm=False)] == expected
    with pytest.raises(ValueError, match="model_impl='native': GPTNeoXForCausalLM cannot run natively"):
        LLM(str(other), dtype="float32", model_impl="native")


def test_what_transformers_runs_differently_stays_with_transformers(tmp_path: Path) -> None:
    """Found by a review: a checkpoint whose generation_config names more eos tokens stops at them natively too; a
    config saying tied beside a separate head in the checkpoint runs the head (transformers does not tie them then);
    Mistral with `attention_bias` (its modules have none) loads."""
    eos = _save(VARIANTS["llama-bias"](), tmp_path / "eos")
    (eos / "generation_config.json").write_text('{"eos_token_id": [257, 60, 61, 62, 63, 64, 65]}')
    prompts = random_prompts(6, 4, 40, seed=21)
    for model_dir in (eos,):
        expected = [o.token_ids for o in LLM(str(model_dir), dtype="float32", model_impl="transformers").generate(
            prompts, SamplingParams(max_tokens=24, temperature=0.0), use_tqdm=False)]
        native = LLM(str(model_dir), dtype="float32", model_impl="native")
        assert [o.token_ids for o in native.generate(prompts, SamplingParams(max_tokens=24, temperature=0.0),
                                                     use_tqdm=False)] == expected
    assert any(len(tokens) < 24 for tokens in expected), "no prompt stopped at the generation config's eos tokens"

    from transformers import MistralConfig
    untied = tmp_path / "untied"
    torch.manual_seed(3)
    model = AutoModelForCausalLM.from_config(LlamaConfig(**COMMON), dtype=torch.float32)
    model.save_pretrained(untied)
    tiny_tokenizer().save_pretrained(untied)
    config = (untied / "config.json")
    config.write_text(config.read_text().replace('"tie_word_embeddings": false', '"tie_word_embeddings": true'))
    mistral = _save(MistralConfig(**COMMON, sliding_window=None, head_dim=16, attention_bias=True), tmp_path / "mistral")
    for model_dir in (untied, mistral):
        expected = hf_greedy(model_dir, prompts, [12] * len(prompts))
        actual, llm = tokenmill_greedy(model_dir, prompts, [12] * len(prompts), model_impl="native")
        assert_same(actual, expected)



@pytest.mark.parametrize("rows", [1, 7, 64, 300])
def test_the_cpus_fused_matmuls_give_the_unfused_ones_bits_in_float32(rows: int) -> None:
    """On a CPU the linears run on oneDNN with the residual adds and SiLU-and-mul fused into them (`PackedLinear`'s
    `add`, `PackedGateUp`): in float32, under inference mode as the engine runs them, the same bits as the matmul, then
    the add or SiLU-and-mul as torch runs them; a biased linear within float32 rounding (oneDNN adds the bias its own
    way on some CPUs)."""
    from tokenmill.engine.models.llama import PackedGateUp, PackedLinear, can_pack
    from tokenmill.kernels.layers import silu_and_mul

    if not can_pack(torch.zeros(1)):
        pytest.skip("this torch has no oneDNN for float32 linears")
    generator = torch.Generator().manual_seed(rows)
    hidden, intermediate = 96, 160
    gate_up = torch.nn.Linear(hidden, 2 * intermediate, bias=False)
    o_proj, biased = (torch.nn.Linear(hidden, hidden, bias=bias) for bias in (False, True))
    x, residual = (torch.randn(rows, hidden, generator=generator) for _ in range(2))
    with torch.inference_mode():
        merged, packed_o = PackedLinear(gate_up.weight), PackedLinear(o_proj.weight)
        packed_biased = PackedLinear(biased.weight, biased.bias)
        assert torch.equal(PackedGateUp(gate_up, intermediate)(x), silu_and_mul(merged(x)))
        assert torch.equal(packed_o(x, add=residual), packed_o(x) + residual)
        assert torch.equal(packed_o(x, mul=residual), packed_o(x) * residual)
        torch.testing.assert_close(packed_biased(x, add=residual), packed_biased(x) + residual, rtol=2e-6, atol=2e-6)
        torch.testing.assert_close(packed_biased(x, mul=residual), packed_biased(x) * residual, rtol=2e-6, atol=2e-6)
