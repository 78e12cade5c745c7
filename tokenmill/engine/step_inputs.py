"""One step's model inputs, built on the host in persistent buffers and sent to the device in one copy.

The host work per step follows what changed, not batch x context: each live sequence's block table is
mirrored in a row of a persistent array and only appended to when the sequence gains a block; ids,
positions, slots, query boundaries, context lengths, sampling rows and the step's block-table rows are
computed with numpy into one persistent int64 staging buffer (pinned on CUDA; the int32 parts packed two
to an element) and copied to the device with a single non-blocking transfer: the step's tensors are views
of what arrives, with no conversion on the device.

Reusing the staging buffer is safe: a step normally ends with the host reading the sampled tokens back,
which waits for the stream that carried its copy; a step that read nothing back (the engine reruns requests
alone after a sampler failure) is covered by an event recorded after each copy and waited on (a no-op when
already passed) before the buffer is written again.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from tokenmill.scheduler.scheduler import ScheduledBatch
from tokenmill.scheduler.sequence import Sequence


@dataclass
class StepInputs:
    """Device tensors of one step (views of one transferred buffer) and the host ints the kernels need."""

    input_ids: torch.Tensor  # int64 [1, T]
    positions: torch.Tensor  # int64 [1, T]
    slot_mapping: torch.Tensor  # int64 [T]
    sample_rows: torch.Tensor  # int64 [R]: the query rows whose logits are computed (sampled, then scored)
    cu_seqlens_q: torch.Tensor  # int32 [S+1]
    seq_lens: torch.Tensor  # int32 [S]
    block_tables: torch.Tensor  # int32 [S, W]
    max_seqlen_q: int
    max_seq_len: int
    pool_rows: torch.Tensor | None = None  # int64 [P]: the query rows whose final hidden states are pooled


class BlockTableMirror:
    """Block tables of live sequences as rows of a host array, written only where a table grew.

    A row remembers the Python list it mirrors: `BlockManager.free` gives a sequence a new, empty list, so
    a preempted and readmitted sequence is recognised by identity and rewritten whole. A finished sequence's
    row is released by the engine (`release`); rows of sequences absent from a step are also reclaimed when
    the rows run out, a scan of every row that releasing spares the steps of a busy engine.
    """

    def __init__(self, rows: int, width: int) -> None:
        self.table = np.zeros((rows, width), dtype=np.int64)
        self.row_of: dict[int, int] = {}
        self.mirrored: list[list[int] | None] = [None] * rows
        self.lengths = [0] * rows
        self.free_rows = list(range(rows - 1, -1, -1))

    def rows(self, seqs: list[Sequence]) -> list[int]:
        """The row of each sequence of the step, brought up to date with its block table."""
        row_of, mirrored, lengths = self.row_of, self.mirrored, self.lengths
        out = []
        for seq in seqs:
            row = row_of.get(seq.seq_id)
            if row is None:
                row = self._claim(seq, seqs)
            table = seq.block_table
            if mirrored[row] is not table or lengths[row] != len(table):
                self._write(row, table)
            out.append(row)
        return out

    def release(self, seq_id: int) -> None:
        """The sequence will not run again: its row is free."""
        row = self.row_of.pop(seq_id, None)
        if row is not None:
            self.mirrored[row], self.lengths[row] = None, 0
            self.free_rows.append(row)

    def _claim(self, seq: Sequence, step_seqs: list[Sequence]) -> int:
        if not self.free_rows:
            live = {s.seq_id for s in step_seqs}
            for seq_id in [i for i in self.row_of if i not in live]:
                self.release(seq_id)
        if not self.free_rows:
            self._grow(rows=2 * self.table.shape[0])
        row = self.row_of[seq.seq_id] = self.free_rows.pop()
        self.table[row] = 0  # padding past a table's end reads as block 0, as a fresh table would
        return row

    def _write(self, row: int, table: list[int]) -> None:
        old = self.lengths[row]
        start = old if self.mirrored[row] is table and old <= len(table) else 0
        if len(table) > self.table.shape[1]:
            self._grow(width=max(len(table), 2 * self.table.shape[1]))
        self.table[row, start : len(table)] = table[start:]
        if old > len(table):  # a readmitted sequence's new table is shorter: no stale blocks past its end
            self.table[row, len(table) : old] = 0
        self.mirrored[row], self.lengths[row] = table, len(table)

    def _grow(self, rows: int | None = None, width: int | None = None) -> None:
        old = self.table
        self.table = np.zeros((rows or old.shape[0], width or old.shape[1]), dtype=np.int64)
        self.table[: old.shape[0], : old.shape[1]] = old
        extra = self.table.shape[0] - old.shape[0]
        self.mirrored += [None] * extra
        self.lengths += [0] * extra
        self.free_rows[:0] = range(self.table.shape[0] - 1, old.shape[0] - 1, -1)


class StepInputBuilder:
    """Builds `StepInputs` for a `ScheduledBatch` (see the module docstring)."""

    def __init__(self, device: torch.device, block_size: int, max_num_seqs: int, max_num_tokens: int) -> None:
        self.device, self.block_size = device, block_size
        self._copied: torch.cuda.Event | None = None  # recorded after each copy on CUDA
        self.pin = device.type == "cuda"
        self.mirror = BlockTableMirror(max_num_seqs + 1, 64)
        self._allocate_staging(4 * max_num_tokens + 3 * max_num_seqs + 1 + max_num_seqs * 64)

    def _allocate_staging(self, size: int) -> None:
        self.staging = torch.zeros(size, dtype=torch.int64, pin_memory=self.pin)
        self.host = self.staging.numpy()  # the same memory, written with numpy

    def build(self, batch: ScheduledBatch, score_rows: list[int] | None = None,
              pool_rows: list[int] | None = None) -> StepInputs:
        """The step's inputs; `score_rows` (query rows whose logits score a token) follow the sampled rows, and
        `pool_rows` (query rows whose hidden states are pooled) come as their own tensor."""
        seqs, block_size, counts = batch.seqs, self.block_size, batch.num_new_tokens
        num_seqs = len(seqs)
        starts = [seq.num_computed_tokens for seq in seqs]
        rows = np.array(self.mirror.rows(seqs), dtype=np.int64)
        start = np.array(starts, dtype=np.int64)
        num_tokens, head = sum(counts), batch.num_decodes
        ids = [seq.token_ids[-1] for seq in seqs[:head]]  # the leading decodes compute their last token
        if num_tokens == num_seqs:  # one token per sequence
            if head < num_seqs:
                ids += [seq.token_ids[s] for seq, s in zip(seqs[head:], starts[head:])]
            end, cu = start + 1, np.arange(num_seqs + 1, dtype=np.int64)
            positions, token_rows, max_seqlen_q = start, rows, 1
        else:
            count = np.array(counts, dtype=np.int64)
            cu = np.zeros(num_seqs + 1, dtype=np.int64)
            np.cumsum(count, out=cu[1:])
            end = start + count
            ids += [t for seq, s, e in zip(seqs[head:], starts[head:], end[head:].tolist()) for t in seq.token_ids[s:e]]
            positions = np.arange(num_tokens, dtype=np.int64) + np.repeat(start - cu[:-1], count)
            token_rows, max_seqlen_q = np.repeat(rows, count), max(counts)
        max_seq_len = int(end.max())
        width = -(-max_seq_len // block_size)
        table = self.mirror.table
        slots = table[token_rows, positions // block_size] * block_size + positions % block_size
        mask = batch.sample_mask
        sample_rows = cu[1:] - 1 if mask.count(True) == num_seqs else cu[1:][np.array(mask, dtype=bool)] - 1
        if score_rows:
            sample_rows = np.concatenate([sample_rows, np.array(score_rows, dtype=np.int64)])
        wide = (ids, positions, slots, sample_rows)
        narrow = (cu, end, table[rows, :width].reshape(-1))
        wide_sizes = [num_tokens, num_tokens, num_tokens, len(sample_rows)]
        if pool_rows:
            wide, wide_sizes = wide + (pool_rows,), wide_sizes + [len(pool_rows)]
        narrow_sizes = [num_seqs + 1, num_seqs, num_seqs * width]
        device = self._transfer(wide, wide_sizes, narrow, narrow_sizes)
        parts = device[0].split_with_sizes(wide_sizes)
        ids, positions, slots, sample_rows = parts[:4]
        cu, seq_lens, tables = device[1].split_with_sizes(narrow_sizes)
        return StepInputs(
            input_ids=ids[None], positions=positions[None], slot_mapping=slots, sample_rows=sample_rows,
            cu_seqlens_q=cu, seq_lens=seq_lens, block_tables=tables.view(num_seqs, width),
            max_seqlen_q=max_seqlen_q, max_seq_len=max_seq_len, pool_rows=parts[4] if pool_rows else None,
        )

    def _transfer(self, wide: tuple, wide_sizes: list[int], narrow: tuple,
                  narrow_sizes: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Copy the int64 parts (`wide`), then the int32 parts (`narrow`, two to an int64 element) to the
        device in one transfer; returns the two regions there, the second already seen as int32."""
        num_wide, num_narrow = sum(wide_sizes), sum(narrow_sizes)
        total = num_wide + (num_narrow + 1) // 2
        if total > self.staging.shape[0]:
            self._allocate_staging(2 * total)
        if self._copied is not None:  # the last copy out of the buffer (a step that read nothing back)
            self._copied.synchronize()
        host, offset = self.host, 0
        for part, size in zip(wide, wide_sizes):
            host[offset : offset + size] = part
            offset += size
        host32, offset = host.view(np.int32), 2 * num_wide
        for part, size in zip(narrow, narrow_sizes):
            host32[offset : offset + size] = part
            offset += size
        device = self.staging[:total].to(self.device, non_blocking=True)
        if self.device.type == "cuda":
            self._copied = torch.cuda.Event()
            self._copied.record()
        return device[:num_wide], device[num_wide:].view(torch.int32)[:num_narrow]
