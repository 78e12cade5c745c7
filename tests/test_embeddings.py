"""Embeddings (`LLM.embed`, `add_request(..., pooling=...)`): the vectors of transformers' base model pooled by hand as
sentence-transformers pools them (the attention mask of a padded batch), float32, cosine >= 0.99999, on the native
model and on transformers' modules; prompts chunked by the budget, preempted, served from the prefix cache and mixed
with generating requests in the same steps; nothing left in the KV cache after."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModel, BertConfig, XLMRobertaConfig

from model_fixtures import build_model_dir, random_prompts
from tokenmill import LLM, InvalidRequestError, SamplingParams
from tokenmill.engine.llm_engine import LLMEngine, RequestOutput
from tokenmill.engine.pooling import PoolingParams, checkpoint_pooling, encode_base64
from tokenmill.errors import ModelLoadError

ST_KEYS = {"last": "pooling_mode_lasttoken", "mean": "pooling_mode_mean_tokens", "cls": "pooling_mode_cls_token",
           "max": "pooling_mode_max_tokens"}
#: arch -> the sentence-transformers pooling written beside it and whether it normalises (None: no such files, so
#: the engine's default, last-token pooling normalised)
FAMILIES = {"qwen3": ("last", True), "llama": ("mean", False), "mistral": None}
BUDGET = 64  # tokens per step: the longer prompts are chunked


def write_sentence_transformers(path: Path, pooling: str, normalize: bool, extra: str | None = None) -> None:
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    for name in ["Normalize"] * normalize + ([extra] if extra else []):
        modules.append({"idx": len(modules), "name": str(len(modules)), "path": f"{len(modules)}_{name}",
                        "type": f"sentence_transformers.models.{name}"})
    (path / "modules.json").write_text(json.dumps(modules))
    (path / "1_Pooling").mkdir(exist_ok=True)
    config = {"word_embedding_dimension": 64, **{key: key == ST_KEYS[pooling] for key in ST_KEYS.values()}}
    (path / "1_Pooling" / "config.json").write_text(json.dumps(config))


@pytest.fixture(scope="module")
def embedding_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("embedding-models")
    dirs = {}
    for arch, recipe in FAMILIES.items():
        dirs[arch] = build_model_dir(arch, root, seed=3)
        if recipe is not None:
            write_sentence_transformers(dirs[arch], *recipe)
    return dirs


def reference(model_dir: Path, prompts: list[list[int]], pooling: str, normalize: bool) -> torch.Tensor:
    """transformers' `last_hidden_state` of a right-padded batch, pooled with its attention mask as
    sentence-transformers pools it, float32."""
    model = AutoModel.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa").eval()
    longest = max(map(len, prompts))
    ids = torch.tensor([p + [258] * (longest - len(p)) for p in prompts])
    mask = torch.tensor([[1] * len(p) + [0] * (longest - len(p)) for p in prompts])
    with torch.no_grad():
        hidden = model(input_ids=ids, attention_mask=mask).last_hidden_state
    if pooling == "mean":
        vectors = (hidden * mask[..., None]).sum(1) / mask.sum(1, keepdim=True).clamp(min=1e-9)
    elif pooling == "last":
        vectors = hidden[torch.arange(len(prompts)), mask.sum(1) - 1]
    else:
        vectors = hidden[:, 0]
    return torch.nn.functional.normalize(vectors, dim=-1) if normalize else vectors


def assert_close(actual: list[list[float]], expected: torch.Tensor) -> None:
    got = torch.tensor(actual, dtype=torch.float32)
    assert got.shape == expected.shape
    cosine = torch.nn.functional.cosine_similarity(got, expected, dim=-1)
    assert cosine.min() >= 0.99999, cosine
    norms = got.norm(dim=-1) / expected.norm(dim=-1)
    assert (norms - 1).abs().max() < 1e-4, norms


def workload(seed: int) -> list[list[int]]:
    """Mixed lengths, one longer than three steps' budget, and a prompt of 40 tokens twice (the second finds the first
    one's two full blocks in the prefix cache)."""
    twice = random_prompts(1, 40, 40, seed + 3)
    return random_prompts(10, 1, 90, seed) + random_prompts(1, 3 * BUDGET + 5, 3 * BUDGET + 5, seed + 1) + twice * 2


