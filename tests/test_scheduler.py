"""Scheduler and block manager: unit tests and hypothesis properties, pure Python (no model)."""

from __future__ import annotations

import subprocess
import sys
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenmill.errors import InvalidRequestError
from tokenmill.sampling_params import SamplingParams
from tokenmill.scheduler.block_manager import BlockManager, chain_hash
from tokenmill.scheduler.scheduler import ScheduledBatch, Scheduler, SchedulerConfig
from tokenmill.scheduler.sequence import Sequence, SequenceStatus

EOS = 0


def make_seq(tokens: list[int], max_tokens: int = 4, request_id: str = "r", share: str | None = None) -> Sequence:
    return Sequence(request_id, tokens, SamplingParams(max_tokens=max_tokens), share=share)


def run_step(scheduler: Scheduler, next_token: int = 1) -> list[Sequence]:
    """Plan a step, pretend the model ran, finish sequences on EOS or max_tokens. Returns finished ones."""
    batch = scheduler.schedule()
    assert batch.num_tokens <= scheduler.config.max_num_batched_tokens
    sampled = [next_token for i in range(len(batch.seqs)) if batch.samples(i)]
    finished = []
    for seq in scheduler.update(batch, sampled):
        if seq.token_ids[-1] == EOS or seq.num_output_tokens >= seq.params.max_tokens:
            scheduler.finish(seq, "stop")
            finished.append(seq)
    return finished


def check_blocks(scheduler: Scheduler) -> None:
    """Reference counts equal the block-table references of live sequences; free list = blocks at zero."""
    manager = scheduler.block_manager
    live = list(scheduler.running) + list(scheduler.waiting)
    references = Counter(b for seq in live for b in seq.block_table)
    for block in manager.blocks:
        assert block.ref_count == references.get(block.block_id, 0), block
        assert (block.block_id in manager.free_blocks) == (block.ref_count == 0), block
    for seq in scheduler.running:
        assert len(seq.block_table) * manager.block_size >= seq.num_computed_tokens
    for seq in scheduler.waiting:
        assert seq.block_table == [] and seq.num_computed_tokens == 0
    if manager.enable_prefix_caching:  # incremental hashing published every computed full block, chained
        size = manager.block_size
        for seq in scheduler.running:
            parent = None
            for index in range(seq.num_computed_tokens // size):
                parent = chain_hash(parent, tuple(seq.token_ids[index * size : (index + 1) * size]))
                assert manager.blocks[seq.block_table[index]].hash == parent, (seq, index)


def test_scheduler_does_not_import_torch() -> None:
    code = "import sys, tokenmill.scheduler.scheduler; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_decode_first_then_chunks_fill_the_budget() -> None:
    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=10, block_size=4, num_blocks=64))
    first, second = make_seq(list(range(1, 4)), request_id="a"), make_seq(list(range(1, 30)), request_id="b")
    scheduler.add(first)
    scheduler.add(second)
    batch = scheduler.schedule()
    assert batch.seqs == [first, second] and batch.num_new_tokens == [3, 7]  # 'b' split at the budget
    scheduler.update(batch, [5])
    batch = scheduler.schedule()
    assert batch.seqs == [first, second] and batch.num_new_tokens == [1, 9]  # decode first, then the chunk
    assert second.num_computed_tokens == 7


def test_prefix_cache_reuses_only_whole_matching_prefixes() -> None:
    manager = BlockManager(num_blocks=16, block_size=4)
    owner = make_seq(list(range(1, 14)))
    manager.allocate(owner, 13)
    manager.cache_full_blocks(owner, 13)  # three full blocks
    same = make_seq(list(range(1, 14)))
    manager.match_prefix(same)
    assert same.block_table == owner.block_table[:3] and same.num_computed_tokens == 12
    other_start = make_seq([99] + list(range(2, 14)))  # same later blocks, different first token
    manager.match_prefix(other_start)
    assert other_start.block_table == [] and other_start.num_computed_tokens == 0
    exact = make_seq(list(range(1, 13)))  # 12 tokens: the last block is left to compute for the logits
    manager.match_prefix(exact)
    assert exact.num_computed_tokens == 8


