"""Attention backends over the paged KV cache.

Every backend offers the same two operations, so the engine never knows which one runs:

- ``write_kv(key, value, k_cache, v_cache, slot_mapping)``: store each new token's K/V
  (``[T, Hkv, D]``) at its slot (``slot = block_id * block_size + offset``) of the caches
  (``[num_blocks, block_size, Hkv, D]``).
- ``paged_attention(query, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, scale,
  max_seqlen_q, max_seq_len) -> [T, Hq, D]``: attention of a ragged batch of queries
  (``[T, Hq, D]``, sequence ``i`` owning rows ``cu_seqlens_q[i]:cu_seqlens_q[i+1]``) over
  each sequence's whole context read through its block table row. ``seq_lens[i]`` counts
  the context including the new tokens; the queries are its last tokens (causal, aligned
  to the end). ``max_seqlen_q``/``max_seq_len`` are host-side ints the caller already has: the largest query
  length and context, exact or above (never below: the Triton backend's split decode sizes its partition
  states by ``max_seq_len``).
- ``decode_attention(query, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, scale) -> [B, Hq, D]``:
  ``paged_attention`` of a step of one query per row that reads nothing back to the host (a CUDA graph can
  capture it); a row with ``seq_lens`` 0 is padding and gets zeros.

and a decoder layer's elementwise parts (`tokenmill.kernels.layers`, the torch reference): ``add_rms_norm``,
``rotary`` and ``silu_and_mul``, one kernel each in the Triton backend.
"""

from __future__ import annotations

import os
from typing import Protocol

import torch

BACKEND_ENV = "TOKENMILL_ATTENTION_BACKEND"
BACKENDS = ("torch", "triton")


class AttentionBackend(Protocol):
    name: str

    def write_kv(
        self, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None: ...

    def paged_attention(
        self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
        cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor, scale: float, max_seqlen_q: int, max_seq_len: int,
    ) -> torch.Tensor: ...

    def decode_attention(
        self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
        cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor, scale: float,
    ) -> torch.Tensor: ...

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
                     ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def rotary(self, qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor: ...

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor: ...


def resolve_backend_name(name: str | None, device: torch.device) -> str:
    """Explicit name, else $TOKENMILL_ATTENTION_BACKEND, else triton on CUDA and torch elsewhere."""
    chosen = name or os.environ.get(BACKEND_ENV) or ("triton" if device.type == "cuda" else "torch")
    if chosen not in BACKENDS:
        raise ValueError(f"attention_backend: unknown backend {chosen!r}; choose one of {', '.join(BACKENDS)}")
    return chosen


def get_backend(name: str | None, device: torch.device) -> AttentionBackend:
    chosen = resolve_backend_name(name, device)
    if chosen == "triton":
        from tokenmill.kernels.triton_attention import TritonBackend

        return TritonBackend()
    from tokenmill.kernels.torch_attention import TorchBackend

    return TorchBackend()
