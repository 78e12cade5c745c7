"""The decode path at fixed shapes (`tokenmill.engine.padded_decode`), run eagerly on CPU with the torch and Triton
(interpreter) backends: what a CUDA graph of each bucket would replay.

Padded rows must be inert: the real rows' logits do not depend on what the padded rows hold, and the step writes K/V
only at the real rows' slots (and the scratch block). A full bucket computes what the eager step computes (bit for
bit with the Triton kernel). A padded bucket is compared with the unpadded eager step to float32 rounding only: CPU BLAS picks its kernel by
the row count (below ~16 rows MKL's results for a row change with the number of rows), so equal bits across
different row counts are a property of the GEMM library, not of this path. Greedy tokens through the whole engine with
this path on equal transformers' `generate`.
"""

from __future__ import annotations

import gc
import os
import weakref
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from model_fixtures import random_prompts  # noqa: E402
from test_engine_parity import assert_same, hf_greedy  # noqa: E402
from tokenmill import LLM, SamplingParams  # noqa: E402
from tokenmill.engine.llm_engine import LLMEngine  # noqa: E402
from tokenmill.engine.padded_decode import PaddedDecode, decode_buckets  # noqa: E402
from tokenmill.scheduler.scheduler import ScheduledBatch  # noqa: E402

BACKENDS = ["torch", "triton"]


@pytest.mark.parametrize(("max_num_seqs", "expected"), [
    (1, [1]), (3, [1, 2, 3]), (8, [1, 2, 4, 8]), (20, [1, 2, 4, 8, 16, 20]),
    (64, [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]),
    (100, [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64, 80, 96, 100]),
])
def test_buckets(max_num_seqs: int, expected: list[int]) -> None:
    assert decode_buckets(max_num_seqs) == expected


def decoding_engine(model_dir: Path, backend: str, num_seqs: int) -> tuple[LLMEngine, PaddedDecode, ScheduledBatch]:
    """An engine whose next step decodes `num_seqs` sequences of different lengths (some past a block), with the
    padded path attached, and that step's batch (scheduled, not run)."""
    engine = LLM(str(model_dir), dtype="float32", attention_backend=backend, max_num_seqs=8, num_kv_blocks=48,
                 max_model_len=128).engine
    decode = engine.runner.decode = PaddedDecode(engine.runner, engine.max_model_len, capture=False)
    for i, prompt in enumerate(random_prompts(num_seqs, 3, 40, seed=num_seqs)):
        engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=50, temperature=0.0))
    for _ in range(3):  # prefill, then two decode steps
        engine.step()
    batch = engine.scheduler.schedule()
    assert decode.fits(batch) and len(batch.seqs) == num_seqs
    return engine, decode, batch


def kv_snapshot(engine: LLMEngine) -> list[torch.Tensor]:
    return [cache.clone() for pair in engine.runner.kv_caches for cache in pair]


def eager_logits(engine: LLMEngine, batch: ScheduledBatch) -> torch.Tensor:
    with torch.inference_mode():
        return engine.runner.forward(engine.runner.inputs.build(batch))