def test_freed_blocks_stay_cached_until_evicted_lru() -> None:
    manager = BlockManager(num_blocks=4, block_size=2)
    first = make_seq([1, 2, 3, 4, 5])
    manager.allocate(first, 5)
    manager.cache_full_blocks(first, 5)
    manager.free(first)
    assert manager.num_free_blocks == 4
    again = make_seq([1, 2, 3, 4, 5])
    manager.match_prefix(again)
    assert again.num_computed_tokens == 4  # still cached after being freed
    manager.free(again)
    filler = make_seq([7] * 5)
    manager.allocate(filler, 5)  # three blocks: the never-cached one, the unhashed tail, then block [3, 4]
    hit = make_seq([1, 2, 3, 4, 5])
    manager.match_prefix(hit)
    assert hit.num_computed_tokens == 2  # the head block, freed last, survived
    manager.free(hit)
    manager.free(filler)
    manager.allocate(make_seq([8] * 8), 8)  # the whole pool: everything evicted
    miss = make_seq([1, 2, 3, 4, 5])
    manager.match_prefix(miss)
    assert miss.num_computed_tokens == 0


def test_prefix_hits_are_counted_once_per_admission() -> None:
    """A request that shares cached blocks but does not fit yet matches its prefix at every step it waits at the head
    of the queue; its hits count once, when it is admitted."""
    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=64, block_size=4, num_blocks=6, max_model_len=64))
    first = Sequence("a", [1] * 8 + [2], SamplingParams(max_tokens=12))
    scheduler.add(first)
    while len(first.token_ids) < 17:  # 5 of the 6 blocks
        scheduler.update(scheduler.schedule(), [3])
    waiting = Sequence("b", [1] * 8 + [4] * 8, SamplingParams(max_tokens=1))  # its first 2 blocks are `first`'s
    scheduler.add(waiting)
    steps = 0
    while waiting.status is not SequenceStatus.RUNNING:  # it needs 2 blocks more than are free until `first` ends
        batch = scheduler.schedule()
        scheduler.update(batch, [3] * batch.sample_mask.count(True))
        if len(first.token_ids) >= 21:
            scheduler.finish(first, "length")
        steps += 1
    assert steps > 2 and scheduler.num_prefix_hit_tokens == waiting.num_cached_tokens == 8


def test_requests_that_can_never_fit_are_rejected() -> None:
    scheduler = Scheduler(SchedulerConfig(max_model_len=64, block_size=4, num_blocks=8))
    with pytest.raises(InvalidRequestError, match="max_model_len") as error:
        scheduler.add(make_seq(list(range(60)), max_tokens=10))
    assert error.value.field == "max_tokens"
    with pytest.raises(InvalidRequestError, match="KV blocks"):
        scheduler.add(make_seq(list(range(30)), max_tokens=10))  # 40 tokens > 8 blocks of 4
    assert not scheduler.has_unfinished()


def test_decode_preempts_the_most_recently_admitted() -> None:
    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=64, block_size=4, num_blocks=4))
    old, new = make_seq([1] * 8, max_tokens=8, request_id="old"), make_seq([2] * 8, max_tokens=8, request_id="new")
    scheduler.add(old)
    scheduler.add(new)
    run_step(scheduler)  # both prefilled: 2 full blocks each, pool full; both now hold 9 tokens
    batch = scheduler.schedule()  # both need a third block to decode
    assert batch.seqs == [old] and batch.num_preempted == 1
    assert new.status is SequenceStatus.WAITING and scheduler.waiting.first() is new and new.block_table == []
    check_blocks(scheduler)


def test_waiting_requests_are_admitted_in_fair_shares() -> None:
    """A share's backlog does not hold another share's request: the share with the fewest running sequences goes
    first (the oldest head among equals), each share in arrival order."""
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=64, block_size=4, num_blocks=64))
    backlog = [make_seq([1, 2, 3], max_tokens=10, request_id=f"a{i}", share="a") for i in range(4)]
    for seq in backlog:
        scheduler.add(seq)
    run_step(scheduler)
    assert list(scheduler.running) == backlog[:2]
    late = [make_seq([4, 5], max_tokens=1, request_id="b0", share="b"), make_seq([6], max_tokens=1, request_id="plain")]
    for seq in late:
        scheduler.add(seq)
    assert [seq.request_id for seq in scheduler.waiting] == ["a2", "a3", "b0", "plain"]
    assert scheduler.waiting.first() is late[0]  # "b" and None run nothing, "a" two; "b"'s head is the older
    scheduler.finish(backlog[0], "stop")
    assert run_step(scheduler) == [late[0]]  # b0 took a0's slot, ahead of a2
    assert run_step(scheduler) == [late[1]]  # "a" runs one, None none: the plain request, though a2 came first
    run_step(scheduler)
    assert list(scheduler.running) == [backlog[1], backlog[2]]  # "a" alone again: in arrival order


