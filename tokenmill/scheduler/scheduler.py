"""The step planner: which sequences run this step, and how many of their tokens.

Each step spends at most `max_num_batched_tokens` tokens: one per decoding sequence first, then prefill
chunks of running sequences still prefilling, then of waiting requests: in arrival order within a share (a tenant,
a run), the share with the fewest running sequences first. A prompt longer than what is left of the budget is split
and continues next step from its cached K/V.

A scoring sequence (`Sequence.num_scored_tokens`) is planned as a prompt that never decodes: it samples nothing,
and its chunk is cut so that the step's scored rows stay within `max_num_seqs` (the logits rows the engine's memory
profile allows for). Continuations of a computed sequence start from its K/V (`fork`): running at once, sharing its
full blocks, with a copy of a partial last block; a sequence with forks to come (`Sequence.num_forks`) is admitted
only with running slots kept for them. Without a free slot or block they queue as new sequences and find the full
blocks in the prefix cache. A pooling sequence (`Sequence.pooling`, an embedding) is planned as a
scoring one that reads no logits: its chunks are cut by the budget alone.
"""

from __future__ import annotations

import itertools
from collections import Counter, deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from functools import cached_property
from itertools import compress

from tokenmill.errors import InvalidRequestError
from tokenmill.scheduler.block_manager import BlockManager
from tokenmill.scheduler.sequence import Sequence, SequenceStatus


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int = 2048
    block_size: int = 16
    num_blocks: int = 1024
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "block_size", "num_blocks"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


@dataclass
class ScheduledBatch:
    """Sequences of one step, in batch order, with the number of new tokens each computes.

    The planner puts the decoding sequences first; `num_decodes` says how many leading sequences are known
    to compute one token each and sample (0 when unknown), so per-sequence work can skip them in bulk.
    `scoring` lists its scoring sequences (never among those decodes), in batch order; `score_rows` counts the
    positions whose logits they may still read this step. `pooling` lists its pooling sequences (apart from `scoring`).
    """

    budget: int
    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    num_preempted: int = 0
    num_decodes: int = 0
    scoring: list[Sequence] = field(default_factory=list)
    score_rows: int = 0
    pooling: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)

    def add(self, seq: Sequence, count: int) -> None:
        self.seqs.append(seq)
        self.num_new_tokens.append(count)
        self.budget -= count
        if seq.num_scored_tokens:
            (self.scoring if seq.pooling is None else self.pooling).append(seq)

    def remove(self, seq: Sequence) -> None:
        if seq in self.seqs:
            index = self.seqs.index(seq)
            self.budget += self.num_new_tokens.pop(index)
            del self.seqs[index]
            if seq.num_scored_tokens:
                (self.scoring if seq.pooling is None else self.pooling).remove(seq)
            self.num_decodes = 0
            self.__dict__.pop("sample_mask", None)  # cached for the old batch

    def samples(self, index: int) -> bool:
        """Whether sequence `index` reaches its last token this step, and so samples the next one (a scoring
        sequence never does)."""
        seq = self.seqs[index]
        return seq.num_computed_tokens + self.num_new_tokens[index] == seq.num_tokens and not seq.num_scored_tokens

    @cached_property
    def sample_mask(self) -> list[bool]:
        """`samples(i)` for every sequence, computed once for the engine and the runner alike. Read it
        between `Scheduler.schedule` and `Scheduler.update` (which advances the sequences)."""
        head = self.num_decodes
        return [True] * head + [seq.num_computed_tokens + count == len(seq.token_ids) and not seq.num_scored_tokens
                                for seq, count in zip(self.seqs[head:], self.num_new_tokens[head:])]


