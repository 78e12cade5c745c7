"""tokenmill's attention as a transformers attention function, so Hugging Face model code runs unchanged.

The runner passes an `AttentionMetadata` as the `tokenmill_meta` keyword of the model's forward; transformers
hands it through every decoder layer to this function, which writes the layer's new K/V into the paged
cache and attends over it with the chosen backend. Registering a name that has no mask function also makes
transformers skip building attention masks: the metadata replaces them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import AttentionInterface

from tokenmill.kernels import AttentionBackend

NAME = "tokenmill"


@dataclass
class AttentionMetadata:
    """One step's ragged batch layout, shared by every layer."""

    cu_seqlens_q: torch.Tensor  # int32 [S+1]: sequence i owns query rows cu[i]:cu[i+1]
    seq_lens: torch.Tensor  # int32 [S]: context length including this step's tokens
    block_tables: torch.Tensor  # int32 [S, max_blocks], padded with 0
    slot_mapping: torch.Tensor  # int64 [T]: cache slot of each new token
    max_seqlen_q: int
    max_seq_len: int
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]  # per layer: K and V [num_blocks, block_size, Hkv, D]
    backend: AttentionBackend
    # A fixed-shape decode step (`padded_decode.py`): one query per row, rows of context 0 are padding, and
    # attention goes through `backend.decode_attention`, which reads nothing back to the host.
    padded_decode: bool = False


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    tokenmill_meta: AttentionMetadata | None = None,
    **kwargs: object,
) -> tuple[torch.Tensor, None]:
    """query/key/value arrive as [1, heads, T, D] for the flat batch; the output goes back as [1, T, Hq, D]."""
    meta = tokenmill_meta
    if meta is None:
        raise RuntimeError("the tokenmill attention needs tokenmill_meta: run the model through ModelRunner")
    k_cache, v_cache = meta.kv_caches[module.layer_idx]
    q = query[0].transpose(0, 1)  # a strided view: both backends take strides, a copy per layer buys nothing
    meta.backend.write_kv(key[0].transpose(0, 1), value[0].transpose(0, 1), k_cache, v_cache, meta.slot_mapping)
    out = meta.backend.paged_attention(
        q, k_cache, v_cache, meta.block_tables, meta.cu_seqlens_q, meta.seq_lens,
        scaling if scaling is not None else q.shape[-1] ** -0.5, meta.max_seqlen_q, meta.max_seq_len,
    )
    return out.unsqueeze(0), None


def register() -> None:
    AttentionInterface.register(NAME, paged_attention_forward)