def test_a_waiting_share_is_not_starved_by_shares_that_come_and_go() -> None:
    """A full engine; share "x" was served once and waits with H while, each step, a slot frees and a job of a share
    seen for the first time (a tenant, a run) arrives. H goes at the first tie: its share waited longest."""
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=256, block_size=4, num_blocks=4096))
    arrivals = iter(make_seq([1, 2, 3], max_tokens=1000, request_id=f"new-{i}", share=f"new-{i}") for i in range(10**6))
    for _ in range(3):
        scheduler.add(next(arrivals))
    served, held = make_seq([5, 6], max_tokens=1000, share="x"), make_seq([5, 6, 7], max_tokens=1000, share="x")
    scheduler.add(served)
    scheduler.add(held)
    run_step(scheduler)
    assert served.status is SequenceStatus.RUNNING and held.status is SequenceStatus.WAITING
    for step in range(3):
        scheduler.finish(served if served.status is SequenceStatus.RUNNING else next(iter(scheduler.running)), "stop")
        scheduler.add(next(arrivals))
        run_step(scheduler)
        if held.status is SequenceStatus.RUNNING:
            break
    assert held.status is SequenceStatus.RUNNING, "a share that waited lost every tie to newly seen shares"


def test_put_back_sequences_go_before_every_shares_new_ones() -> None:
    """A preempted sequence (it ran, and may have been preempted to let another grow) is admitted before any share's
    new requests, as at the head of the one queue without shares: a step that preempts admits nothing new first."""
    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=64, block_size=4, num_blocks=4))
    old, new = make_seq([1] * 8, max_tokens=8, request_id="old", share="a"), make_seq([2] * 8, max_tokens=8, share="b")
    scheduler.add(old)
    scheduler.add(new)
    run_step(scheduler)
    fresh = make_seq([3], max_tokens=2, request_id="fresh", share="c")
    scheduler.add(fresh)
    batch = scheduler.schedule()  # both need a third block: "new" is preempted, and waits before "fresh"
    assert batch.seqs == [old] and batch.num_preempted == 1 and fresh.status is SequenceStatus.WAITING
    assert scheduler.waiting.first() is new and [seq.request_id for seq in scheduler.waiting] == ["r", "fresh"]
    check_blocks(scheduler)


def test_without_shares_the_waiting_queue_is_first_in_first_out() -> None:
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=64, block_size=4, num_blocks=64))
    seqs = [make_seq([1, 2], max_tokens=1, request_id=str(i)) for i in range(5)]
    for seq in seqs:
        scheduler.add(seq)
    order = []
    while scheduler.has_unfinished():
        order += [seq.request_id for seq in run_step(scheduler)]
    assert order == ["0", "1", "2", "3", "4"]


# A planner and its requests, as the property tests draw them: (prompt length, max_tokens, which prefix) per request.
PLANNER_CASES = {
    "requests": st.lists(st.tuples(st.integers(1, 40), st.integers(1, 12), st.integers(0, 3)), min_size=1, max_size=24),
    "budget": st.integers(1, 48),
    "block_size": st.sampled_from([1, 2, 4, 16]),
    "num_blocks": st.integers(4, 40),
    "max_num_seqs": st.integers(1, 8),
    "caching": st.booleans(),
}
PREFIXES = [[], [5] * 8, [6] * 17, [7] * 33]


def planner_config(budget: int, block_size: int, num_blocks: int, max_num_seqs: int, caching: bool) -> SchedulerConfig:
    return SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, max_model_len=64,
                           block_size=block_size, num_blocks=num_blocks, enable_prefix_caching=caching)


def request_seqs(requests: list[tuple[int, int, int]], shares: int = 0) -> list[Sequence]:
    """The requests as sequences; with `shares`, request i in share i % shares (share 0: None, no share)."""
    return [make_seq((PREFIXES[p] + [9] * n)[:52], max_tokens=m, request_id=str(i),
                     share=(str(i % shares) if i % shares else None) if shares else None)
            for i, (n, m, p) in enumerate(requests)]


@settings(max_examples=150, deadline=None)
@given(**PLANNER_CASES, shares=st.integers(0, 3),
       actions=st.lists(st.sampled_from(["step", "step", "step", "add", "abort", "eos"]), max_size=200))
