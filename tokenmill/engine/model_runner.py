"""Runs one scheduled step: flattens its tokens into one ragged batch, runs the model, samples.

No padding anywhere on the token path: the step's tokens are concatenated into a `[1, T]` batch, and the
attention metadata (query boundaries, context lengths, block tables, cache slots) keeps sequences apart.
Logits are computed only for the rows that sample (and score); the final hidden states of an embedding's pooled rows
come out beside them (`pooling.py`). Host-side inputs come from persistent buffers
(`step_inputs.py`) in one host-to-device copy; the sampler's token read-back is the step's only sync. Decode-only
steps may instead run padded to fixed shapes, as CUDA graphs (`padded_decode.py`).
"""

from __future__ import annotations

import logging

import torch

from tokenmill.engine import cpu_threads
from tokenmill.engine.attention import AttentionMetadata
from tokenmill.engine.config import EngineConfig
from tokenmill.engine.cpu_memory import keep_freed_memory
from tokenmill.engine.loader import LoadedModel
from tokenmill.engine.models import is_native
from tokenmill.engine.padded_decode import PaddedDecode
from tokenmill.engine.pooling import pool_rows
from tokenmill.engine.sampler import Sampler, SampleResult, SamplingRow
from tokenmill.engine.scoring import score_logits, score_rows
from tokenmill.engine.step_inputs import StepInputBuilder, StepInputs
from tokenmill.engine.transfer import Feed, PendingRead, to_device
from tokenmill.kernels import get_backend
from tokenmill.sampling_params import SamplingParams
from tokenmill.scheduler.scheduler import ScheduledBatch
from tokenmill.scheduler.sequence import Sequence

log = logging.getLogger(__name__)


