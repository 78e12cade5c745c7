"""Triton attention backend: one launch per step for a ragged batch over the paged KV cache.

`paged_attention` runs a single kernel over every query of the step, decode rows and prefill chunks alike.
The grid is (query tile, KV head). A query tile holds up to ``BLOCK_Q`` consecutive query tokens of one
sequence times all ``Hq / Hkv`` query heads that share the KV head (GQA), so K/V are read once per group.
Each program finds its sequence by a binary search over the cumulative query lengths, then streams the
sequence's K/V in tiles of ``BLOCK_N`` tokens through its block table with an online softmax.

Batch invariance (bitwise-equal rows whatever the batch and the chunking) comes from three rules:

- tile shapes are fixed per device kind and head dim (`TileConfig`), never chosen from the batch;
- every program walks KV tiles from position 0 in steps of ``BLOCK_N``; only the loop's end depends on
  the tile, and the extra tiles a row may see are fully masked for it, which is an exact no-op
  (max unchanged, rescale by ``exp2(0) == 1``, zero added to the sum and the accumulator);
- masking is per element (causal position and context length), so a row's scores never depend on which
  other rows share its tile.

Without CUDA, the kernels run through Triton's interpreter (slow; for tests). bf16 ``tl.dot`` is wrong in the
interpreter (it multiplies the raw uint16 bits), so there the dot operands are upcast to fp32. The kernels
avoid triton.language's own @jit helpers (``tl.zeros``, ``tl.max``, ``tl.sum``): when triton was imported
before TRITON_INTERPRET was set (transformers imports it), those stay GPU-only and the interpreter cannot
call them. The reductions name the combine functions ``tl.max``/``tl.sum`` use, which the interpreter
recognises and runs as numpy reductions.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

if not torch.cuda.is_available():
    # Must be set before the kernels below are decorated; triton reads it at @triton.jit time.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

INTERPRETED = triton.knobs.runtime.interpret

_TL_DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


@dataclass(frozen=True)
class TileConfig:
    """Tile shape and launch options of the attention kernel.

    Chosen from the device kind, head dim and dtype only, never from the batch, so that a row's
    floating-point reduction order is the same in every batch it appears in.
    """

    block_m: int  # query rows per program (query tokens x padded GQA group)
    block_n: int  # KV tokens per inner-loop step
    num_warps: int = 4
    num_stages: int = 2
    # KV tokens per partition of the online softmax, a multiple of block_n (0: one pass over all keys). With it, a
    # decode step whose contexts pass one partition runs a program per partition and merges them in a second kernel
    # (flash decoding), bitwise equal to the one-kernel path, which merges the same partitions in the same order.
    partition: int = 0

    def __post_init__(self) -> None:
        if self.partition % self.block_n:
            raise ValueError(f"partition: {self.partition} is not a multiple of block_n ({self.block_n})")


def default_config(head_dim: int, dtype: torch.dtype, on_gpu: bool) -> TileConfig:
    """The tile shape for a model's head dim and dtype on this device kind.

    Interpreter: few, large numpy ops. GPU: 64x64 fp16/bf16 tiles run on tensor cores with a cp.async pipeline
    (with no register spills up to head dim 64; ~300 bytes a thread at 128), and 64 query rows keep decode
    memory-bound; fp32 products are IEEE FMAs, which spill registers unless the tiles are small. The pipeline's
    depth per head dim is what `benchmarks/kernels_gpu.py` measured faster (docs/internals/gpu-path.md); the stages
    change no result, only the time.
    """
    if not on_gpu:
        return TileConfig(block_m=32, block_n=32)
    if dtype == torch.float32:
        return TileConfig(block_m=32, block_n=16, num_warps=4, num_stages=2)
    if head_dim <= 64:
        return TileConfig(block_m=64, block_n=64, num_warps=4, num_stages=2)
    if head_dim <= 128:
        return TileConfig(block_m=64, block_n=64, num_warps=4, num_stages=3)
    return TileConfig(block_m=64, block_n=32, num_warps=4, num_stages=2)


@triton.jit
def _find_sequence(cu_seqlens_q_ptr, tile_idx, num_seqs, BLOCK_Q: tl.constexpr):
    """Largest sequence `i` whose first tile index ``cu_seqlens_q[i] // BLOCK_Q + i`` is <= `tile_idx`.

    Sequence `i` owns tile indices from that value on; the `+ i` leaves room for each sequence's partial
    last tile, so ``T // BLOCK_Q + S`` tile indices cover any batch without reading lengths on the host.
    """
    lo = 0
    hi = num_seqs
    while lo < hi - 1:
        mid = (lo + hi) // 2
        first_tile = tl.load(cu_seqlens_q_ptr + mid) // BLOCK_Q + mid
        if first_tile <= tile_idx:
            lo = mid
        else:
            hi = mid
    return lo


@triton.jit
def _attend(q, k_cache_ptr, v_cache_ptr, table_row, head_offs, dims, dim_ok, q_pos, kv_lo, kv_hi, qk_scale,
            stride_cb, stride_cs, stride_cd, stride_bc,
            BLOCK_M: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
            DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """The online softmax of a tile's rows over the keys `[kv_lo, kv_hi)`, from a fresh state: (max, sum, accumulator)
    with the accumulator not yet divided by the sum. `kv_lo` is a multiple of BLOCK_N."""
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.full([BLOCK_M], 0.0, tl.float32)
    acc = tl.full([BLOCK_M, HEAD_DIM_PAD], 0.0, tl.float32)
    for kv_start in range(kv_lo, kv_hi, BLOCK_N):
        kv_pos = kv_start + tl.arange(0, BLOCK_N)
        kv_ok = kv_pos < kv_hi
        block_id = tl.load(table_row + (kv_pos // BLOCK_SIZE) * stride_bc, mask=kv_ok, other=0)
        token_offs = block_id.to(tl.int64) * stride_cb + (kv_pos % BLOCK_SIZE) * stride_cs + head_offs
        kv_mask = kv_ok[:, None] & dim_ok[None, :]
        kv_offs = token_offs[:, None] + dims[None, :] * stride_cd
        k = tl.load(k_cache_ptr + kv_offs, mask=kv_mask, other=0.0).to(DOT_DTYPE)
        scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
        scores = tl.where(kv_pos[None, :] <= q_pos[:, None], scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.reduce(scores, 1, tl.standard._elementwise_max))
        # A row with no visible key yet keeps m = -inf; shift by 0 instead so exp2 gives 0, not NaN.
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(scores - shift[:, None])
        # Exactly 1 when the max holds, even if exp2 is approximate: a tile fully masked for a row leaves it
        # bit-for-bit unchanged, so the extra tiles a chunking adds cannot change the row.
        alpha = tl.where(m_new == m_i, 1.0, tl.exp2(m_i - shift))
        l_i = l_i * alpha + tl.reduce(p, 1, tl.standard._sum_combine)
        v = tl.load(v_cache_ptr + kv_offs, mask=kv_mask, other=0.0).to(DOT_DTYPE)
        acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), v, input_precision=DOT_PRECISION)
        m_i = m_new
    return m_i, l_i, acc


@triton.jit
def _merge(m_i, l_i, acc, m_p, l_p, acc_p):
    """The state after keys of two states (a running one, then a partition's): the same rule as a tile within
    `_attend`. A partition with no visible key for a row (m_p = -inf) leaves the row bit for bit unchanged, and the
    first merge into the empty state (m_i = -inf) gives the partition's state exactly."""
    m_new = tl.maximum(m_i, m_p)
    shift = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.where(m_new == m_i, 1.0, tl.exp2(m_i - shift))
    beta = tl.where(m_new == m_p, 1.0, tl.exp2(m_p - shift))
    return m_new, l_i * alpha + l_p * beta, acc * alpha[:, None] + acc_p * beta[:, None]


# Batch-dependent ints stay unspecialised: one compiled kernel serves every batch.
@triton.jit(do_not_specialize=["num_seqs", "stride_bt", "num_tokens"])
def _paged_attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, block_tables_ptr, cu_seqlens_q_ptr, seq_lens_ptr,
    part_m_ptr, part_l_ptr, part_acc_ptr,
    qk_scale, num_seqs, num_tokens,
    stride_qt, stride_qh, stride_qd,
    stride_ot, stride_oh, stride_od,
    stride_cb, stride_cs, stride_ch, stride_cd,
    stride_bt, stride_bc,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr, PARTITION: tl.constexpr, SPLIT: tl.constexpr,
):
    """PARTITION = 0: one online softmax over all keys. Otherwise the keys go in partitions of PARTITION from 0, each
    from a fresh state, merged in order (`_merge`). SPLIT: this program computes only partition `program_id(2)` and
    stores its state per row and head in `part_*` (`[partition, token, head]`, the accumulator with `HEAD_DIM_PAD`
    more), for `_merge_partitions_kernel`; `out` is not written."""
    tile_idx = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = _find_sequence(cu_seqlens_q_ptr, tile_idx, num_seqs, BLOCK_Q)
    q_start = tl.load(cu_seqlens_q_ptr + seq)
    q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
    tile_start = (tile_idx - (q_start // BLOCK_Q + seq)) * BLOCK_Q
    if tile_start >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - q_len
    # The tile's last row needs keys up to context_len + tile_start + BLOCK_Q - 1; earlier rows mask the rest.
    kv_end = tl.minimum(seq_len, context_len + tile_start + BLOCK_Q)
    if SPLIT:
        part_start = tl.program_id(2) * PARTITION
        if part_start >= kv_end:
            return

    BLOCK_M: tl.constexpr = BLOCK_Q * GROUP_PAD
    rows = tl.arange(0, BLOCK_M)
    token = tile_start + rows // GROUP_PAD
    head = kv_head * GROUP + rows % GROUP_PAD
    row_ok = (token < q_len) & (rows % GROUP_PAD < GROUP)
    q_pos = context_len + token  # the row's position in its sequence; it sees keys 0..q_pos
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_ok = dims < HEAD_DIM

    row_offs = (q_start + token).to(tl.int64)[:, None]
    io_mask = row_ok[:, None] & dim_ok[None, :]
    q_offs = row_offs * stride_qt + head[:, None] * stride_qh + dims[None, :] * stride_qd
    q = tl.load(q_ptr + q_offs, mask=io_mask, other=0.0).to(DOT_DTYPE)

    table_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    head_offs = kv_head.to(tl.int64) * stride_ch
    if SPLIT:
        m_i, l_i, acc = _attend(q, k_cache_ptr, v_cache_ptr, table_row, head_offs, dims, dim_ok, q_pos, part_start,
                                tl.minimum(part_start + PARTITION, kv_end), qk_scale, stride_cb, stride_cs, stride_cd,
                                stride_bc, BLOCK_M, HEAD_DIM_PAD, BLOCK_SIZE, BLOCK_N, DOT_DTYPE, DOT_PRECISION)
        state = (tl.program_id(2).to(tl.int64) * num_tokens + q_start + token.to(tl.int64)) * (GROUP * \
            tl.num_programs(1)) + head
        tl.store(part_m_ptr + state, m_i, mask=row_ok)
        tl.store(part_l_ptr + state, l_i, mask=row_ok)
        tl.store(part_acc_ptr + state[:, None] * HEAD_DIM_PAD + dims[None, :], acc, mask=row_ok[:, None])
        return
    if PARTITION == 0:
        m_i, l_i, acc = _attend(q, k_cache_ptr, v_cache_ptr, table_row, head_offs, dims, dim_ok, q_pos, 0, kv_end,
                                qk_scale, stride_cb, stride_cs, stride_cd, stride_bc,
                                BLOCK_M, HEAD_DIM_PAD, BLOCK_SIZE, BLOCK_N, DOT_DTYPE, DOT_PRECISION)
    else:
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.full([BLOCK_M], 0.0, tl.float32)
        acc = tl.full([BLOCK_M, HEAD_DIM_PAD], 0.0, tl.float32)
        for part in range(0, kv_end, PARTITION):
            m_p, l_p, acc_p = _attend(q, k_cache_ptr, v_cache_ptr, table_row, head_offs, dims, dim_ok, q_pos, part,
                                      tl.minimum(part + PARTITION, kv_end), qk_scale, stride_cb, stride_cs, stride_cd,
                                      stride_bc, BLOCK_M, HEAD_DIM_PAD, BLOCK_SIZE, BLOCK_N, DOT_DTYPE, DOT_PRECISION)
            m_i, l_i, acc = _merge(m_i, l_i, acc, m_p, l_p, acc_p)

    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    out_offs = row_offs * stride_ot + head[:, None] * stride_oh + dims[None, :] * stride_od
    tl.store(out_ptr + out_offs, out.to(out_ptr.dtype.element_ty), mask=io_mask)


@triton.jit(do_not_specialize=["num_tokens"])
def _merge_partitions_kernel(
    out_ptr, seq_lens_ptr, part_m_ptr, part_l_ptr, part_acc_ptr, num_tokens,
    stride_ot, stride_oh, stride_od,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    PARTITION: tl.constexpr,
):
    """A decode step's rows (token i is sequence i's one query) from their partitions' states, merged in order as
    the partitioned `_paged_attention_kernel` merges them: the same bits. Program (token, KV head): its GQA group."""
    token = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    rows = tl.arange(0, GROUP_PAD)
    row_ok = rows < GROUP
    head = kv_head * GROUP + rows
    dims = tl.arange(0, HEAD_DIM_PAD)
    num_heads = GROUP * tl.num_programs(1)
    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.full([GROUP_PAD], 0.0, tl.float32)
    acc = tl.full([GROUP_PAD, HEAD_DIM_PAD], 0.0, tl.float32)
    for part in range(0, (tl.load(seq_lens_ptr + token) + PARTITION - 1) // PARTITION):
        state = (part * num_tokens + token) * num_heads + head
        m_p = tl.load(part_m_ptr + state, mask=row_ok, other=float("-inf"))
        l_p = tl.load(part_l_ptr + state, mask=row_ok, other=0.0)
        acc_p = tl.load(part_acc_ptr + state[:, None] * HEAD_DIM_PAD + dims[None, :], mask=row_ok[:, None], other=0.0)
        m_i, l_i, acc = _merge(m_i, l_i, acc, m_p, l_p, acc_p)
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    out_offs = token * stride_ot + head[:, None] * stride_oh + dims[None, :] * stride_od
    tl.store(out_ptr + out_offs, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & (dims < HEAD_DIM)[None, :])


@triton.jit
def _write_kv_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
    stride_kt, stride_kh, stride_kd, stride_vt, stride_vh, stride_vd,
    stride_cb, stride_cs, stride_ch, stride_cd,
    NUM_HEADS: tl.constexpr, HEADS_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token)
    heads = tl.arange(0, HEADS_PAD)
    dims = tl.arange(0, HEAD_DIM_PAD)
    mask = (heads < NUM_HEADS)[:, None] & (dims < HEAD_DIM)[None, :]
    cache_offs = ((slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_cs
                  + heads[:, None] * stride_ch + dims[None, :] * stride_cd)
    key = tl.load(key_ptr + token * stride_kt + heads[:, None] * stride_kh + dims[None, :] * stride_kd, mask=mask)
    value = tl.load(value_ptr + token * stride_vt + heads[:, None] * stride_vh + dims[None, :] * stride_vd, mask=mask)
    tl.store(k_cache_ptr + cache_offs, key.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + cache_offs, value.to(v_cache_ptr.dtype.element_ty), mask=mask)


class TritonBackend:
    """The attention backend interface of `tokenmill.kernels`, on Triton kernels.

    `config` pins the tile shape (benchmarks sweep it); by default it follows `default_config`.
    """

    name = "triton"

    def __init__(self, config: TileConfig | None = None) -> None:
        from tokenmill.kernels import triton_layers

        self.config = config
        # A decoder layer's elementwise parts, one kernel each (`tokenmill.kernels.triton_layers`).
        self.add_rms_norm = triton_layers.add_rms_norm
        self.rotary = triton_layers.rotary
        self.silu_and_mul = triton_layers.silu_and_mul

    def write_kv(
        self, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        num_tokens, num_heads, head_dim = key.shape
        if num_tokens == 0:
            return
        _check_same_cache_layout(k_cache, v_cache)
        _write_kv_kernel[(num_tokens,)](
            key, value, k_cache, v_cache, slot_mapping,
            *key.stride(), *value.stride(), *k_cache.stride(),
            NUM_HEADS=num_heads, HEADS_PAD=triton.next_power_of_2(num_heads),
            HEAD_DIM=head_dim, HEAD_DIM_PAD=triton.next_power_of_2(head_dim), BLOCK_SIZE=k_cache.shape[1],
        )

    def paged_attention(
        self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
        cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor, scale: float, max_seqlen_q: int, max_seq_len: int,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`out`, if given, receives the result (it must be `[T, Hq, D]` in the query dtype) and is returned."""
        num_tokens, num_q_heads, head_dim = query.shape
        num_kv_heads = k_cache.shape[2]
        if num_q_heads % num_kv_heads:
            raise ValueError(f"{num_q_heads} query heads are not a multiple of {num_kv_heads} KV heads")
        _check_same_cache_layout(k_cache, v_cache)
        if out is None:
            out = torch.empty_like(query, memory_format=torch.contiguous_format)
        if num_tokens == 0:
            return out
        group = num_q_heads // num_kv_heads
        group_pad = triton.next_power_of_2(group)
        head_dim_pad = max(16, triton.next_power_of_2(head_dim))
        config = self.config or default_config(head_dim_pad, query.dtype, query.is_cuda)
        block_q = max(1, config.block_m // group_pad)
        num_seqs = cu_seqlens_q.shape[0] - 1
        dot_dtype, precision = _dot_types(query.dtype)
        # Every row a sequence's one query (the sum of at most 1 per sequence is their count) and some context past
        # a partition: a program per partition, then their merge.
        num_parts = -(-max_seq_len // config.partition) if config.partition else 0
        split = max_seqlen_q == 1 and num_tokens == num_seqs and num_parts > 1
        grid = (num_tokens // block_q + num_seqs, num_kv_heads, num_parts if split else 1)
        parts = self._partition_states(num_parts, num_tokens, num_q_heads, head_dim_pad, query.device) if split \
            else (out, out, out)
        _paged_attention_kernel[grid](
            query, k_cache, v_cache, out, block_tables, cu_seqlens_q, seq_lens, *parts,
            scale * 1.4426950408889634, num_seqs, num_tokens,  # log2(e): the kernel uses exp2
            *query.stride(), *out.stride(), *k_cache.stride(), *block_tables.stride(),
            GROUP=group, GROUP_PAD=group_pad, HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad,
            BLOCK_SIZE=k_cache.shape[1], BLOCK_Q=block_q, BLOCK_N=config.block_n,
            DOT_DTYPE=dot_dtype, DOT_PRECISION=precision, PARTITION=config.partition, SPLIT=split,
            num_warps=config.num_warps, num_stages=config.num_stages,
        )
        if split:
            _merge_partitions_kernel[(num_tokens, num_kv_heads)](
                out, seq_lens, *parts, num_tokens, *out.stride(),
                GROUP=group, GROUP_PAD=group_pad, HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad,
                PARTITION=config.partition,
            )
        return out

    def _partition_states(self, num_parts: int, num_tokens: int, num_heads: int, head_dim_pad: int,
                          device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Each partition's max, sum and accumulator per row and head (float32), written before they are read."""
        shape = (num_parts, num_tokens, num_heads)
        return (torch.empty(shape, dtype=torch.float32, device=device),
                torch.empty(shape, dtype=torch.float32, device=device),
                torch.empty((*shape, head_dim_pad), dtype=torch.float32, device=device))


    def decode_attention(
        self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
        cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor, scale: float,
    ) -> torch.Tensor:
        """`paged_attention` needs no host value: its grid follows the shapes. A row of context 0 reads no key
        and gets zeros. The contexts' bound is what the block tables' width holds, so a split decode (when
        `TileConfig.partition` is set) has a partition per `partition` keys of that width, most of them empty."""
        bound = block_tables.shape[1] * k_cache.shape[1]
        return self.paged_attention(query, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, scale, 1, bound)


def _dot_types(dtype: torch.dtype) -> tuple[tl.dtype, str]:
    """Operand dtype and precision of the kernel's `tl.dot`s.

    fp32 asks for IEEE products (the GPU default, tf32, loses ~3 digits); bf16 is upcast in the interpreter,
    which cannot multiply it.
    """
    if dtype not in _TL_DTYPES:
        raise TypeError(f"triton attention supports float32, float16 and bfloat16, not {dtype}")
    if dtype == torch.bfloat16 and INTERPRETED:
        return tl.float32, "ieee"
    return _TL_DTYPES[dtype], "ieee" if dtype == torch.float32 else "tf32"


def _check_same_cache_layout(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    """Both kernels address K and V with one set of strides."""
    if k_cache.shape != v_cache.shape or k_cache.stride() != v_cache.stride():
        raise ValueError(f"K and V caches differ in layout: {tuple(k_cache.shape)}/{k_cache.stride()} "
                         f"vs {tuple(v_cache.shape)}/{v_cache.stride()}")
