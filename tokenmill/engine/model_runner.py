"""Runs one scheduled step: flattens its tokens into one ragged batch, runs the model, samples.

No padding anywhere on the token path: the step's tokens are concatenated into a `[1, T]` batch, and the
attention metadata (query boundaries, context lengths, block tables, cache slots) keeps sequences apart.
Logits are computed only for the rows that sample.
"""

from __future__ import annotations

import logging

import torch

from tokenmill.engine.attention import AttentionMetadata
from tokenmill.engine.config import EngineConfig
from tokenmill.engine.loader import LoadedModel
from tokenmill.engine.sampler import Sampler, SampleResult, SamplingRow
from tokenmill.kernels import get_backend
from tokenmill.scheduler.scheduler import ScheduledBatch

log = logging.getLogger(__name__)


class ModelRunner:
    def __init__(self, loaded: LoadedModel, config: EngineConfig) -> None:
        self.model = loaded.model
        self.device, self.dtype = loaded.device, loaded.dtype
        self.config = config
        hf = loaded.hf_config
        self.num_layers = hf.num_hidden_layers
        self.num_kv_heads = getattr(hf, "num_key_value_heads", None) or hf.num_attention_heads
        self.head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
        self.vocab_size = hf.vocab_size
        self.backend = get_backend(config.attention_backend, self.device)
        self.sampler = Sampler()
        self.num_blocks = self._num_kv_blocks()
        shape = (self.num_blocks, config.block_size, self.num_kv_heads, self.head_dim)
        self.kv_caches = [
            (torch.zeros(shape, dtype=self.dtype, device=self.device),
             torch.zeros(shape, dtype=self.dtype, device=self.device))
            for _ in range(self.num_layers)
        ]
        log.info("KV cache: %d blocks of %d tokens (%.1f MiB), attention backend %s", self.num_blocks,
                 config.block_size, self.num_blocks * self.block_bytes / 2**20, self.backend.name)

    @property
    def block_bytes(self) -> int:
        """Bytes one block takes across all layers, K and V."""
        element = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.config.block_size * self.num_kv_heads * self.head_dim * element

    def _num_kv_blocks(self) -> int:
        config = self.config
        if config.num_kv_blocks is not None:
            return config.num_kv_blocks
        if config.kv_cache_memory is not None:
            budget = config.kv_cache_memory
        elif self.device.type == "cuda":
            budget = self._profile_free_cuda_memory()
        else:
            max_len = config.max_model_len or 2048
            budget = min(config.max_num_seqs * max_len // config.block_size * self.block_bytes,
                         config.cpu_kv_cache_cap)
        blocks = budget // self.block_bytes
        if blocks < 1:
            raise ValueError(f"KV cache: {budget} bytes hold no block of {self.block_bytes} bytes")
        return int(blocks)

    def _profile_free_cuda_memory(self) -> int:
        """Device memory left for the KV cache after weights and a full-budget forward pass's activations."""
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        tokens = self.config.max_num_batched_tokens
        block_size = self.config.block_size
        blocks = -(-tokens // block_size)
        shape = (blocks, block_size, self.num_kv_heads, self.head_dim)
        self.kv_caches = [(torch.zeros(shape, dtype=self.dtype, device=self.device),
                           torch.zeros(shape, dtype=self.dtype, device=self.device)) for _ in range(self.num_layers)]
        self.forward([0] * tokens, list(range(tokens)), [0, tokens], [tokens], [list(range(blocks))], [tokens - 1])
        peak = torch.cuda.max_memory_allocated(self.device)
        del self.kv_caches
        torch.cuda.empty_cache()
        total = torch.cuda.get_device_properties(self.device).total_memory
        return int(total * self.config.gpu_memory_utilization) - peak

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch, rows: list[SamplingRow]) -> SampleResult:
        """Run the step's forward pass and sample one token for each sequence that completes its tokens."""
        input_ids: list[int] = []
        positions: list[int] = []
        cu_seqlens_q, seq_lens, sample_rows = [0], [], []
        for index, (seq, count) in enumerate(zip(batch.seqs, batch.num_new_tokens)):
            start = seq.num_computed_tokens
            input_ids += seq.token_ids[start : start + count]
            positions += range(start, start + count)
            cu_seqlens_q.append(cu_seqlens_q[-1] + count)
            seq_lens.append(start + count)
            if batch.samples(index):
                sample_rows.append(cu_seqlens_q[-1] - 1)
        logits = self.forward(input_ids, positions, cu_seqlens_q, seq_lens,
                              [seq.block_table for seq in batch.seqs], sample_rows)
        return self.sampler(logits, rows)

    def forward(self, input_ids: list[int], positions: list[int], cu_seqlens_q: list[int], seq_lens: list[int],
                block_tables: list[list[int]], sample_rows: list[int]) -> torch.Tensor:
        """Logits `[len(sample_rows), vocab]` for the flat batch described by host-side lists."""
        device, block_size = self.device, self.config.block_size
        width = max(len(row) for row in block_tables)
        table = torch.tensor([row + [0] * (width - len(row)) for row in block_tables], dtype=torch.int32)
        q_lens = torch.tensor(cu_seqlens_q[1:]) - torch.tensor(cu_seqlens_q[:-1])
        seq_of_token = torch.repeat_interleave(torch.arange(len(seq_lens)), q_lens)
        position_tensor = torch.tensor(positions, dtype=torch.int64)
        slots = table[seq_of_token, position_tensor // block_size].long() * block_size + position_tensor % block_size
        meta = AttentionMetadata(
            cu_seqlens_q=torch.tensor(cu_seqlens_q, dtype=torch.int32).to(device, non_blocking=True),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32).to(device, non_blocking=True),
            block_tables=table.to(device, non_blocking=True),
            slot_mapping=slots.to(device, non_blocking=True),
            max_seqlen_q=int(q_lens.max()),
            max_seq_len=max(seq_lens),
            kv_caches=self.kv_caches,
            backend=self.backend,
        )
        output = self.model(
            input_ids=torch.tensor([input_ids], device=device),
            position_ids=position_tensor[None].to(device, non_blocking=True),
            use_cache=False,
            logits_to_keep=torch.tensor(sample_rows, dtype=torch.long, device=device),
            tokenmill_meta=meta,
        )
        return output.logits[0]