class ModelRunner:
    """The KV cache holds `num_blocks` blocks for the scheduler and one more, `scratch_block`, that no sequence owns:
    padded decode rows write their K/V there."""

    def __init__(self, loaded: LoadedModel, config: EngineConfig, max_model_len: int | None = None) -> None:
        self.model = loaded.model
        self.native = is_native(self.model)
        self.device, self.dtype = loaded.device, loaded.dtype
        self.config = config
        hf = loaded.hf_config
        self.num_layers = hf.num_hidden_layers
        self.num_kv_heads = getattr(hf, "num_key_value_heads", None) or hf.num_attention_heads
        self.head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
        self.vocab_size = hf.vocab_size
        self.backend = get_backend(config.attention_backend, self.device)
        if self.device.type == "cpu":
            keep_freed_memory()  # a step's activations and logits reused, not mapped and faulted in again
            log.info("CPU: torch threads %d; idle OpenMP threads spin: %s", torch.get_num_threads(), cpu_threads.describe())
        self.sampler = Sampler()
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.decode: PaddedDecode | None = None  # set after the KV cache: the memory profile's step runs eagerly
        self.inputs = self._input_builder()
        self.num_blocks = self._num_kv_blocks()
        self.kv_caches = self._allocate_kv_caches(self.num_blocks)
        self.scratch_block = self.num_blocks
        if self.native and self.device.type == "cuda" and not config.enforce_eager:
            self.decode = PaddedDecode(self, max_model_len or config.max_model_len or 2048, capture=True)
        log.info("KV cache: %d blocks of %d tokens (%.1f MiB), attention backend %s", self.num_blocks,
                 config.block_size, self.num_blocks * self.block_bytes / 2**20, self.backend.name)

    @property
    def block_bytes(self) -> int:
        """Bytes one block takes across all layers, K and V."""
        element = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.config.block_size * self.num_kv_heads * self.head_dim * element

    def _allocate_kv_caches(self, num_blocks: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """`num_blocks` blocks and the scratch block after them."""
        shape = (num_blocks + 1, self.config.block_size, self.num_kv_heads, self.head_dim)
        return [(torch.zeros(shape, dtype=self.dtype, device=self.device),
                 torch.zeros(shape, dtype=self.dtype, device=self.device)) for _ in range(self.num_layers)]

    def _input_builder(self) -> StepInputBuilder:
        config = self.config
        return StepInputBuilder(self.device, config.block_size, config.max_num_seqs, config.max_num_batched_tokens)

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
        blocks = budget // self.block_bytes - 1  # the scratch block comes out of the budget too
        if blocks < 1:
            raise ValueError(f"KV cache: {budget} bytes hold fewer than 2 blocks of {self.block_bytes} bytes")
        return int(blocks)

    def _profile_free_cuda_memory(self) -> int:
        """Bytes left for the KV cache: `gpu_memory_utilization` of the device's total memory, less what the
        device is using after a worst-case step (weights, the step's peak, held by torch's caching
        allocator, and whatever lives outside torch: CUDA context, library workspaces, other processes)."""
        torch.cuda.empty_cache()
        profile_cache_bytes = self.profile_step()[1]
        torch.cuda.synchronize(self.device)
        free, total = torch.cuda.mem_get_info(self.device)  # before empty_cache: the step's peak stays reserved
        torch.cuda.empty_cache()
        # The throwaway cache is still counted as used (reserved) but is not kept: give it back.
        return kv_cache_budget(total, free + profile_cache_bytes, self.config.gpu_memory_utilization)

    def profile_step(self) -> tuple[SampleResult, int]:
        """Run the largest step the scheduler can plan, sampler included, on a throwaway KV cache.

        `max_num_batched_tokens` tokens (one long prefill chunk and `max_num_seqs - 1` one-token rows) of
        which `max_num_seqs` sample with every filter on (temperature, top-k/p, min-p, repetition penalty,
        top-20 logprobs), the sampler's costliest path. It runs through `execute`, under inference mode,
        so its peak is a real step's peak. Returns the step's result and the throwaway cache's bytes.
        """
        config = self.config
        tokens, block_size = config.max_num_batched_tokens, config.block_size
        num_seqs = min(config.max_num_seqs, tokens)
        params = SamplingParams(max_tokens=1, temperature=1.0, top_k=50, top_p=0.9, min_p=0.01,
                                repetition_penalty=1.1, logprobs=20)
        long = Sequence("profile-0", [0] * (tokens - num_seqs + 1), params)
        long.block_table = list(range(-(-long.num_tokens // block_size)))
        seqs = [long] + [Sequence(f"profile-{i}", [0], params, block_table=[0]) for i in range(1, num_seqs)]
        batch = ScheduledBatch(tokens)
        for seq in seqs:
            batch.add(seq, seq.num_tokens)
        rows = [SamplingRow(params, i, 0, seq.token_ids, []) for i, seq in enumerate(seqs)]
        saved, self.kv_caches = self.kv_caches, self._allocate_kv_caches(len(long.block_table))
        try:
            return self.execute(batch, rows), len(long.block_table) * self.block_bytes
        finally:
            self.kv_caches = saved
            self.inputs = self._input_builder()  # forget the profile's block-table rows

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch, rows: list[SamplingRow], feed: Feed | None = None) -> SampleResult:
        """Run the step's forward pass and sample one token for each sequence that completes its tokens. The
        step's scoring rows (`scoring.score_rows`) get logits too, after the sampled ones: their scores are read
        back with the tokens and written into their sequences. The pooled rows' hidden states (`pooling.pool_rows`)
        are added into their sequences once the sampler has passed (a step rerun after its failure adds them once).
        `feed`: input ids of the step still on the device (`launch`)."""
        if not batch.scoring and not batch.pooling:
            return self.sampler(self._logits(batch, feed), rows)
        scoring, pooling = score_rows(batch), pool_rows(batch)
        inputs = self.inputs.build(batch, scoring.rows, pooling.rows)
        if feed is not None:
            feed.apply(inputs.input_ids[0])
        logits, hidden = self.forward_pooled(inputs) if pooling.rows else (self.forward(inputs), None)
        scores = score_logits(logits[len(rows):], scoring) if scoring.rows else None
        result = self.sampler(logits[: len(rows)], rows, scores)
        if result.scores is not None:
            scoring.record(result.scores)
        if hidden is not None:
            pooling.record(hidden)
        return result

    @torch.inference_mode()
    def launch(self, batch: ScheduledBatch, feed: Feed | None = None) -> PendingRead:
        """`execute` of a step that neither scores nor pools and whose sampled rows all take their argmax, without
        waiting for the device: the tokens come when the caller waits for them. `feed`: input ids of the step still
        on the device, from the step before (not yet read back)."""
        return self.sampler.launch(self._logits(batch, feed))

    def _logits(self, batch: ScheduledBatch, feed: Feed | None = None) -> torch.Tensor:
        """The sampled rows' logits of a step that neither scores nor pools: on the padded decode path where it fits."""
        if self.decode is not None and self.decode.fits(batch):
            return self.decode.forward(batch, feed)
        inputs = self.inputs.build(batch)
        if feed is not None:
            feed.apply(inputs.input_ids[0])
        return self.forward(inputs)

    @torch.inference_mode()
    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy the K/V of each (source, destination) block pair, every layer, without waiting for the device."""
        if not pairs:
            return
        source = to_device([pair[0] for pair in pairs], torch.int64, self.device)
        destination = to_device([pair[1] for pair in pairs], torch.int64, self.device)
        for k_cache, v_cache in self.kv_caches:
            k_cache.index_copy_(0, destination, k_cache.index_select(0, source))
            v_cache.index_copy_(0, destination, v_cache.index_select(0, source))

    def release(self, seq: Sequence) -> None:
        """Forget a sequence that will not run again (its block-table row)."""
        self.inputs.mirror.release(seq.seq_id)

    def forward(self, inputs: StepInputs) -> torch.Tensor:
        """Logits `[len(sample_rows), vocab]` for one step's flat batch."""
        meta = self._meta(inputs)
        if self.native:
            return self.model(inputs.input_ids[0], inputs.positions[0], meta, inputs.sample_rows)
        output = self.model(input_ids=inputs.input_ids, position_ids=inputs.positions, use_cache=False,
                            logits_to_keep=inputs.sample_rows, tokenmill_meta=meta)
        return output.logits[0]

    def forward_pooled(self, inputs: StepInputs) -> tuple[torch.Tensor, torch.Tensor]:
        """`forward`'s logits and the final hidden states `[len(pool_rows), hidden]` of `inputs.pool_rows` (after the
        model's final norm, before its head): transformers' base model's `last_hidden_state`, caught on its way."""
        meta = self._meta(inputs)
        if self.native:
            return self.model(inputs.input_ids[0], inputs.positions[0], meta, inputs.sample_rows, inputs.pool_rows)
        caught: list[torch.Tensor] = []
        hook = self.model.base_model.register_forward_hook(lambda module, args, output: caught.append(output[0]))
        try:
            output = self.model(input_ids=inputs.input_ids, position_ids=inputs.positions, use_cache=False,
                                logits_to_keep=inputs.sample_rows, tokenmill_meta=meta)
        finally:
            hook.remove()
        return output.logits[0], caught[0][0, inputs.pool_rows]

    def _meta(self, inputs: StepInputs) -> AttentionMetadata:
        return AttentionMetadata(
            cu_seqlens_q=inputs.cu_seqlens_q,
            seq_lens=inputs.seq_lens,
            block_tables=inputs.block_tables,
            slot_mapping=inputs.slot_mapping,
            max_seqlen_q=inputs.max_seqlen_q,
            max_seq_len=inputs.max_seq_len,
            kv_caches=self.kv_caches,
            backend=self.backend,
        )


def kv_cache_budget(total: int, free: int, utilization: float) -> int:
    """Bytes the KV cache may take: `utilization` of `total` device memory, less what is in use (`total -
    free`, measured after the worst-case step with nothing released). Raises when nothing is left."""
    used = total - free
    budget = int(total * utilization) - used
    if budget <= 0:
        gib = 2**30
        raise ValueError(
            f"gpu_memory_utilization: {utilization} of {total / gib:.2f} GiB leaves nothing for the KV cache: "
            f"weights, a worst-case step's activations and memory outside torch already use {used / gib:.2f} "
            f"GiB. Raise gpu_memory_utilization, or lower max_num_batched_tokens or max_num_seqs."
        )
    return budget
