"""Triton attention backend against a float64 reference, plus its batch invariance; the torch backend too.

Without CUDA the kernels run through Triton's interpreter (numpy on CPU), so shapes stay small.
bf16: the interpreter cannot multiply bf16 in `tl.dot`, so under it the kernel upcasts the dot operands to
fp32; the bf16 case here checks bf16 loads, stores and masking, while the bf16 tensor-core path is only
exercised on a GPU (this file under CUDA, and benchmarks/kernels_gpu.py).

Inputs are random, drawn from the run's seeds (`TOKENMILL_TEST_SEEDS`, see tests/conftest.py: fixed
ones plus a fresh one); the seed is in each test id, and `TOKENMILL_TEST_SEEDS=<seed>` reruns it.
Unwritten cache slots, the padding block 0 of the block tables, and the output buffer are NaN before
each launch, so any element read out of range or left unwritten shows up as NaN.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch.nn.functional as F  # noqa: E402

from tokenmill.kernels import AttentionBackend, get_backend  # noqa: E402
from tokenmill.kernels.torch_attention import TorchBackend  # noqa: E402
from tokenmill.kernels.triton_attention import INTERPRETED, TileConfig, TritonBackend  # noqa: E402
from triton.runtime import interpreter  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
TOLERANCES = {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}
NOT_POW2_BLOCK = 5

Span = tuple[int, int, int]  # (sequence, first query position, end position = KV length after the step)


@pytest.fixture
def gen(random_seed: int) -> torch.Generator:
    """Random inputs from the run's seeds (see tests/conftest.py): each test runs once per seed."""
    return torch.Generator().manual_seed(random_seed)


