"""Reference attention backend in plain torch: correct on any device, the oracle the engine is tested with.

Decode rows (one query token each) are batched into a single SDPA call over the gathered block tables;
each prefill chunk gets its own SDPA call with the causal diagonal shifted to the end of its context.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class TorchBackend:
    name = "torch"

    def write_kv(
        self, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slot_mapping, key.to(k_cache.dtype))
        v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slot_mapping, value.to(v_cache.dtype))

    def paged_attention(
        self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
        cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor, scale: float, max_seqlen_q: int, max_seq_len: int,
    ) -> torch.Tensor:
        out = torch.empty_like(query)
        q_lens = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).tolist()
        starts = cu_seqlens_q[:-1].tolist()
        kv_lens = seq_lens.tolist()
        decode = [i for i, n in enumerate(q_lens) if n == 1]
        if decode:
            rows = cu_seqlens_q[:-1][decode]
            out[rows] = _decode(query[rows], k_cache, v_cache, block_tables[decode], seq_lens[decode], scale,
                                max(kv_lens[i] for i in decode))
        for i, n in enumerate(q_lens):
            if n > 1:
                rows = slice(starts[i], starts[i] + n)
                out[rows] = _prefill(query[rows], k_cache, v_cache, block_tables[i], kv_lens[i], scale)
        return out


def gather_kv(cache: torch.Tensor, block_row: torch.Tensor, length: int) -> torch.Tensor:
    """The first `length` tokens of one sequence's K or V, `[length, Hkv, D]`, read through its block table row."""
    block_size = cache.shape[1]
    num_blocks = (length + block_size - 1) // block_size
    return cache[block_row[:num_blocks].long()].flatten(0, 1)[:length]


def _prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_row: torch.Tensor,
             kv_len: int, scale: float) -> torch.Tensor:
    n = q.shape[0]
    k = gather_kv(k_cache, block_row, kv_len).transpose(0, 1)
    v = gather_kv(v_cache, block_row, kv_len).transpose(0, 1)
    # Query i sits at context position kv_len - n + i and sees every key up to it.
    mask = torch.ones(n, kv_len, dtype=torch.bool, device=q.device).tril(kv_len - n)
    o = F.scaled_dot_product_attention(q.transpose(0, 1), k.to(q.dtype), v.to(q.dtype), attn_mask=mask,
                                       scale=scale, enable_gqa=True)
    return o.transpose(0, 1)


def _decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
            seq_lens: torch.Tensor, scale: float, max_len: int) -> torch.Tensor:
    block_size = k_cache.shape[1]
    num_blocks = (max_len + block_size - 1) // block_size
    table = block_tables[:, :num_blocks].long()
    k = k_cache[table].flatten(1, 2)[:, :max_len].transpose(1, 2)  # [S, Hkv, L, D]
    v = v_cache[table].flatten(1, 2)[:, :max_len].transpose(1, 2)
    mask = torch.arange(max_len, device=q.device)[None, :] < seq_lens[:, None].to(q.device)
    o = F.scaled_dot_product_attention(q[:, :, None, :], k.to(q.dtype), v.to(q.dtype),
                                       attn_mask=mask[:, None, None, :], scale=scale, enable_gqa=True)
    return o[:, :, 0, :]
