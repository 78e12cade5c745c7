"""At most one host-device synchronisation per step: the sampled tokens' read-back.

On a GPU every tensor-to-Python conversion (`tolist`, `item`, `bool`, `int`, `numpy`, `cpu`, `nonzero`...)
makes the host wait for the device. The runner does its host-side arithmetic in numpy and Python only, so
on CPU a torch function mode that counts those conversions during `LLMEngine.step()` counts exactly what
would be a sync on a GPU. The Triton kernels' own launches are not counted (under the interpreter they read
tensors on the host, on a GPU they run on the device); the torch backend is the CPU reference, which reads
its metadata on the host by design, so its attention calls are not counted either.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from torch.overrides import TorchFunctionMode

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from model_fixtures import build_model_dir, random_prompts  # noqa: E402
from tokenmill import LLM, SamplingParams  # noqa: E402
from tokenmill.engine import transfer  # noqa: E402

T = torch.Tensor
READS = {T.tolist, T.item, T.__bool__, T.__int__, T.__float__, T.__index__, T.numpy, T.cpu, T.nonzero,
         T.__repr__, T.__format__, torch.nonzero, torch.equal, T.unique, torch.unique,
         T.masked_select, torch.masked_select}


class ReadCounter(TorchFunctionMode):
    """Counts tensor-to-host reads (outside `paused` sections) with the function that made each."""

    def __init__(self) -> None:
        super().__init__()
        self.reads: list[str] = []
        self.paused = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        if not self.paused and (func in READS or (func is T.__getitem__ and _bool_index(args))):
            self.reads.append(getattr(func, "__qualname__", str(func)))
        return func(*args, **(kwargs or {}))


def _bool_index(args: tuple) -> bool:
    index = args[1] if len(args) > 1 else None
    items = index if isinstance(index, tuple) else (index,)
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in items)


def paused(counter: ReadCounter, function):  # noqa: ANN001, ANN201
    def run(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        counter.paused += 1
        try:
            return function(*args, **kwargs)
        finally:
            counter.paused -= 1
    return run


class UncountedKernel:
    """A Triton kernel whose launch is not counted."""

    def __init__(self, kernel, counter: ReadCounter) -> None:  # noqa: ANN001
        self.kernel, self.counter = kernel, counter

    def __getitem__(self, grid):  # noqa: ANN001, ANN204
        return paused(self.counter, self.kernel[grid])


REQUESTS = [
    dict(temperature=0.0),
    dict(temperature=0.8, seed=1),
    dict(temperature=0.9, top_p=0.9, top_k=20, seed=2 ** 40),
    dict(temperature=0.0, logprobs=2),
    dict(temperature=1.0, min_p=0.1, repetition_penalty=1.2, min_tokens=3, seed=5),
]


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_each_step_reads_the_device_once(tmp_path: Path, backend: str, monkeypatch: pytest.MonkeyPatch) -> None:
    llm = LLM(str(build_model_dir("llama", tmp_path)), attention_backend=backend, max_num_batched_tokens=24,
              num_kv_blocks=64, block_size=4)
    engine = llm.engine
    counter = ReadCounter()
    if backend == "triton":
        from tokenmill.kernels import triton_attention

        for name in ("_paged_attention_kernel", "_write_kv_kernel"):
            monkeypatch.setattr(triton_attention, name, UncountedKernel(getattr(triton_attention, name), counter))
    else:
        monkeypatch.setattr(engine.runner.backend, "paged_attention",
                            paused(counter, engine.runner.backend.paged_attention))
    for i, (prompt, options) in enumerate(zip(random_prompts(len(REQUESTS), 3, 30, seed=4), REQUESTS)):
        engine.add_request(str(i), prompt, SamplingParams(max_tokens=5, ignore_eos=True, **options))
    steps = 0
    while engine.has_unfinished():
        before = transfer.read_backs
        with counter:
            engine.step()
        assert transfer.read_backs - before == 1, "one read-back per step, through transfer.read_back"
        assert counter.reads == ["TensorBase.tolist"], counter.reads
        counter.reads.clear()
        steps += 1
    assert steps >= 5  # chunked prefill, mixed and decode-only steps


def test_the_counter_sees_a_sync(tmp_path: Path) -> None:
    """The mode catches the kind of read this issue removed from the sampler (`bool(greedy.all())`)."""
    counter = ReadCounter()
    with counter:
        greedy = torch.tensor([True, False])
        if not bool(greedy.all()):
            pass
    assert counter.reads