def run_mixed(engine: LLMEngine, generate: list[list[int]], params: SamplingParams,
              prompts: list[list[int]]) -> dict[str, RequestOutput]:
    """The generate requests ("g<i>") first, then, once they run, the embedding requests ("e<i>"); every output."""
    for i, prompt in enumerate(generate):
        engine.add_request(f"g{i}", prompt, params)
    outputs = {o.request_id: o for o in engine.step()}
    for i, prompt in enumerate(prompts):
        engine.add_request(f"e{i}", prompt, pooling=PoolingParams())
    while engine.has_unfinished():
        outputs.update((o.request_id, o) for o in engine.step())
    return outputs


@pytest.mark.parametrize("impl", ["native", "transformers"])
@pytest.mark.parametrize("arch", list(FAMILIES))
def test_embeddings_match_sentence_transformers_pooling(embedding_dirs: dict[str, Path], arch: str, impl: str,
                                                        random_seed: int) -> None:
    """The checkpoint's own pooling (or the default), beside generating requests in the same steps."""
    pooling, normalize = FAMILIES[arch] or ("last", True)
    prompts = workload(random_seed)
    llm = LLM(str(embedding_dirs[arch]), dtype="float32", max_num_batched_tokens=BUDGET, model_impl=impl)
    generate = random_prompts(4, 5, 40, random_seed + 2)
    params = SamplingParams(max_tokens=12, temperature=0.0)
    alone = [o.token_ids for o in llm.generate(generate, params, use_tqdm=False)]
    engine, steps = llm.engine, []
    execute = engine.runner.execute
    engine.runner.execute = lambda batch, rows, *feed: (steps.append((bool(batch.pooling), len(rows)))
                                                        or execute(batch, rows, *feed))
    outputs = run_mixed(engine, generate, params, prompts)
    assert any(pooled and sampled for pooled, sampled in steps), "no step ran embeddings beside decodes"
    assert [outputs[f"g{i}"].token_ids for i in range(len(generate))] == alone
    embedded = [outputs[f"e{i}"] for i in range(len(prompts))]
    assert all(out.token_ids == [] and out.finish_reason == "stop" for out in embedded)
    assert_close([out.embedding for out in embedded], reference(embedding_dirs[arch], prompts, pooling, normalize))
    manager = engine.scheduler.block_manager
    assert manager.num_free_blocks == manager.num_blocks and not engine.scheduler.has_unfinished()
    if pooling == "last":  # the repeated prompt found the first one's full blocks
        assert outputs[f"e{len(prompts) - 1}"].num_cached_tokens == 32


@pytest.mark.parametrize("impl", ["native", "transformers"])
def test_overrides_and_dimensions(embedding_dirs: dict[str, Path], impl: str) -> None:
    prompts = random_prompts(6, 1, 150, 11)
    llm = LLM(str(embedding_dirs["qwen3"]), dtype="float32", max_num_batched_tokens=BUDGET, model_impl=impl)
    for pooling, normalize in (("mean", True), ("cls", False), ("last", False)):
        vectors = [o.embedding for o in llm.embed(prompts, pooling=pooling, normalize=normalize)]
        assert_close(vectors, reference(embedding_dirs["qwen3"], prompts, pooling, normalize))
    full = reference(embedding_dirs["qwen3"], prompts, "last", False)
    cut = llm.embed(prompts, dimensions=16)
    assert_close([o.embedding for o in cut], torch.nn.functional.normalize(full[:, :16], dim=-1))
    assert [o.num_prompt_tokens for o in cut] == [len(p) for p in prompts]
    raw = llm.embed(prompts, dimensions=16, normalize=False)
    assert_close([o.embedding for o in raw], full[:, :16])


def test_embedding_prompts_preempted_and_recomputed(embedding_dirs: dict[str, Path]) -> None:
    """A KV pool of 12 blocks of 16 tokens beside growing decodes: mean-pooled prompts, admitted last, are preempted
    mid-prefill and start their sums anew."""
    prompts = random_prompts(8, 60, 150, 5)
    llm = LLM(str(embedding_dirs["llama"]), dtype="float32", max_num_batched_tokens=BUDGET, num_kv_blocks=12)
    generate = random_prompts(2, 30, 40, 6)
    outputs = run_mixed(llm.engine, generate, SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True), prompts)
    assert llm.engine.stats().num_preemptions > 0
    assert_close([outputs[f"e{i}"].embedding for i in range(len(prompts))],
                 reference(embedding_dirs["llama"], prompts, "mean", False))
    manager = llm.engine.scheduler.block_manager
    assert manager.num_free_blocks == manager.num_blocks


