"""Reference attention backend in plain torch: correct on any device, the oracle the engine is tested with.

Decode rows (one query token each) are sorted by context length and batched, a group of rows per SDPA call,
over their block tables gathered into reused buffers. Short prefill chunks (at most `short_prefill` query tokens:
the continuations of a scoring request, small chunks of a tight token budget) are batched the same way, their
queries padded to the group's longest and each row masked to the context before it; every other prefill chunk
gets its own SDPA call with the causal diagonal shifted to the end of its context.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tokenmill.kernels import layers


class TorchBackend:
    name = "torch"

    # A decoder layer's elementwise parts (`tokenmill.kernels.layers`), as transformers computes them.
    add_rms_norm = staticmethod(layers.add_rms_norm)
    rotary = staticmethod(layers.rotary)
    silu_and_mul = staticmethod(layers.silu_and_mul)

    # Decode rows are sorted by context length and attended in groups of this many, so each group pads only
    # to its own longest context instead of the whole batch's.
    decode_group = 16
    # Prefill chunks of at most this many query tokens are batched like decode rows (one SDPA call per group).
    short_prefill = 32

    def __init__(self) -> None:
        # Persistent gather buffers for decode K/V. A fresh tensor per layer and step costs more than the copy
        # itself on CPU once it passes glibc's 32 MiB mmap threshold (mmap, page faults, munmap every time).
        self._workspace: dict[str, torch.Tensor] = {}

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
        starts = cu_seqlens_q.tolist()
        kv_lens = seq_lens.tolist()
        q_lens = [b - a for a, b in zip(starts[:-1], starts[1:])]
        out = torch.empty_like(query)
        decode = sorted((i for i, n in enumerate(q_lens) if n == 1), key=kv_lens.__getitem__)
        for g in range(0, len(decode), self.decode_group):
            group = decode[g : g + self.decode_group]
            rows = torch.tensor([starts[i] for i in group], device=query.device)
            seqs = torch.tensor(group, device=block_tables.device)
            out[rows] = self._decode(query[rows], k_cache, v_cache, block_tables[seqs], seq_lens[seqs], scale,
                                     max(kv_lens[i] for i in group))
        short = sorted((i for i, n in enumerate(q_lens) if 1 < n <= self.short_prefill), key=kv_lens.__getitem__)
        for g in range(0, len(short), self.decode_group):
            self._short_prefill(out, query, k_cache, v_cache, block_tables, short[g : g + self.decode_group], starts,
                                q_lens, kv_lens, scale)
        for i, n in enumerate(q_lens):
            if n > self.short_prefill:
                rows = slice(starts[i], starts[i] + n)
                out[rows] = _prefill(query[rows], k_cache, v_cache, block_tables[i], kv_lens[i], scale)
        return out

    def decode_attention(
        self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
        cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor, scale: float,
    ) -> torch.Tensor:
        """One query per row, with no host read: every row reads its table's full width, keys past its context
        masked; a padding row (context 0) gets zeros."""
        out = self._decode(query, k_cache, v_cache, block_tables, seq_lens, scale,
                           block_tables.shape[1] * k_cache.shape[1])
        return out.masked_fill((seq_lens == 0)[:, None, None], 0.0)

    def _short_prefill(self, out: torch.Tensor, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       block_tables: torch.Tensor, group: list[int], starts: list[int], q_lens: list[int],
                       kv_lens: list[int], scale: float) -> None:
        """Attend the prefill chunks `group` (indices of sequences) in one SDPA call, into `out`: queries padded to
        the longest chunk (a padding row repeats its chunk's last query and is dropped), keys to the longest context;
        query j of chunk s sees the keys up to its own position, `kv_lens[s] - q_lens[s] + j`."""
        device = query.device
        width, length = max(q_lens[i] for i in group), max(kv_lens[i] for i in group)
        rows = [starts[i] + min(j, q_lens[i] - 1) for i in group for j in range(width)]
        q = query[torch.tensor(rows, device=device)].view(len(group), width, *query.shape[1:]).transpose(1, 2)
        block_size = k_cache.shape[1]
        table = block_tables[torch.tensor(group, device=block_tables.device), : -(-length // block_size)].long()
        k = self._gather("k", k_cache, table).flatten(1, 2)[:, :length].transpose(1, 2)  # [S, Hkv, L, D]
        v = self._gather("v", v_cache, table).flatten(1, 2)[:, :length].transpose(1, 2)
        last = [kv_lens[i] - q_lens[i] + min(j, q_lens[i] - 1) for i in group for j in range(width)]
        mask = torch.arange(length, device=device)[None, :] <= torch.tensor(last, device=device)[:, None]
        o = _masked_attention(q, k, v, mask.view(len(group), 1, width, length), scale)
        kept = [s * width + j for s, i in enumerate(group) for j in range(q_lens[i])]
        targets = [starts[i] + j for i in group for j in range(q_lens[i])]
        o = o.transpose(1, 2).reshape(len(group) * width, *query.shape[1:])
        out[torch.tensor(targets, device=device)] = o[torch.tensor(kept, device=device)]

    def _gather(self, name: str, cache: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
        """`cache[blocks]`, shape `[*blocks.shape, block_size, Hkv, D]`, written into a reused buffer. A CUDA graph
        being captured gets a buffer of its own, from its pool: the reused one may be replaced by a later step, and
        the graph would then write memory that is no longer its."""
        count = blocks.numel() * cache[0].numel()
        if cache.is_cuda and torch.cuda.is_current_stream_capturing():
            buffer = torch.empty(count, dtype=cache.dtype, device=cache.device)
        else:
            buffer = self._workspace.get(name)
            if buffer is None or buffer.numel() < count or buffer.dtype != cache.dtype or buffer.device != cache.device:
                buffer = self._workspace[name] = torch.empty(count + count // 4, dtype=cache.dtype, device=cache.device)
        flat = buffer[:count].view(blocks.numel(), -1)
        torch.index_select(cache.view(cache.shape[0], -1), 0, blocks.reshape(-1), out=flat)
        return flat.view(*blocks.shape, *cache.shape[1:])

    def _decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                seq_lens: torch.Tensor, scale: float, max_len: int) -> torch.Tensor:
        block_size = k_cache.shape[1]
        num_blocks = (max_len + block_size - 1) // block_size
        table = block_tables[:, :num_blocks].long()
        k = self._gather("k", k_cache, table).flatten(1, 2)[:, :max_len].transpose(1, 2)  # [S, Hkv, L, D]
        v = self._gather("v", v_cache, table).flatten(1, 2)[:, :max_len].transpose(1, 2)
        mask = torch.arange(max_len, device=q.device)[None, :] < seq_lens[:, None].to(q.device)
        # each KV head's group of query heads as one head's query rows: K and V are read once, not repeated per head
        rows, heads, dim = q.shape
        grouped = q.reshape(rows, k.shape[1], heads // k.shape[1], dim)
        return _masked_attention(grouped, k, v, mask[:, None, None, :], scale).reshape(rows, heads, dim)


def _masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float
                      ) -> torch.Tensor:
    """SDPA of `q` over `k`, `v` (GQA) with a boolean `mask`, in `q`'s dtype. On a CPU a 16-bit call computes in
    float32 and casts back: torch's CPU kernel for a masked 16-bit call is many times slower than for float32
    inputs, and float32 accumulation is what a 16-bit model's attention wants anyway."""
    if q.device.type == "cpu" and q.dtype != torch.float32:
        return F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask, scale=scale,
                                              enable_gqa=True).to(q.dtype)
    return F.scaled_dot_product_attention(q, k.to(q.dtype), v.to(q.dtype), attn_mask=mask, scale=scale, enable_gqa=True)