@pytest.mark.parametrize("backend", BACKENDS)
def test_padded_rows_are_inert(model_dirs: dict[str, Path], backend: str) -> None:
    engine, decode, batch = decoding_engine(model_dirs["qwen3"], backend, 5)
    assert decode.bucket(5) == 8
    before = kv_snapshot(engine)
    with torch.inference_mode():
        logits = decode.forward(batch).clone()
    after = kv_snapshot(engine)
    block_size, scratch = engine.runner.config.block_size, engine.runner.scratch_block
    real_slots = {seq.block_table[seq.num_computed_tokens // block_size] * block_size
                  + seq.num_computed_tokens % block_size for seq in batch.seqs}
    for old, new in zip(before, after):
        changed = (old != new).flatten(2).any(-1).nonzero().tolist()  # (block, offset) pairs written
        assert {b * block_size + o for b, o in changed if b != scratch} == real_slots
    # Padded rows that hold other tokens, positions and block tables: the real rows do not change by a bit.
    original = decode._pad

    def scribbled_pad(start: int, stop: int) -> None:
        original(start, stop)
        top = decode.max
        decode.host[start:stop] = 123
        decode.host[top + start : top + stop] = 77
        decode.host_columns[:, start:stop] = 1
    decode._pad = scribbled_pad  # type: ignore[method-assign]
    with torch.inference_mode():
        again = decode.forward(batch)
    assert logits.shape[0] == 5 and torch.equal(again, logits)
    unpadded = eager_logits(engine, batch)
    torch.testing.assert_close(logits, unpadded, rtol=0, atol=2e-5)
    assert torch.equal(logits.argmax(-1), unpadded.argmax(-1))


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_full_bucket_equals_the_eager_step(model_dirs: dict[str, Path], backend: str) -> None:
    """Bitwise with the Triton kernel (batch-invariant by design). The torch backend's SDPA gives bits that depend
    on the length of the masked key range it is handed (the padded path reads the table's full width, the eager step
    its batch's longest context), so there: float32 rounding and the same argmax."""
    engine, decode, batch = decoding_engine(model_dirs["llama"], backend, 4)
    assert decode.bucket(4) == 4
    with torch.inference_mode():
        padded = decode.forward(batch).clone()
    eager = eager_logits(engine, batch)
    if backend == "triton":
        assert torch.equal(padded, eager)
    else:
        torch.testing.assert_close(padded, eager, rtol=0, atol=2e-5)
        assert torch.equal(padded.argmax(-1), eager.argmax(-1))


def test_a_full_bucket_splits_as_the_eager_step(model_dirs: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """With the Triton kernel's split decode on (partitions of 16 keys), the padded step splits over the tables' whole
    width and the eager step over its longest context: the same bits, as without it."""
    from tokenmill.kernels.triton_attention import TileConfig, TritonBackend

    engine, decode, batch = decoding_engine(model_dirs["llama"], "triton", 4)
    backend = engine.runner.backend = TritonBackend(TileConfig(32, 16, partition=16))
    states = backend._partition_states
    partitions: list[int] = []
    monkeypatch.setattr(backend, "_partition_states", lambda *args: partitions.append(args[0]) or states(*args))
    assert max(seq.num_computed_tokens + 1 for seq in batch.seqs) > 16
    with torch.inference_mode():
        padded = decode.forward(batch).clone()
    eager = eager_logits(engine, batch)
    assert torch.equal(padded, eager)
    layers = engine.runner.num_layers
    assert partitions[:layers] == [engine.max_model_len // 16] * layers and len(partitions) == 2 * layers, partitions


@pytest.mark.parametrize("backend", BACKENDS)
def test_greedy_tokens_through_the_padded_path_match_transformers(model_dirs: dict[str, Path], backend: str,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    prompts = random_prompts(6, 1, 60, seed=21)
    max_tokens = [12, 3, 20, 1, 9, 16]
    llm = LLM(str(model_dirs["qwen2"]), dtype="float32", attention_backend=backend, max_num_seqs=8,
              max_num_batched_tokens=64)
    runner = llm.engine.runner
    runner.decode = PaddedDecode(runner, llm.engine.max_model_len, capture=False)
    buckets: list[int] = []
    forward = runner.decode.forward
    monkeypatch.setattr(runner.decode, "forward",
                        lambda batch, feed=None: buckets.append(len(batch.seqs)) or forward(batch, feed))
    outputs = llm.generate(prompts, [SamplingParams(max_tokens=n, temperature=0.0) for n in max_tokens], use_tqdm=False)
    assert_same([o.token_ids for o in outputs], hf_greedy(model_dirs["qwen2"], prompts, max_tokens))
    assert len(buckets) >= 10 and {n for n in buckets if n not in decode_buckets(8)}, buckets  # padded steps ran


def test_an_engine_with_the_padded_path_is_freed_once_dropped(model_dirs: dict[str, Path]) -> None:
    """The runner holds its padded path; were the path to hold the runner back, their cycle would keep the KV cache
    until a garbage collection, and an engine built meanwhile on a GPU would find its memory taken."""
    engine = LLM(str(model_dirs["llama"]), dtype="float32", max_num_seqs=8, num_kv_blocks=48, max_model_len=128).engine
    engine.runner.decode = PaddedDecode(engine.runner, engine.max_model_len, capture=False)
    runner, cache = weakref.ref(engine.runner), weakref.ref(engine.runner.kv_caches[0][0])
    gc.collect()
    gc.disable()
    try:
        del engine
        assert runner() is None and cache() is None
    finally:
        gc.enable()


def test_a_step_copies_only_the_table_columns_its_contexts_use(model_dirs: dict[str, Path]) -> None:
    """The block tables are stored column by column, so a step copies the columns up to its longest context's, not the
    tables' whole width (`max_model_len / block_size`)."""
    engine, decode, batch = decoding_engine(model_dirs["llama"], "torch", 3)
    used = -(-max(seq.num_computed_tokens + 1 for seq in batch.seqs) // decode.block_size)
    assert used < decode.width
    decode.host_columns[used:] = 7  # the host's staging buffer only
    with torch.inference_mode():
        decode.forward(batch)
    on_device = decode.views[decode.max].block_tables.t()  # [width, max]
    assert not (on_device[used:] == 7).any()
    assert torch.equal(on_device[:used, :3], torch.from_numpy(decode.host_columns[:used, :3]))
