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


def default_config(head_dim: int, dtype: torch.dtype, on_gpu: bool) -> TileConfig:
    """The tile shape for a model's head dim and dtype on this device kind.

    Interpreter: few, large numpy ops. GPU: 64x64 fp16/bf16 tiles run on tensor cores with a cp.async pipeline
    and no register spills, and 64 query rows keep decode memory-bound; fp32 products are IEEE FMAs, which spill
    registers unless the tiles are small. The pipeline's depth per head dim is what `benchmarks/kernels_gpu.py`
    measured faster (docs/internals/gpu-path.md); the stages change no result, only the time.
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


# Batch-dependent ints stay unspecialised: one compiled kernel serves every batch.
@triton.jit(do_not_specialize=["num_seqs", "stride_bt"])
def _paged_attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, block_tables_ptr, cu_seqlens_q_ptr, seq_lens_ptr,
    qk_scale, num_seqs,
    stride_qt, stride_qh, stride_qd,
    stride_ot, stride_oh, stride_od,
    stride_cb, stride_cs, stride_ch, stride_cd,
    stride_bt, stride_bc,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
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

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.full([BLOCK_M], 0.0, tl.float32)
    acc = tl.full([BLOCK_M, HEAD_DIM_PAD], 0.0, tl.float32)
    # The tile's last row needs keys up to context_len + tile_start + BLOCK_Q - 1; earlier rows mask the rest.
    kv_end = tl.minimum(seq_len, context_len + tile_start + BLOCK_Q)
    table_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    head_offs = kv_head.to(tl.int64) * stride_ch
    for kv_start in range(0, kv_end, BLOCK_N):
        kv_pos = kv_start + tl.arange(0, BLOCK_N)
        kv_ok = kv_pos < kv_end
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

    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    out_offs = row_offs * stride_ot + head[:, None] * stride_oh + dims[None, :] * stride_od
    tl.store(out_ptr + out_offs, out.to(out_ptr.dtype.element_ty), mask=io_mask)


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
        grid = (num_tokens // block_q + num_seqs, num_kv_heads)
        _paged_attention_kernel[grid](
            query, k_cache, v_cache, out, block_tables, cu_seqlens_q, seq_lens,
            scale * 1.4426950408889634, num_seqs,  # log2(e): the kernel uses exp2
            *query.stride(), *out.stride(), *k_cache.stride(), *block_tables.stride(),
            GROUP=group, GROUP_PAD=group_pad, HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad,
            BLOCK_SIZE=k_cache.shape[1], BLOCK_Q=block_q, BLOCK_N=config.block_n,
            DOT_DTYPE=dot_dtype, DOT_PRECISION=precision,
            num_warps=config.num_warps, num_stages=config.num_stages,
        )
        return out


    def decode_attention(
        self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
        cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor, scale: float,
    ) -> torch.Tensor:
        """`paged_attention` needs no host value: its grid follows the shapes. A row of context 0 reads no key
        and gets zeros."""
        return self.paged_attention(query, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, scale, 1, 0)


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