class Workload:
    """Sequences with random Q/K/V, a paged cache they live in, and the reference attention over them.

    Blocks are handed out in shuffled order from 1 on; block 0 stays `poison` and pads the block tables.
    """

    def __init__(self, lengths: list[int], block_size: int, num_kv_heads: int, group: int, head_dim: int,
                 dtype: torch.dtype, gen: torch.Generator, poison: float = float("nan")) -> None:
        self.block_size, self.poison = block_size, poison
        self.scale = head_dim**-0.5
        blocks = [-(-n // block_size) for n in lengths]
        order = (torch.randperm(sum(blocks), generator=gen) + 1).tolist()
        self.table = torch.zeros(len(lengths), max(blocks), dtype=torch.int32)
        for seq, n in enumerate(blocks):
            self.table[seq, :n] = torch.tensor(order[:n], dtype=torch.int32)
            order = order[n:]
        shape = (sum(blocks) + 1, block_size, num_kv_heads, head_dim)
        self.k_cache = torch.full(shape, poison, dtype=dtype, device=DEVICE)
        self.v_cache = torch.full(shape, poison, dtype=dtype, device=DEVICE)

        def rand(n: int, heads: int) -> torch.Tensor:
            return torch.randn(n, heads, head_dim, generator=gen).to(dtype)

        self.queries = [rand(n, num_kv_heads * group) for n in lengths]
        self.keys = [rand(n, num_kv_heads) for n in lengths]
        self.values = [rand(n, num_kv_heads) for n in lengths]

    def slots(self, spans: list[Span]) -> torch.Tensor:
        """Cache slot of every token of the spans, in order, read through the block tables."""
        pos = torch.cat([torch.arange(start, end) for _, start, end in spans])
        seqs = torch.cat([torch.full((end - start,), seq) for seq, start, end in spans])
        return (self.table[seqs, pos // self.block_size].long() * self.block_size + pos % self.block_size)

    def write(self, backend: AttentionBackend, spans: list[Span]) -> None:
        """Store the spans' K/V, passed as non-contiguous views of one [T, 2, Hkv, D] buffer."""
        kv = torch.stack([torch.cat([self.keys[s][a:b] for s, a, b in spans]),
                          torch.cat([self.values[s][a:b] for s, a, b in spans])], dim=1).to(DEVICE)
        backend.write_kv(kv[:, 0], kv[:, 1], self.k_cache, self.v_cache, self.slots(spans).to(DEVICE))

    def fill(self, spans: list[Span]) -> None:
        """Store context K/V that a test only reads: by index assignment, which the Triton write kernel equals
        bitwise (test_write_kv_matches_index_assignment), without its one interpreted program per token."""
        self.write(TorchBackend(), spans)

    def attend(self, backend: AttentionBackend, spans: list[Span]) -> list[torch.Tensor]:
        """Attention of the spans' queries as one batch, each span's rows returned apart."""
        q_lens = [end - start for _, start, end in spans]
        query = torch.cat([self.queries[s][a:b] for s, a, b in spans])
        cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
        seq_lens = torch.tensor([end for _, _, end in spans], dtype=torch.int32)
        return list(self.launch(backend, query, self.table[[s for s, _, _ in spans]], cu, seq_lens).split(q_lens))

    def launch(self, backend: AttentionBackend, query: torch.Tensor, block_tables: torch.Tensor,
               cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor) -> torch.Tensor:
        """One paged_attention call; the query is a non-contiguous view, the output buffer starts NaN."""
        wide = torch.cat([query, query], dim=-1).to(DEVICE)
        query = wide[..., : query.shape[-1]]
        args = (query, self.k_cache, self.v_cache, block_tables.to(DEVICE), cu_seqlens_q.to(DEVICE),
                seq_lens.to(DEVICE), self.scale, int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max()),
                int(seq_lens.max()))
        if isinstance(backend, TritonBackend):
            out = torch.full_like(query, float("nan"))
            assert backend.paged_attention(*args, out=out) is out
        else:
            out = backend.paged_attention(*args)
        return out.cpu()

    def reference(self, span: Span) -> torch.Tensor:
        """float64 SDPA of the span's queries over its sequence's first `end` keys, causal from the end."""
        seq, start, end = span
        q, k, v = (t.double().transpose(0, 1) for t in (self.queries[seq][start:end], self.keys[seq][:end],
                                                           self.values[seq][:end]))
        mask = torch.arange(end)[None, :] <= torch.arange(start, end)[:, None]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale,
                                              enable_gqa=True).transpose(0, 1)

    def step(self, backend: AttentionBackend, spans: list[Span]) -> list[torch.Tensor]:
        """What the engine does per step: write the new tokens' K/V, then attend."""
        self.write(backend, spans)
        return self.attend(backend, spans)

    def forget(self, seq: int) -> None:
        """Poison a sequence's slots again, so that a rerun cannot read K/V its steps have not written yet."""
        slots = self.slots([(seq, 0, len(self.keys[seq]))]).to(DEVICE)
        for cache in (self.k_cache, self.v_cache):
            cache.view(-1, *cache.shape[2:])[slots] = self.poison


def mixed_spans(block_size: int, gen: torch.Generator) -> list[tuple[int, int]]:
    """(query length, KV length) of a batch mixing every kind of row, in random order.

    Decode rows over context, a single-token sequence, a pure prefill, a prefill chunk over cached
    context, and KV lengths just at and just past a block boundary.
    """
    def r(lo: int, hi: int) -> int:
        return int(torch.randint(lo, hi + 1, (), generator=gen))

    edge = block_size * r(1, max(1, 40 // block_size))
    prompt, chunk = r(2, 40), r(2, 30)
    kinds = [(1, r(2, 70)), (1, r(2, 70)), (1, 1), (prompt, prompt), (chunk, chunk + r(1, 40)),
             (min(r(1, 8), edge), edge), (min(r(1, 8), edge + 1), edge + 1)]
    return [kinds[i] for i in torch.randperm(len(kinds), generator=gen).tolist()]


def run_mixed(backend: AttentionBackend, gen: torch.Generator, block_size: int, group: int, head_dim: int,
              dtype: torch.dtype, poison: float = float("nan")) -> None:
    """One mixed step: the context is written first, then the step's tokens; every row vs the reference."""
    shapes = mixed_spans(block_size, gen)
    work = Workload([kv for _, kv in shapes], block_size, 2, group, head_dim, dtype, gen, poison)
    context = [(seq, 0, kv - q) for seq, (q, kv) in enumerate(shapes) if kv > q]
    if context:
        work.fill(context)
    spans = [(seq, kv - q, kv) for seq, (q, kv) in enumerate(shapes)]
    for span, out in zip(spans, work.step(backend, spans)):
        assert_matches(out, work.reference(span), dtype, f"span {span} of {spans}")


def assert_matches(out: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, what: str) -> None:
    assert not out.isnan().any(), f"NaN in output: {what}"
    tol = TOLERANCES[dtype]
    torch.testing.assert_close(out.double(), expected, atol=tol, rtol=tol, msg=lambda m: f"{what}\n{m}")


# Every GQA group with every block size, each pair once in fp32 and fp16 across the list: every pair of
# the three parameters is covered in 12 cases rather than all 24 triples. The dtype only changes what the
# loads convert and what the dots multiply, not which elements are addressed or masked, so it has no
# 3-way interaction with the paging (block size) and the row layout (group) to miss.
MIXED_CASES = [(group, block_size, (torch.float32, torch.float16)[(i + j) % 2])
               for i, group in enumerate([1, 2, 4, 8]) for j, block_size in enumerate([1, 16, NOT_POW2_BLOCK])]


@pytest.mark.parametrize(("group", "block_size", "dtype"), MIXED_CASES,
                         ids=[f"group{g}-block{b}-{str(d).removeprefix('torch.')}" for g, b, d in MIXED_CASES])
def test_triton_mixed_batch_matches_reference(gen, group, block_size, dtype):
    run_mixed(TritonBackend(), gen, block_size, group, 32, dtype)


def test_triton_decode_only_batch(gen):
    """The engine's most common step: one new token for each of many sequences."""
    lengths = torch.randint(1, 90, (12,), generator=gen).tolist()
    work = Workload(lengths, 16, 2, 4, 32, torch.float16, gen)
    backend = TritonBackend()
    work.fill([(seq, 0, n - 1) for seq, n in enumerate(lengths) if n > 1])
    spans = [(seq, n - 1, n) for seq, n in enumerate(lengths)]
    for span, out in zip(spans, work.step(backend, spans)):
        assert_matches(out, work.reference(span), torch.float16, f"span {span} of {spans}")


@pytest.mark.parametrize("head_dim", [32, 64, 128, 256, 80])
def test_triton_head_dims(gen, head_dim):
    run_mixed(TritonBackend(), gen, 16, 2, head_dim, torch.float16)


def test_triton_bfloat16(gen):
    run_mixed(TritonBackend(), gen, 16, 4, 64, torch.bfloat16)


@pytest.mark.parametrize("block_size", [1, 16, NOT_POW2_BLOCK])
@pytest.mark.parametrize("group", [1, 4])
def test_torch_backend_matches_reference(gen, group, block_size):
    """Finite poison: the torch backend's masked SDPA turns NaN in unwritten slots into NaN rows (0 * NaN)."""
    run_mixed(TorchBackend(), gen, block_size, group, 32, torch.float32, poison=1e4)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_torch_backend_matches_reference_in_16_bits(gen, dtype):
    """Decode rows, short and long prefill chunks in a 16-bit dtype (on a CPU their masked calls compute in
    float32): within the dtype's tolerance of the float64 reference."""
    run_mixed(TorchBackend(), gen, 16, 4, 64, dtype, poison=1e4)


def test_rows_without_visible_keys_are_zero(gen):
    """Rows before the context start see no key: zeros, not NaN; an empty sequence in the batch is skipped."""
    work = Workload([1, 9], 4, 2, 2, 32, torch.float32, gen)
    backend = TritonBackend()
    work.write(backend, [(0, 0, 1), (1, 0, 9)])
    # Sequence 0: 3 queries over 1 key, so only its last row sees a key; sequence 1: 0 queries; sequence 2: 2.
    query = torch.cat([work.queries[0].expand(3, -1, -1), work.queries[1][7:9]])
    cu = torch.tensor([0, 3, 3, 5], dtype=torch.int32)
    out = work.launch(backend, query, work.table[[0, 1, 1]], cu, torch.tensor([1, 9, 9], dtype=torch.int32))
    assert torch.equal(out[:2], torch.zeros_like(out[:2]))
    assert torch.equal(out[2], work.values[0][0].repeat_interleave(2, dim=0))
    assert_matches(out[3:], work.reference((1, 7, 9)), torch.float32, "sequence after an empty one")


@pytest.mark.parametrize("block_size", [1, 16, NOT_POW2_BLOCK])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_write_kv_matches_index_assignment(gen, dtype, block_size):
    work = Workload([23, 1, 40], block_size, 2, 1, 64, dtype, gen)
    spans = [(2, 5, 40), (0, 0, 23), (1, 0, 1)]
    k_expected, v_expected = work.k_cache.clone(), work.v_cache.clone()
    slots = work.slots(spans).to(DEVICE)
    k_expected.view(-1, 2, 64)[slots] = torch.cat([work.keys[s][a:b] for s, a, b in spans]).to(DEVICE)
    v_expected.view(-1, 2, 64)[slots] = torch.cat([work.values[s][a:b] for s, a, b in spans]).to(DEVICE)
    work.write(TritonBackend(), spans)
    assert torch.equal(work.k_cache.nan_to_num(7.0), k_expected.nan_to_num(7.0))
    assert torch.equal(work.v_cache.nan_to_num(7.0), v_expected.nan_to_num(7.0))


def chunked(seq: int, length: int, size: int) -> list[Span]:
    return [(seq, start, min(start + size, length)) for start in range(0, length, size)]


def row_independent_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
    """The interpreter's `tl.dot` with each output element a fixed-order sum: `d + a[i,0]*b[0,j] + a[i,1]*b[1,j] ...`.

    The interpreter's own `tl.dot` is numpy's matmul, i.e. OpenBLAS, whose result for a row can depend on
    the row's place in the tile: with the Haswell (AVX2) sgemm kernels, row 0 of a 32x32 @ 32x32 product
    is bitwise equal when moved to rows 0-5 and 12-17 only (with SkylakeX kernels, in every row). Here
    element (i, j) is a function of row i of `a`, column j of `b` and `d[i, j]` alone, on any processor.
    """
    assert a.data.ndim == b.data.ndim == 2 and a.dtype.primitive_bitwidth > 8
    acc_dtype = d.data.dtype
    products = a.data.astype(acc_dtype)[:, :, None] * b.data.astype(acc_dtype)[None, :, :]
    acc = d.data.copy()
    for k in range(products.shape[1]):
        acc += products[:, k, :]
    return interpreter.TensorHandle(acc, d.dtype.scalar)


@pytest.fixture
def row_independent_interpreter_dot(monkeypatch: pytest.MonkeyPatch) -> None:
    if INTERPRETED:
        monkeypatch.setattr(interpreter.InterpreterBuilder, "create_dot", row_independent_dot)


@pytest.mark.parametrize("partition", [0, 32])
@pytest.mark.parametrize("block_size", [16, NOT_POW2_BLOCK])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_batch_invariance(gen, dtype, block_size, partition, row_independent_interpreter_dot):
    """A sequence's rows are bitwise equal alone, among other sequences, and through chunks of 1, 7 and 33.

    40 tokens: under the interpreter 5 query tiles and 2 KV tiles (group 4: 8 tokens per query tile, 32 keys
    per KV tile); chunks of 7 cross tile and block boundaries and meet KV tiles fully masked for some of
    their rows, and the chunk after 33 tokens starts past the first KV tile.

    What this proves is the kernel's part of batch invariance: fixed tile shapes, KV tiles walked from 0,
    per-element masks, exact no-op masked tiles. A row lands at a different place in its query tile
    depending on the chunking, so the tile products themselves must not depend on the row's place. On a
    GPU the MMA instructions give that (checked bitwise by benchmarks/kernels_gpu.py); under the interpreter
    `tl.dot` is OpenBLAS, which does not on every processor, so here it is replaced by
    `row_independent_dot` while everything else in the kernel runs as is.

    With partitions of 32 keys, the chunks of 1 past the first partition are decode steps that split (a program
    per partition, then their merge): bitwise equal to the rows of the one kernel that merges the same partitions.
    """
    length = 40
    others = torch.randint(1, 60, (6,), generator=gen).tolist()
    work = Workload([length, *others], block_size, 2, 4, 32, dtype, gen)
    backend = TritonBackend(TileConfig(32, 32, partition=partition) if partition else None)
    work.fill([(seq, 0, n) for seq, n in enumerate(others, start=1)])

    (alone,) = work.step(backend, [(0, 0, length)])
    assert_matches(alone, work.reference((0, 0, length)), dtype, "the sequence alone")
    among = work.attend(backend, [(1, 0, others[0]), (2, others[1] - 1, others[1]), (0, 0, length),
                                  *[(seq, n // 2, n) for seq, n in enumerate(others[2:], start=3)]])[2]
    assert torch.equal(among, alone), "alone vs among six other sequences"
    for size in (1, 7, 33):
        work.forget(0)
        rows = torch.cat([work.step(backend, [span])[0] for span in chunked(0, length, size)])
        assert torch.equal(rows, alone), f"one prefill vs chunks of {size}"
    work.forget(0)
    batched = []
    for i, span in enumerate(chunked(0, length, 7)):
        neighbours = [(1 + (i + j) % 6, 0, others[(i + j) % 6]) for j in range(i % 3)]
        decode = (1 + (i + 3) % 6, others[(i + 3) % 6] - 1, others[(i + 3) % 6])
        work.write(backend, [span])  # the neighbours' K/V are in the cache already; rewriting them proves nothing
        batched.append(work.attend(backend, [*neighbours, span, decode])[len(neighbours)])
    assert torch.equal(torch.cat(batched), alone), "one prefill vs chunks of 7 each in a different batch"


@pytest.mark.parametrize(("group", "dtype"), [(7, torch.float16), (1, torch.float32), (4, torch.bfloat16)])
def test_split_decode_matches_reference_and_one_kernel(gen, group, dtype, row_independent_interpreter_dot,
                                                       monkeypatch):
    """A decode step over contexts of up to five partitions splits: each row within tolerance of float64, and
    bitwise equal to the same rows split over the block tables' whole width (as CUDA graphs run it, with no host bound
    on the contexts), from the one kernel (told a bound of 2 queries, so it does not split) and inside a mixed batch.
    The partitions' states start NaN: one read before it is written shows. Rows of one token (one partition) and at
    a partition's edge are among them."""
    lengths = [1, 32, 33, 150, *torch.randint(6, 160, (5,), generator=gen).tolist()]  # the last takes 5 queries
    work = Workload(lengths, 16, 2, group, 32, dtype, gen)
    work.fill([(seq, 0, n - 1) for seq, n in enumerate(lengths) if n > 1])
    backend = TritonBackend(TileConfig(32, 32, partition=32))
    states = backend._partition_states
    calls = []

    def poisoned_states(*args):
        calls.append(args[0])
        return tuple(state.fill_(float("nan")) for state in states(*args))

    monkeypatch.setattr(backend, "_partition_states", poisoned_states)
    spans = [(seq, n - 1, n) for seq, n in enumerate(lengths)]
    split = work.step(backend, spans)
    assert calls == [-(-max(lengths) // 32)], "the decode step did not split"
    for span, out in zip(spans, split):
        assert_matches(out, work.reference(span), dtype, f"span {span} of {spans}")
    query = torch.cat([work.queries[s][a:b] for s, a, b in spans]).to(DEVICE)
    args = (query, work.k_cache, work.v_cache, work.table.to(DEVICE),
            torch.arange(len(spans) + 1, dtype=torch.int32, device=DEVICE),
            torch.tensor(lengths, dtype=torch.int32, device=DEVICE), work.scale)
    widest = backend.decode_attention(*args).cpu()
    assert calls[1:] == [work.table.shape[1] * 16 // 32], "the graphs' decode did not split over the tables' width"
    assert torch.equal(torch.cat(split), widest), "split by the longest context vs by the tables' width"
    one_kernel = backend.paged_attention(*args, 2, max(lengths)).cpu()
    assert torch.equal(torch.cat(split), one_kernel), "split vs one kernel"
    prefill = (len(lengths) - 1, lengths[-1] - 5, lengths[-1])
    mixed = work.attend(backend, [*spans[:-1], prefill])
    assert torch.equal(torch.cat(mixed[:-1]), torch.cat(split[:-1])), "split vs inside a mixed batch"
    assert len(calls) == 2, "the one kernel or a step with a prefill chunk split"


def test_partition_is_a_multiple_of_the_kv_tile():
    with pytest.raises(ValueError, match="partition: 48 is not a multiple of block_n"):
        TileConfig(32, 32, partition=48)


def test_get_backend_returns_triton():
    backend = get_backend("triton", DEVICE)
    assert isinstance(backend, TritonBackend) and backend.name == "triton"


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter runs only without CUDA")
def test_interpreter_runs_when_triton_was_imported_first():
    """The engine imports transformers, which imports triton before TRITON_INTERPRET can be set."""
    script = textwrap.dedent("""
        import triton.language
        import torch
        from tokenmill.kernels.torch_attention import TorchBackend
        from tokenmill.kernels.triton_attention import TritonBackend
        cache = [torch.randn(4, 16, 2, 32) for _ in range(2)]
        args = (torch.randn(5, 4, 32), *cache, torch.tensor([[2, 0], [1, 3]], dtype=torch.int32),
                torch.tensor([0, 1, 5], dtype=torch.int32), torch.tensor([9, 20], dtype=torch.int32), 0.2, 4, 20)
        torch.testing.assert_close(TritonBackend().paged_attention(*args), TorchBackend().paged_attention(*args))
    """)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-c", script], env=env, cwd=Path(__file__).parents[1],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