def test_any_sequence_of_operations_keeps_the_invariants(requests, budget, block_size, num_blocks, max_num_seqs,
                                                         caching, shares, actions) -> None:
    scheduler = Scheduler(planner_config(budget, block_size, num_blocks, max_num_seqs, caching))
    pending = request_seqs(requests, shares)
    admitted: list[Sequence] = []

    def add_next() -> None:
        seq = pending.pop()
        try:
            scheduler.add(seq)
            admitted.append(seq)
        except InvalidRequestError:
            assert scheduler.block_manager.blocks_needed(seq.num_tokens + seq.params.max_tokens) > num_blocks

    for action in actions:
        if action == "add" and pending:
            add_next()
        elif action == "abort" and admitted and not admitted[-1].is_finished:
            scheduler.finish(admitted[-1], "abort")
        else:
            batch_before = (len(scheduler.running), len(scheduler.waiting))
            run_step(scheduler, next_token=EOS if action == "eos" else 1)
            assert len(scheduler.running) <= max_num_seqs, batch_before
        check_blocks(scheduler)
        assert len(scheduler.waiting) == len(list(scheduler.waiting))
        assert Counter(seq.share for seq in scheduler.running) == scheduler._running_per_share
    while pending:
        add_next()
    for _ in range(10_000):  # every admitted request finishes: no deadlock, no starvation
        if not scheduler.has_unfinished():
            break
        run_step(scheduler)
        check_blocks(scheduler)
    assert not scheduler.has_unfinished()
    assert all(seq.is_finished for seq in admitted)
    assert all(block.ref_count == 0 for block in scheduler.block_manager.blocks)
    assert scheduler.block_manager.num_free_blocks == num_blocks


class PerSequenceScheduler(Scheduler):
    """The planner as it was before its decode fast path: every running sequence through one loop. The
    fast path must plan exactly what this plans, block ids, prefix hashes and preemptions included."""

    def schedule(self):  # noqa: ANN201
        batch = ScheduledBatch(self.config.max_num_batched_tokens)
        block_size = self.config.block_size
        decoding = [s for s in self.running if len(s.token_ids) - s.num_computed_tokens == 1]
        prefilling = [s for s in self.running if len(s.token_ids) - s.num_computed_tokens != 1]
        for seq in decoding + prefilling:
            if batch.budget == 0:
                break
            if seq.status is not SequenceStatus.RUNNING:
                continue
            count = min(len(seq.token_ids) - seq.num_computed_tokens, batch.budget)
            if seq.num_computed_tokens + count <= len(seq.block_table) * block_size or self._reserve(seq, count, batch):
                batch.add(seq, count)
        for seq, count in zip(batch.seqs, batch.num_new_tokens):
            if (seq.num_computed_tokens + count) // block_size > seq.num_computed_tokens // block_size:
                self.block_manager.cache_full_blocks(seq, seq.num_computed_tokens + count)
        self._admit(batch)
        return batch


def planner_state(scheduler: Scheduler) -> tuple:
    manager = scheduler.block_manager
    live = [(s.request_id, s.status, s.num_computed_tokens, list(s.block_table)) for s in scheduler.running]
    return (live, [s.request_id for s in scheduler.waiting], list(manager.free_blocks),
            dict(manager.cached_blocks), [(b.hash, b.ref_count) for b in manager.blocks])


@settings(max_examples=150, deadline=None)
@given(**PLANNER_CASES, tokens=st.lists(st.sampled_from([EOS, 1, 1, 1, 2]), max_size=200))
def test_decode_fast_path_plans_what_the_per_sequence_loop_plans(requests, budget, block_size, num_blocks,
                                                                  max_num_seqs, caching, tokens) -> None:
    config = planner_config(budget, block_size, num_blocks, max_num_seqs, caching)
    fast, slow = Scheduler(config), PerSequenceScheduler(config)
    for scheduler in (fast, slow):
        for seq in request_seqs(requests):
            if scheduler.block_manager.blocks_needed(seq.num_tokens + seq.params.max_tokens) <= num_blocks:
                scheduler.add(seq)
    for token in tokens + [1] * 2000:
        if not fast.has_unfinished():
            break
        plans = []
        for scheduler in (fast, slow):
            batch = scheduler.schedule()
            plans.append(([s.request_id for s in batch.seqs], batch.num_new_tokens, batch.num_preempted,
                          batch.sample_mask, planner_state(scheduler)))
            sampled = [token] * batch.sample_mask.count(True)
            for seq in scheduler.update(batch, sampled):
                if seq.token_ids[-1] == EOS or seq.num_output_tokens >= seq.params.max_tokens:
                    scheduler.finish(seq, "stop")
        assert plans[0] == plans[1]
    assert not fast.has_unfinished() and not slow.has_unfinished()


def test_update_refuses_a_token_count_that_does_not_match_the_sampling_sequences() -> None:
    scheduler = Scheduler(SchedulerConfig(block_size=4, num_blocks=8))
    scheduler.add(make_seq([1, 2, 3]))
    batch = scheduler.schedule()
    with pytest.raises(ValueError, match="2 tokens for 1 sampling"):
        scheduler.update(batch, [4, 5])
