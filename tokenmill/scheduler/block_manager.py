"""Paged KV cache bookkeeping: a fixed pool of blocks, reference counts, and a prefix cache.

A full block is identified by the chained hash of its tokens and every token before it, so a block is
reused only when the whole prefix matches. Freed blocks keep their hash and stay findable until they are
handed out again; the free queue is LRU, so the blocks freed longest ago are evicted first.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from tokenmill.scheduler.sequence import Sequence


@dataclass(eq=False)
class Block:
    block_id: int
    ref_count: int = 0
    hash: int | None = None
    token_ids: tuple[int, ...] = field(default_factory=tuple)


def chain_hash(parent: int | None, token_ids: tuple[int, ...]) -> int:
    return hash((parent, token_ids))


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks and block_size must be >= 1, got {num_blocks} and {block_size}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_blocks: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached_blocks: dict[int, int] = {}  # chain hash -> block id

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def match_prefix(self, seq: Sequence) -> None:
        """Give a newly admitted sequence the cached blocks of its longest cached full-block prefix.

        At least one token is always left uncomputed: the step that computes it yields the logits to sample (a
        scoring sequence: its last `num_scored_tokens`, whose logits it reads).
        """
        if not self.enable_prefix_caching or seq.block_table:
            return
        parent = None
        limit = seq.num_tokens - max(1, seq.num_scored_tokens)  # tokens that may come from the cache
        for start in range(0, limit - self.block_size + 1, self.block_size):
            tokens = tuple(seq.token_ids[start : start + self.block_size])
            parent = chain_hash(parent, tokens)
            block_id = self.cached_blocks.get(parent)
            if block_id is None or self.blocks[block_id].token_ids != tokens:
                break
            self._take(block_id)
            seq.block_table.append(block_id)
        seq.num_computed_tokens = seq.num_cached_tokens = len(seq.block_table) * self.block_size

    def fork(self, parent: Sequence, child: Sequence, length: int) -> tuple[int, int] | None:
        """Give `child`, whose first `length` tokens are `parent`'s and computed there, their K/V: parent's full blocks
        among them, shared, and for a partial last block a new block (the caller checked one is free) returned as
        (parent's, new) for the runner to copy the K/V into; the child's next step overwrites the copy from
        `length` on before it reads it."""
        full = length // self.block_size
        for block_id in parent.block_table[:full]:
            self._take(block_id)
        child.block_table = parent.block_table[:full]
        child.num_computed_tokens = child.num_cached_tokens = length
        if length == full * self.block_size:
            return None
        self.allocate(child, length)
        return parent.block_table[full], child.block_table[full]

    def can_allocate(self, seq: Sequence, num_tokens: int) -> bool:
        """Whether `seq` can hold `num_tokens` tokens in total."""
        return self.blocks_needed(num_tokens) - len(seq.block_table) <= self.num_free_blocks

    def allocate(self, seq: Sequence, num_tokens: int) -> None:
        """Grow `seq`'s block table to hold `num_tokens` tokens in total (caller checked `can_allocate`), with the
        blocks freed longest ago: each loses its hash (`_evict`), and a free block has no other reference."""
        for _ in range(self.blocks_needed(num_tokens) - len(seq.block_table)):
            block_id, _ = self.free_blocks.popitem(last=False)
            if self.blocks[block_id].hash is not None:
                self._evict(block_id)
            self.blocks[block_id].ref_count = 1
            seq.block_table.append(block_id)

    def cache_full_blocks(self, seq: Sequence, num_tokens: int) -> None:
        """Register the blocks that the first `num_tokens` tokens of `seq` fill, so later requests reuse them.

        Called when a step is planned, before its forward pass: a request admitted later in the same step may
        already share these blocks, since every layer writes the step's K/V before it attends. Only blocks
        completed by this step are hashed: every full block of the `num_computed_tokens` already in the
        cache was registered by the step that planned it (or came from the prefix cache, hash and all), so
        the cost per step follows the new tokens, not the context length.
        """
        if not self.enable_prefix_caching:
            return
        block_size = self.block_size
        first, end = seq.num_computed_tokens // block_size, num_tokens // block_size
        if first >= end:
            return
        table, blocks = seq.block_table, self.blocks
        parent = blocks[table[first - 1]].hash if first else None
        for index in range(first, end):
            block = blocks[table[index]]
            if block.hash is None:
                tokens = tuple(seq.token_ids[index * block_size : (index + 1) * block_size])
                block.hash, block.token_ids = chain_hash(parent, tokens), tokens
                self.cached_blocks.setdefault(block.hash, block.block_id)
            parent = block.hash

    def register_last_block(self, seq: Sequence) -> None:
        """Register again the block that `seq`'s last token completes, if it was registered before that token was
        known (an engine may plan a step before reading back the token the step before sampled): under the hash of its
        tokens as they are now. The step that computes the token's K/V was planned with it, so it runs before any
        step planned after this. A block registered with the right tokens, or not registered, is left as it is."""
        block_size, tokens = self.block_size, seq.token_ids
        index = len(tokens) // block_size - 1
        if not self.enable_prefix_caching or len(tokens) % block_size or index >= len(seq.block_table):
            return
        block = self.blocks[seq.block_table[index]]
        now = tuple(tokens[index * block_size :])
        parent = self.blocks[seq.block_table[index - 1]].hash if index else None
        if block.hash is None or block.token_ids == now or (index and parent is None):
            return
        if self.cached_blocks.get(block.hash) == block.block_id:
            del self.cached_blocks[block.hash]
        block.hash, block.token_ids = chain_hash(parent, now), now
        self.cached_blocks.setdefault(block.hash, block.block_id)

    def free(self, seq: Sequence) -> None:
        """Drop `seq`'s references. Its tail blocks are queued for eviction before its (more shareable) head."""
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            assert block.ref_count >= 0, f"block {block_id} freed twice"
            if block.ref_count == 0:
                self.free_blocks[block_id] = None
        seq.block_table = []
        seq.num_computed_tokens = 0

    def _take(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self.free_blocks[block_id]
        block.ref_count += 1

    def _evict(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.hash is not None and self.cached_blocks.get(block.hash) == block_id:
            del self.cached_blocks[block.hash]
        block.hash, block.token_ids = None, ()
