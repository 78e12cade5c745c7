"""The persistent step inputs equal the same inputs built from scratch from the batch, on every step of
random schedules with chunked prefill, preemption, prefix hits, finishing and aborts, with the reused
staging buffer poisoned before every step, and the rows of finished sequences released or reclaimed."""

from __future__ import annotations

import random

import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from tokenmill.engine.step_inputs import StepInputBuilder
from tokenmill.sampling_params import SamplingParams
from tokenmill.scheduler.scheduler import ScheduledBatch, Scheduler, SchedulerConfig
from tokenmill.scheduler.sequence import Sequence


POISON = -0x5EED_0000_5EED  # an int64 whose halves are no valid int32 block, slot or length either
DTYPES = dict(input_ids=torch.int64, positions=torch.int64, slot_mapping=torch.int64, sample_rows=torch.int64,
              cu_seqlens_q=torch.int32, seq_lens=torch.int32, block_tables=torch.int32)


def expected(batch: ScheduledBatch, block_size: int) -> dict[str, list]:
    """The inputs as the runner built them before: from Python lists, every step."""
    ids, positions, slots, cu, lens, samples = [], [], [], [0], [], []
    for seq, count in zip(batch.seqs, batch.num_new_tokens):
        start = seq.num_computed_tokens
        ids += seq.token_ids[start : start + count]
        positions += range(start, start + count)
        slots += [seq.block_table[p // block_size] * block_size + p % block_size for p in range(start, start + count)]
        cu.append(cu[-1] + count)
        lens.append(start + count)
        if start + count == seq.num_tokens:
            samples.append(cu[-1] - 1)
    width = -(-max(lens) // block_size)
    tables = [(seq.block_table + [0] * width)[:width] for seq in batch.seqs]
    return dict(input_ids=[ids], positions=[positions], slot_mapping=slots, sample_rows=samples, cu_seqlens_q=cu,
                seq_lens=lens, block_tables=tables)


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10_000), block_size=st.sampled_from([1, 4, 16]), budget=st.integers(1, 40),
       num_blocks=st.integers(8, 40), max_num_seqs=st.integers(1, 6))
@example(seed=8, block_size=4, budget=5, num_blocks=8, max_num_seqs=3)  # readmitted with a shorter table
def test_inputs_match_a_rebuild_from_scratch(seed: int, block_size: int, budget: int, num_blocks: int,
                                             max_num_seqs: int) -> None:
    rng = random.Random(seed)
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                                          max_model_len=64, block_size=block_size, num_blocks=num_blocks))
    # Two rows to start with: the mirror must reclaim rows and grow.
    builder = StepInputBuilder(torch.device("cpu"), block_size, max_num_seqs=1, max_num_tokens=1)
    shared = [rng.randrange(50) for _ in range(20)]
    for i in range(12):
        prompt = (shared[: rng.randrange(20)] + [rng.randrange(50) for _ in range(rng.randint(1, 25))])[:40]
        seq = Sequence(str(i), prompt, SamplingParams(max_tokens=rng.randint(1, 12)))
        if scheduler.block_manager.blocks_needed(seq.num_tokens + seq.params.max_tokens) <= num_blocks:
            scheduler.add(seq)
    for _ in range(400):
        if not scheduler.has_unfinished():
            break
        batch = scheduler.schedule()
        if batch.seqs:
            builder.host[:] = POISON  # whatever an earlier step left in the staging buffer must not show
            builder.mirror.table[builder.mirror.free_rows] = POISON  # nor what a released row held
            inputs = builder.build(batch)
            for name, value in expected(batch, block_size).items():
                assert getattr(inputs, name).tolist() == value, name
                assert getattr(inputs, name).dtype == DTYPES[name], name
            assert inputs.max_seq_len == max(expected(batch, block_size)["seq_lens"])
        sampled = [rng.randrange(50) for flag in batch.sample_mask if flag]
        for seq in scheduler.update(batch, sampled):
            if seq.num_output_tokens >= seq.params.max_tokens or rng.random() < 0.05:
                scheduler.finish(seq, "stop")
                if rng.random() < 0.5:  # released by the engine, or left for the mirror to reclaim
                    builder.mirror.release(seq.seq_id)
    assert not scheduler.has_unfinished()
