"""Decode steps at a fixed shape, so that each shape can be captured once as a CUDA graph and replayed.

A decode-only step of `n` sequences runs padded to the smallest bucket of at least `n` rows (`decode_buckets`). Its
inputs live in static device buffers sized for the largest bucket and written by one host-to-device copy: token ids,
positions, cache slots, context lengths and a block-table row of fixed width per sequence. The views a bucket's
forward reads are the same memory at every step, and no shape depends on anything but the bucket.

Padded rows are inert: their K/V go to the runner's scratch block (which no sequence owns, so nothing reads it) and
their context length is 0, so their attention output is 0 and no real row sees them. The forward reads nothing back
to the host (attention through the backend's `decode_attention`). Only the native models run here: transformers'
modules may sync or reshape by host values. On CUDA, unless `enforce_eager`, `capture` records each bucket's forward
as a CUDA graph and `forward` replays it; elsewhere the same padded forward runs eagerly (what the tests check).
"""

from __future__ import annotations

import logging
import time
import weakref
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from tokenmill.engine.attention import AttentionMetadata
from tokenmill.engine.config import EngineConfig
from tokenmill.engine.step_inputs import StepInputBuilder
from tokenmill.engine.transfer import Feed
from tokenmill.kernels import AttentionBackend
from tokenmill.scheduler.scheduler import ScheduledBatch

log = logging.getLogger(__name__)