def gather_kv(cache: torch.Tensor, block_row: torch.Tensor, length: int) -> torch.Tensor:
    """The first `length` tokens of one sequence's K or V, `[length, Hkv, D]`, read through its block table row."""
    block_size = cache.shape[1]
    num_blocks = (length + block_size - 1) // block_size
    return cache[block_row[:num_blocks].long()].flatten(0, 1)[:length]


def _prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_row: torch.Tensor,
             kv_len: int, scale: float) -> torch.Tensor:
    n = q.shape[0]
    # 4-D inputs: given 3-D ones, SDPA on CPU takes its math path (bmm, softmax and mask ops) instead of flash.
    q4 = q.transpose(0, 1)[None]
    k = gather_kv(k_cache, block_row, kv_len).transpose(0, 1)[None].to(q.dtype)
    v = gather_kv(v_cache, block_row, kv_len).transpose(0, 1)[None].to(q.dtype)
    if n == kv_len:  # the whole context is new: plain causal attention, no mask tensor
        o = F.scaled_dot_product_attention(q4, k, v, is_causal=True, scale=scale, enable_gqa=True)
    else:
        # Query i sits at context position kv_len - n + i and sees every key up to it.
        mask = torch.ones(n, kv_len, dtype=torch.bool, device=q.device).tril(kv_len - n)
        o = _masked_attention(q4, k, v, mask[None, None], scale)
    return o[0].transpose(0, 1)