def test_a_cancelled_embedding_frees_its_blocks() -> None:
    llm = LLM("builtin:tiny", max_num_batched_tokens=32)
    engine = llm.engine
    engine.add_request("e", list(range(200)), pooling=PoolingParams(pooling="mean"))
    assert engine.step() == []  # one chunk of 32 tokens
    assert engine.scheduler.block_manager.num_free_blocks < engine.scheduler.block_manager.num_blocks
    output = engine.cancel_request("e", "cancelled")
    assert output is not None and output.finish_reason == "cancelled" and output.embedding is None
    assert engine.scheduler.block_manager.num_free_blocks == engine.scheduler.block_manager.num_blocks
    assert not engine.has_unfinished() and engine.step() == []


def test_bad_requests_name_the_field(embedding_dirs: dict[str, Path]) -> None:
    llm = LLM(str(embedding_dirs["qwen3"]), dtype="float32", max_model_len=256)
    with pytest.raises(InvalidRequestError, match=r"^dimensions: 65 exceeds the model's 64 dimensions"):
        llm.embed([[1, 2]], dimensions=65)
    for options, field in (({"dimensions": 0}, "dimensions"), ({"pooling": "max"}, "pooling"),
                           ({"normalize": "yes"}, "normalize")):
        with pytest.raises(InvalidRequestError, match=f"^{field}: "):
            llm.embed([[1, 2]], **options)
    with pytest.raises(InvalidRequestError, match=r"^prompt: prompt \(300 tokens\) exceeds max_model_len \(256\) "
                                                  r"\(prompt 1\)"):
        llm.embed([[1, 2], [3] * 300])
    with pytest.raises(InvalidRequestError, match="^pooling: an embedding request samples nothing"):
        llm.engine.add_request("x", [1, 2], SamplingParams(), pooling=PoolingParams())
    assert not llm.engine.has_unfinished()
    assert llm.engine.scheduler.block_manager.num_free_blocks == llm.engine.scheduler.block_manager.num_blocks


def test_checkpoint_pooling_reads_sentence_transformers_files(tmp_path: Path) -> None:
    assert (checkpoint_pooling(str(tmp_path)).pooling, checkpoint_pooling(str(tmp_path)).normalize) == ("last", True)
    for pooling, normalize in (("mean", False), ("cls", True), ("last", False)):
        write_sentence_transformers(tmp_path, pooling, normalize)
        found = checkpoint_pooling(str(tmp_path))
        assert (found.pooling, found.normalize, found.refused) == (pooling, normalize, None)
    write_sentence_transformers(tmp_path, "max", True)
    found = checkpoint_pooling(str(tmp_path))
    assert found.pooling is None and "pooling_mode_max_tokens" in found.problem
    with pytest.raises(InvalidRequestError, match="^pooling: its sentence-transformers pooling"):
        found.resolve(PoolingParams(), 64)
    assert found.resolve(PoolingParams(pooling="mean"), 64) == ("mean", True, None)
    write_sentence_transformers(tmp_path, "mean", True, extra="Dense")
    with pytest.raises(InvalidRequestError, match=r"^model: its sentence-transformers module '3_Dense'"):
        checkpoint_pooling(str(tmp_path)).resolve(PoolingParams(pooling="mean"), 64)
    (tmp_path / "modules.json").write_text("{not json")
    assert "cannot be read" in checkpoint_pooling(str(tmp_path)).refused


@pytest.mark.parametrize("config", [BertConfig, XLMRobertaConfig])
def test_encoder_only_checkpoints_are_refused(tmp_path: Path, config: type) -> None:
    config(vocab_size=320, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
           intermediate_size=64).save_pretrained(tmp_path)
    expected = r"is an encoder-only \((bert|xlm-roberta)\) checkpoint: tokenmill runs decoder-only causal LMs"
    with pytest.raises(ModelLoadError, match=expected) as info:
        LLM(str(tmp_path))
    assert "\n" not in str(info.value)


def test_encode_base64_is_openais_little_endian_float32() -> None:
    vector = [0.5, -2.0, 1e-3, 3.25]
    encoded = encode_base64(vector)
    assert encoded == base64.b64encode(np.array(vector, dtype="<f4").tobytes()).decode()
    assert base64.b64decode(encoded)[:4] == b"\x00\x00\x00\x3f"  # 0.5, little-endian
    assert np.frombuffer(base64.b64decode(encode_base64(torch.tensor(vector))), dtype="<f4").tolist() == \
        np.float32(vector).tolist()