class WaitingQueue:
    """Sequences waiting to run. Those put back (preempted, or forks without a slot) go first, most recent first, as
    they already ran or hold a parent's K/V; then new ones by share (`Sequence.share`): a first-in, first-out queue per
    share, and the next is the head of the share with the fewest running sequences (`running`, kept by the scheduler),
    among equals the share waiting longest since it was last served or began to wait. So a share's backlog never holds
    another share's request behind it, and no share loses every tie; with one share, one queue in arrival order."""

    def __init__(self, running: Counter[str | None]) -> None:
        self._front: deque[Sequence] = deque()
        self._queues: dict[str | None, deque[Sequence]] = {}
        self._running = running
        self._since: dict[str | None, int] = {}  # share -> when it was last served or began to wait (a turn number)
        self._turns = itertools.count()
        self._len = 0

    def __len__(self) -> int:
        return self._len

    def __iter__(self) -> Iterator[Sequence]:
        return itertools.chain(self._front, (seq for queue in self._queues.values() for seq in queue))

    def first(self) -> Sequence:
        """The sequence to admit next (IndexError when none waits)."""
        if self._front:
            return self._front[0]
        if len(self._queues) == 1:
            return next(iter(self._queues.values()))[0]
        if not self._queues:
            raise IndexError("no sequence is waiting")
        running, since = self._running, self._since
        return min((queue[0] for queue in self._queues.values()),
                   key=lambda seq: (running.get(seq.share, 0), since[seq.share]))

    def admit(self, seq: Sequence) -> None:
        """`seq`, the one `first` gave, leaves the queue to run."""
        self.remove(seq)
        if seq.share in self._queues:
            self._since[seq.share] = next(self._turns)

    def append(self, seq: Sequence) -> None:
        queue = self._queues.get(seq.share)
        if queue is None:
            queue = self._queues[seq.share] = deque()
            self._since[seq.share] = next(self._turns)
        queue.append(seq)
        self._len += 1

    def put_back(self, seqs: Iterable[Sequence]) -> None:
        """Queue `seqs` first, in the order given."""
        before = len(self._front)
        self._front.extendleft(reversed(list(seqs)))
        self._len += len(self._front) - before

    def remove(self, seq: Sequence) -> None:
        if self._front and seq in self._front:
            self._front.remove(seq)
        else:
            queue = self._queues[seq.share]
            queue.remove(seq)
            if not queue:
                del self._queues[seq.share]
                del self._since[seq.share]
        self._len -= 1