def decode_buckets(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then steps of 8 up to 64 and of 16 beyond, ending with `max_num_seqs` itself."""
    steps = [1, 2, 4, *range(8, 64, 8), *range(64, max_num_seqs, 16)]
    return [b for b in steps if b < max_num_seqs] + [max_num_seqs]


class Runner(Protocol):
    """What this path reads of its `ModelRunner`, at each step (the runner may swap its caches)."""

    model: torch.nn.Module
    device: torch.device
    config: EngineConfig
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]
    backend: AttentionBackend
    inputs: StepInputBuilder  # its block-table mirror: the rows of the step's sequences
    scratch_block: int


@dataclass
class BucketViews:
    """A bucket's input tensors: views of the static device buffer, the same at every step of that bucket."""

    input_ids: torch.Tensor  # int64 [B]
    positions: torch.Tensor  # int64 [B]
    slot_mapping: torch.Tensor  # int64 [B]
    seq_lens: torch.Tensor  # int32 [B]
    block_tables: torch.Tensor  # int32 [B, W], stored column by column (strides 1, max)
    cu_seqlens_q: torch.Tensor  # int32 [B+1]: 0..B, one query per row
    sample_rows: torch.Tensor  # int64 [B]: 0..B-1


class PaddedDecode:
    """The runner's decode path at fixed shapes (see the module docstring).

    The buffer's layout does not depend on the bucket: ids, positions and slots (int64, `max` rows each), then the
    context lengths (int32, `max` rows) and the block tables (int32, column by column: `width` columns of `max` rows,
    so a bucket's tables are a strided view). A step writes its rows and copies the prefix that covers the columns its
    longest context uses, not the tables' whole width. Columns of a table past a row's context and the tables of
    padded rows keep whatever block ids earlier steps left there: valid ids, and masked by the context length.
    """

    def __init__(self, runner: Runner, max_model_len: int, capture: bool) -> None:
        # a proxy: the runner holds this path, and a cycle would keep its KV cache alive until a garbage collection
        self.runner = weakref.proxy(runner)
        self.device, self.block_size = runner.device, runner.config.block_size
        self.buckets = decode_buckets(runner.config.max_num_seqs)
        self.max = self.buckets[-1]
        self.width = -(-max_model_len // self.block_size)
        self.scratch_slot = runner.scratch_block * self.block_size
        self._head = 3 * self.max  # int64 elements before the int32 region
        tables_at = 2 * self._head + self.max  # int32 offset of the block tables
        size = self._head + -(-(self.max + self.max * self.width) // 2)
        pin = self.device.type == "cuda"
        self.staging = torch.zeros(size, dtype=torch.int64, pin_memory=pin)
        self.host = self.staging.numpy()
        self.host32 = self.host.view(np.int32)
        self.host_columns = self.host32[tables_at : tables_at + self.max * self.width].reshape(self.width, self.max)
        self.buffer = torch.zeros(size, dtype=torch.int64, device=self.device)
        self.views = {bucket: self._views(bucket, tables_at) for bucket in self.buckets}
        self._copied: torch.cuda.Event | None = None
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: torch.Tensor | None = None  # [max, vocab]: every graph's output, its bucket's rows
        self._pad(0, self.max)
        self.buffer.copy_(self.staging)
        if capture:
            self.capture()

    def _views(self, bucket: int, tables_at: int) -> BucketViews:
        wide, narrow = self.buffer, self.buffer[self._head:].view(torch.int32)
        arange = torch.arange(bucket + 1, device=self.device)
        columns = self.buffer.view(torch.int32)[tables_at : tables_at + self.width * self.max]
        return BucketViews(
            input_ids=wide[:bucket], positions=wide[self.max : self.max + bucket],
            slot_mapping=wide[2 * self.max : 2 * self.max + bucket], seq_lens=narrow[:bucket],
            block_tables=columns.view(self.width, self.max)[:, :bucket].t(), cu_seqlens_q=arange.to(torch.int32),
            sample_rows=arange[:bucket],
        )

    def fits(self, batch: ScheduledBatch) -> bool:
        """Whether `batch` is a decode step this path runs: every sequence decodes (and samples), none scores or
        pools, and there are at most as many as the largest bucket."""
        seqs = batch.seqs
        return 0 < len(seqs) == batch.num_decodes <= self.max and not batch.scoring and not batch.pooling

    def bucket(self, num_seqs: int) -> int:
        return next(b for b in self.buckets if b >= num_seqs)

    def forward(self, batch: ScheduledBatch, feed: Feed | None = None) -> torch.Tensor:
        """Logits `[len(batch.seqs), vocab]` of a step that `fits`: its rows of the padded bucket's forward. With
        graphs, a view of the static `logits` buffer: valid until the next `forward`. `feed`: token ids still on the
        device, written over their rows' placeholders before the forward."""
        num_seqs = len(batch.seqs)
        bucket = self.bucket(num_seqs)
        self._write(batch, bucket)
        if feed is not None:
            feed.apply(self.views[bucket].input_ids)
        graph = self.graphs.get(bucket)
        if graph is None:
            return self._run(bucket)[:num_seqs]
        graph.replay()
        assert self.logits is not None
        return self.logits[:num_seqs]

    @torch.inference_mode()
    def capture(self) -> None:
        """Record each bucket's forward as a CUDA graph, the largest first so the others reuse its memory pool.
        The static buffer holds padded rows only while capturing: every row reads nothing and writes the scratch block.
        Each graph copies its logits into the rows of one static `logits` buffer, so that the pool keeps no bucket's
        output alive: the graphs' memory is one bucket's activations and logits, not the sum over buckets."""
        pool, began = None, time.perf_counter()
        for bucket in reversed(self.buckets):
            warm = self._run(bucket)  # compiles the kernels and sizes the backend's workspaces outside the capture
            if self.logits is None:
                self.logits = torch.empty_like(warm)  # the largest bucket's shape: `max` rows
            del warm
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.logits[:bucket].copy_(self._run(bucket))
            pool = graph.pool()
            self.graphs[bucket] = graph
        torch.cuda.synchronize(self.device)
        log.info("captured %d decode CUDA graphs (batch sizes %s) in %.1f s", len(self.graphs), self.buckets,
                 time.perf_counter() - began)

    def _run(self, bucket: int) -> torch.Tensor:
        views, runner = self.views[bucket], self.runner
        meta = AttentionMetadata(
            cu_seqlens_q=views.cu_seqlens_q, seq_lens=views.seq_lens, block_tables=views.block_tables,
            slot_mapping=views.slot_mapping, max_seqlen_q=1, max_seq_len=self.width * self.block_size,
            kv_caches=runner.kv_caches, backend=runner.backend, padded_decode=True,
        )
        return runner.model(views.input_ids, views.positions, meta, views.sample_rows)

    def _write(self, batch: ScheduledBatch, bucket: int) -> None:
        """Write the step's rows and its padded rows into the staging buffer, then copy what the bucket reads."""
        seqs, block_size, top = batch.seqs, self.block_size, self.max
        num_seqs = len(seqs)
        if self._copied is not None:  # the last copy out of the staging buffer
            self._copied.synchronize()
        rows = self.runner.inputs.mirror.rows(seqs)
        host, host32 = self.host, self.host32
        positions = np.fromiter((seq.num_computed_tokens for seq in seqs), np.int64, num_seqs)
        host[:num_seqs] = [seq.token_ids[-1] for seq in seqs]
        host[top : top + num_seqs] = positions
        seq_lens = positions + 1
        width = min(-(-int(seq_lens.max()) // block_size), self.width)
        mirrored = self.runner.inputs.mirror.table
        tables = mirrored[rows, : min(width, mirrored.shape[1])]
        self.host_columns[: tables.shape[1], :num_seqs] = tables.T
        host[2 * top : 2 * top + num_seqs] = tables[np.arange(num_seqs), positions // block_size] * block_size \
            + positions % block_size
        host32[2 * self._head : 2 * self._head + num_seqs] = seq_lens
        self._pad(num_seqs, bucket)
        end = self._head + -(-(top + width * top) // 2)  # the context lengths, then the columns in use
        self.buffer[:end].copy_(self.staging[:end], non_blocking=True)
        if self.device.type == "cuda":
            self._copied = torch.cuda.Event()
            self._copied.record()

    def _pad(self, start: int, stop: int) -> None:
        """Rows `start:stop` padded: token 0 at position 0, writing the scratch block, with no context."""
        top = self.max
        self.host[start:stop] = 0
        self.host[top + start : top + stop] = 0
        self.host[2 * top + start : 2 * top + stop] = self.scratch_slot
        self.host32[2 * self._head + start : 2 * self._head + stop] = 0