class Scheduler:
    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.block_manager = BlockManager(config.num_blocks, config.block_size, config.enable_prefix_caching)
        self._running_per_share: Counter[str | None] = Counter()  # of `running`, for the waiting queue's order
        self.waiting = WaitingQueue(self._running_per_share)
        # In admission order (the last admitted is preempted first); a dict, not a list, so that a sequence leaves
        # in O(1) wherever it is: removing from a list scans half of it on average, and short jobs finish dozens
        # a step.
        self.running: dict[Sequence, None] = {}
        # Running slots kept for the forks still to come of running sequences (the sum of their `num_forks`)
        self.num_reserved = 0
        # Prompt tokens served from the prefix cache so far, counted as each sequence is admitted (a sequence that
        # waits at the head of the queue matches its prefix again at every step until it fits)
        self.num_prefix_hit_tokens = 0

    def check(self, seq: Sequence) -> None:
        """Reject a request that could never finish, before it takes any resources (a scoring sequence generates
        nothing: its tokens are all it needs)."""
        total = seq.num_tokens + (0 if seq.num_scored_tokens else seq.params.max_tokens)
        what = "prompt" if seq.pooling is not None else "prompt + continuation"
        if seq.num_scored_tokens and total > self.config.max_model_len:
            raise InvalidRequestError("prompt", f"{what} ({total} tokens) exceeds max_model_len "
                                      f"({self.config.max_model_len})")
        if total > self.config.max_model_len:
            room = self.config.max_model_len - seq.num_tokens
            fix = f": set max_tokens to at most {room} or shorten the prompt" if room > 0 else ": shorten the prompt"
            raise InvalidRequestError(
                "max_tokens" if seq.num_tokens <= self.config.max_model_len else "prompt",
                f"prompt ({seq.num_tokens} tokens) + max_tokens ({seq.params.max_tokens}) = {total} exceeds "
                f"max_model_len ({self.config.max_model_len}){fix}",
            )
        if self.block_manager.blocks_needed(total) > self.block_manager.num_blocks:
            what = what if seq.num_scored_tokens else "prompt + max_tokens"
            raise InvalidRequestError(
                "prompt",
                f"{what} = {total} tokens needs {self.block_manager.blocks_needed(total)} KV blocks "
                f"but the whole KV cache has {self.block_manager.num_blocks}",
            )

    def add(self, seq: Sequence) -> None:
        self.check(seq)
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch(self.config.max_num_batched_tokens, score_rows=self.config.max_num_seqs)
        decoding, prefilling, growing, filling = self._split_running()
        if decoding and len(decoding) <= batch.budget and self._grow_without_preempting(growing):
            # The common step: every decoding sequence gets its one token and no one is preempted, so the
            # per-sequence loop below (budget, status, reservation) would only confirm it, one at a time.
            batch.seqs, batch.num_new_tokens = decoding, [1] * len(decoding)
            batch.budget -= len(decoding)
            batch.num_decodes, rest = len(decoding), prefilling
        else:
            filling, rest = [], decoding + prefilling
        block_size = self.config.block_size
        for seq in rest:
            if batch.budget == 0:
                break
            if seq.status is not SequenceStatus.RUNNING:  # preempted earlier in this loop
                continue
            count = min(len(seq.token_ids) - seq.num_computed_tokens, batch.budget)
            if seq.num_scored_tokens and not (count := _score_count(seq, count, batch)):
                continue
            # Most steps need no new block: skip the reservation (and its preemption search) then.
            if seq.num_computed_tokens + count <= len(seq.block_table) * block_size or self._reserve(seq, count, batch):
                batch.add(seq, count)
        self._publish(batch, filling)
        self._admit(batch)
        return batch

    def _split_running(self) -> tuple[list[Sequence], list[Sequence], list[Sequence], list[Sequence]]:
        """The running sequences that decode (one token left, not scoring) and those that prefill, in admission
        order, and of the decoding ones, those whose token needs a new block and those whose token fills one."""
        block_size = self.config.block_size
        decoding: list[Sequence] = []
        prefilling: list[Sequence] = []
        growing: list[Sequence] = []
        filling: list[Sequence] = []
        for seq in self.running:
            computed = seq.num_computed_tokens
            if len(seq.token_ids) - computed == 1 and not seq.num_scored_tokens:
                decoding.append(seq)
                if computed >= len(seq.block_table) * block_size:
                    growing.append(seq)
                if (computed + 1) % block_size == 0:
                    filling.append(seq)
            else:
                prefilling.append(seq)
        return decoding, prefilling, growing, filling

    def _grow_without_preempting(self, growing: list[Sequence]) -> bool:
        """Give each of `growing` (decoding sequences) the block its next token needs, in order, if the free
        blocks suffice for all of them; otherwise change nothing and return False (the caller preempts)."""
        manager = self.block_manager
        needed = [manager.blocks_needed(seq.num_computed_tokens + 1) - len(seq.block_table) for seq in growing]
        if sum(needed) > manager.num_free_blocks:
            return False
        for seq in growing:
            manager.allocate(seq, seq.num_computed_tokens + 1)
        return True

    def _publish(self, batch: ScheduledBatch, filling: list[Sequence]) -> None:
        """Register the blocks this step fills, now that no preemption is left to undo it. `filling` are
        those of the batch's leading `num_decodes` decodes that fill a block (0 if a preemption reset it)."""
        block_size = self.config.block_size
        cache_full_blocks = self.block_manager.cache_full_blocks
        head = batch.num_decodes
        if head:
            for seq in filling:
                cache_full_blocks(seq, seq.num_computed_tokens + 1)
        for seq, count in zip(batch.seqs[head:], batch.num_new_tokens[head:]):
            if (seq.num_computed_tokens + count) // block_size > seq.num_computed_tokens // block_size:  # fills one
                cache_full_blocks(seq, seq.num_computed_tokens + count)

    def _reserve(self, seq: Sequence, count: int, batch: ScheduledBatch) -> bool:
        """Make room for `count` more tokens of `seq`, preempting the most recently admitted sequences."""
        target = seq.num_computed_tokens + count
        while not self.block_manager.can_allocate(seq, target):
            victim = next(reversed(self.running))
            self._preempt(victim, batch)
            if victim is seq:
                return False
        self.block_manager.allocate(seq, target)
        return True

    def _admit(self, batch: ScheduledBatch) -> None:
        if self.running and self._free_slots() < 1:
            return  # no slot free: the waiting queue's order need not be worked out
        while self.waiting and batch.budget > 0 and self._has_slots(seq := self.waiting.first()):
            self.block_manager.match_prefix(seq)
            count = min(seq.num_uncomputed_tokens, batch.budget)
            if seq.num_scored_tokens:
                count = _score_count(seq, count, batch)
            if not count or not self.block_manager.can_allocate(seq, seq.num_computed_tokens + count):
                self.block_manager.free(seq)  # give back the prefix hits; retry next step
                return
            self.block_manager.allocate(seq, seq.num_computed_tokens + count)
            self.block_manager.cache_full_blocks(seq, seq.num_computed_tokens + count)
            self.waiting.admit(seq)
            self.num_prefix_hit_tokens += seq.num_cached_tokens
            self._run(seq)
            batch.add(seq, count)

    def _has_slots(self, seq: Sequence) -> bool:
        """Whether `seq` and its forks to come fit the running slots left (a sequence alone always fits)."""
        return 1 + seq.num_forks <= self._free_slots() or not self.running

    def _free_slots(self) -> int:
        """Running slots neither taken nor kept for forks to come."""
        return self.config.max_num_seqs - len(self.running) - self.num_reserved

    def _run(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.RUNNING
        self.running[seq] = None
        self.num_reserved += seq.num_forks
        self._running_per_share[seq.share] += 1

    def _stop(self, seq: Sequence) -> None:
        del self.running[seq]
        self.num_reserved -= seq.num_forks
        self._running_per_share[seq.share] -= 1
        if not self._running_per_share[seq.share]:
            del self._running_per_share[seq.share]  # shares come and go (a run, a tenant): keep only those running

    def fork(self, parent: Sequence, children: list[Sequence],
             lengths: list[int] | None = None) -> list[tuple[int, int]]:
        """Start `children` from the K/V of `parent` (computed, still running): child i's first `lengths[i]` tokens
        (default: all of parent's) are parent's. Each runs as newly admitted (`BlockManager.fork`), in a slot that
        `parent.num_forks` kept for it, which drops to 0. Returns the (source, copy) block pairs whose K/V the runner
        copies before the next step. A child without a free slot, or a free block for its copy, is queued at the front
        instead (it finds the full blocks in the prefix cache)."""
        self.num_reserved -= parent.num_forks
        parent.num_forks = 0
        copies, queued = [], []
        for child, length in zip(children, lengths or [parent.num_computed_tokens] * len(children)):
            needs_copy = length % self.config.block_size != 0
            if 1 + child.num_forks > self._free_slots() or self.block_manager.num_free_blocks < needs_copy:
                queued.append(child)
                continue
            pair = self.block_manager.fork(parent, child, length)
            if pair is not None:
                copies.append(pair)
            self.num_prefix_hit_tokens += child.num_cached_tokens
            self._run(child)
        self.waiting.put_back(queued)
        return copies

    def _preempt(self, seq: Sequence, batch: ScheduledBatch) -> None:
        """Free `seq`'s blocks and requeue it at the front: it recomputes prompt and outputs later."""
        self._stop(seq)
        batch.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.WAITING
        self.waiting.put_back([seq])
        batch.num_preempted += 1

    def update(self, batch: ScheduledBatch, sampled: list[int]) -> list[Sequence]:
        """Account for a finished forward pass. `sampled` holds one token per sampling sequence, in batch
        order. Returns the sequences that received a token (the caller decides whether they finish)."""
        grown = list(compress(batch.seqs, batch.sample_mask))
        if len(sampled) != len(grown):
            raise ValueError(f"sampled: {len(sampled)} tokens for {len(grown)} sampling sequences")
        head = batch.num_decodes
        for seq, token in zip(grown[:head], sampled):
            seq.num_computed_tokens += 1
            seq.token_ids.append(token)
        for seq, count in zip(batch.seqs[head:], batch.num_new_tokens[head:]):
            seq.num_computed_tokens += count
        for seq, token in zip(grown[head:], sampled[head:]):
            seq.token_ids.append(token)
        return grown

    def finish(self, seq: Sequence, reason: str) -> None:
        """Release a finished (or aborted) sequence's blocks at once, wherever it is."""
        if seq.status is SequenceStatus.RUNNING:
            self._stop(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason


def _score_count(seq: Sequence, count: int, batch: ScheduledBatch) -> int:
    """`count` tokens of scoring sequence `seq` cut so that the positions it scores fit `batch.score_rows`, which
    they then take (0: none fit). A pooling sequence reads no logits: `count` as it is."""
    if seq.pooling is not None:
        return count
    start = max(seq.num_computed_tokens, seq.num_tokens - seq.num_scored_tokens)  # its first scored position
    count = min(count, start - seq.num_computed_tokens + batch.score_rows)
    batch.score_rows -= max(0, seq.num_computed_tokens + count - start)
    return count
