#!/usr/bin/env python
"""Host time per decode step: the real scheduler, runner, sampler and engine loop around a stub model.

The model is replaced by a stub that returns a fixed logits tensor (no forward pass), so what is timed is
everything the host does around the model in `LLMEngine.step()`: scheduling, block bookkeeping and prefix
hashing, building the ragged batch and its attention metadata, sampling (greedy argmax over a small
vocabulary, so the sampler's device work is negligible) and finishing. Every request has a ~680-token
prompt of its own (no prefix sharing) and decodes with EOS ignored; after all prompts are prefilled, the
benchmark times `--steps` decode steps and reports microseconds of host time per running sequence per step.

    python benchmarks/step_overhead.py                       # 256 and 1,024 running sequences
    PYTHONPATH=/path/to/other/checkout python benchmarks/step_overhead.py   # the same on another version
    python benchmarks/step_overhead.py --profile 1024        # cProfile of the decode steps, top functions
    python benchmarks/step_overhead.py --against /path/to/other/checkout   # both, side by side, alternating
    python benchmarks/step_overhead.py --against /path/to/other/checkout --instructions   # under callgrind
    python benchmarks/step_overhead.py --context 32 --outputs 16   # the steady state of short jobs (see below)

The figure is CPU time of the stepping thread (`time.thread_time`; torch runs on that one thread), so a loaded
machine costs wall time but not CPU time; it still inflates CPU time somewhat (shared caches, a sibling
hyperthread), which is why `--against` alternates the two versions, in fresh processes, `--rounds` times
and reports the median of each and their ratio. `--instructions` counts the instructions the timed steps
execute instead (valgrind's callgrind, switched on only around them through a client request; needs
valgrind, its headers and a C compiler): the same on an idle and a loaded machine, but the setup runs
under valgrind too (minutes at 1,024 sequences).

`--outputs N` times the steady state of short jobs instead: each request ends after N/2 to 3N/2 output tokens and
is replaced at once by a new one (added between the timed steps, as the worker's engine process adds them), so the
timed steps also finish requests, admit new ones and prefill their prompts (`--context`), all of which the decode-only
figure leaves out. In both modes the heap is frozen once the engine is built, as the worker's engine process freezes
it (`freeze_startup_objects`): without that, collections walking the engine's objects took a quarter to a third of
the steady state's host time.

It only uses `LLMEngine`, `tokenmill.engine.llm_engine.load` and the model call convention of the runner,
so it runs unchanged against older checkouts (how the "before" column of docs/benchmarks/step-overhead.md was measured).
"""

from __future__ import annotations

import argparse
import cProfile
import ctypes
import gc
import glob
import json
import os
import pstats
import random
import statistics
import subprocess
import sys
import tempfile
import time
from types import SimpleNamespace

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]

import torch  # noqa: E402
from transformers import LlamaConfig  # noqa: E402

import tokenmill.engine.llm_engine as llm_engine  # noqa: E402
from tokenmill import SamplingParams  # noqa: E402
from tokenmill.engine.loader import LoadedModel  # noqa: E402
from tokenmill.engine.tiny import tiny_tokenizer  # noqa: E402
from tokenmill.worker.engine_process import freeze_startup_objects  # noqa: E402

VOCAB = 64
MAX_TOKENS = 2048  # never reached: no request finishes while the steps are timed


class StubModel:
    """Called like the HF model by the runner; returns `[1, rows, VOCAB]` logits without computing anything."""

    generation_config = None

    def __init__(self, max_rows: int) -> None:
        generator = torch.Generator().manual_seed(0)
        self.logits = torch.randn(1, max_rows, VOCAB, generator=generator)

    def __call__(self, *, logits_to_keep: torch.Tensor, **kwargs: object) -> SimpleNamespace:
        return SimpleNamespace(logits=self.logits[:, : logits_to_keep.shape[0]])


def build_engine(num_seqs: int, context: int, steps: int, outputs: int = 0) -> llm_engine.LLMEngine:
    """An engine whose model is the stub, with a 1-layer, 1-head KV cache sized for the whole run."""
    hf_config = LlamaConfig(vocab_size=VOCAB, hidden_size=8, intermediate_size=8, num_hidden_layers=1,
                            num_attention_heads=1, num_key_value_heads=1, max_position_embeddings=4096,
                            bos_token_id=1, eos_token_id=2, pad_token_id=3)
    loaded = LoadedModel(StubModel(max(num_seqs, 8192)), tiny_tokenizer(), hf_config, torch.device("cpu"),
                         torch.float32)
    real_load = llm_engine.load
    llm_engine.load = lambda config: loaded
    try:
        # Sequences admitted first decode while the others prefill (about num_seqs * context / 8192 steps).
        longest = context + 40 + 5 + max(steps, 3 * outputs // 2) + num_seqs * (context + 40) // 8192 + 16
        blocks_per_seq = -(-longest // 16)
        return llm_engine.LLMEngine("builtin:tiny", max_num_seqs=num_seqs, max_num_batched_tokens=8192,
                                    max_model_len=4096, num_kv_blocks=max(num_seqs * blocks_per_seq, -(-(context + 40 + MAX_TOKENS) // 16)) + 16,
                                    block_size=16)
    finally:
        llm_engine.load = real_load


class Split:
    """CPU seconds per phase, by wrapping engine methods on the instance (those that exist in this version)."""

    PHASES = {"schedule": ("scheduler", "schedule"), "update": ("scheduler", "update"),
              "inputs": ("runner.inputs", "build"), "model": ("runner", "forward"), "sampler": ("runner", "sampler")}

    def __init__(self, engine: llm_engine.LLMEngine) -> None:
        self.seconds: dict[str, float] = {}
        for phase, (path, name) in self.PHASES.items():
            owner = engine
            for part in path.split("."):
                owner = getattr(owner, part, None)
            if owner is not None and hasattr(owner, name):
                self.seconds[phase] = 0.0
                setattr(owner, name, self._timed(phase, getattr(owner, name)))

    def _timed(self, phase: str, function):  # noqa: ANN001, ANN202
        def run(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            start = time.thread_time()
            try:
                return function(*args, **kwargs)
            finally:
                self.seconds[phase] += time.thread_time() - start
        return run


def measure(num_seqs: int, context: int, steps: int, temperature: float,
            profile: bool = False, split: bool = False, outputs: int = 0) -> tuple[float, float]:
    """Median wall and CPU microseconds per running sequence per decode step (with `outputs`, per step of the
    steady state in which requests finish and are replaced)."""
    engine = build_engine(num_seqs, context, steps, outputs)
    freeze_startup_objects()  # as the worker's engine process does once its engine is built, before any request
    rng = random.Random(num_seqs)
    jitter = min(40, context // 2)
    added = 0

    def add_request() -> None:
        nonlocal added
        max_tokens = rng.randint(max(1, outputs // 2), outputs * 3 // 2) if outputs else MAX_TOKENS
        prompt = [rng.randrange(4, VOCAB) for _ in range(context + rng.randint(-jitter, jitter))]
        engine.add_request(str(added), prompt, SamplingParams(max_tokens=max_tokens, temperature=temperature,
                                                               ignore_eos=True))
        added += 1

    for _ in range(num_seqs):
        add_request()
    if outputs:  # into the steady state: requests finish at their own lengths, each replaced at once
        for _ in range(3 * outputs // 2 + num_seqs * context // 8192 + 5):
            for _ in engine.step():
                add_request()
    else:
        while engine.scheduler.waiting or any(s.num_uncomputed_tokens > 1 for s in engine.scheduler.running):
            engine.step()
        for _ in range(5):  # warm-up decode steps
            engine.step()
        assert len(engine.scheduler.running) == num_seqs
    walls, cpus = [], []
    phases = Split(engine) if split else None
    profiler = cProfile.Profile() if profile else None
    callgrind = ctypes.CDLL(os.environ["STEP_OVERHEAD_CALLGRIND"]) if "STEP_OVERHEAD_CALLGRIND" in os.environ else None
    if callgrind:
        callgrind.timed_start()
    for _ in range(steps):
        wall0, cpu0 = time.perf_counter(), time.thread_time()
        if profiler:
            profiler.enable()
        if callgrind:
            callgrind.toggle()
        finished = engine.step()
        if callgrind:
            callgrind.toggle()
        if profiler:
            profiler.disable()
        walls.append(time.perf_counter() - wall0)
        cpus.append(time.thread_time() - cpu0)
        assert outputs or not finished, [(f.finish_reason, len(f.token_ids)) for f in finished[:3]]
        for _ in finished:  # outside the timed step, as a worker adds them between steps
            add_request()
    if callgrind:
        callgrind.timed_stop()
    gc.unfreeze()  # frozen objects outlive the interpreter's last collection: nanobind (triton) reports them as leaks
    if profiler:
        pstats.Stats(profiler).sort_stats("tottime").print_stats(25)
    scale = 1e6 / num_seqs
    if phases:
        total = sum(cpus)
        parts = {k: v for k, v in phases.seconds.items()}
        parts["engine (rest)"] = total - sum(parts.values())
        print(f"  {num_seqs} seqs, CPU us/seq/step by phase (mean): "
              + ", ".join(f"{k} {v / steps * scale:.2f}" for k, v in parts.items()), flush=True)
    return statistics.median(walls) * scale, statistics.median(cpus) * scale


# Instructions are counted only inside the timed `engine.step()` calls (collection toggled around each), as the CPU time
# is: not the requests added between them (the benchmark's own random prompts, in `--outputs`).
CALLGRIND_SOURCE = """#include <valgrind/callgrind.h>
void timed_start(void) { CALLGRIND_ZERO_STATS; CALLGRIND_START_INSTRUMENTATION; }
void toggle(void) { CALLGRIND_TOGGLE_COLLECT; }
void timed_stop(void) { CALLGRIND_STOP_INSTRUMENTATION; CALLGRIND_DUMP_STATS_AT("timed"); }
"""


def run_child(args: argparse.Namespace, size: int, pythonpath: str, workdir: str) -> float:
    """One measurement in a fresh process: CPU microseconds, or with --instructions instructions, per
    running sequence per step."""
    command = [sys.executable, os.path.abspath(__file__), str(size), "--one", "--context", str(args.context),
               "--steps", str(args.steps), "--temperature", str(args.temperature), "--outputs", str(args.outputs)]
    env = dict(os.environ, PYTHONPATH=pythonpath)
    if not args.instructions:
        out = subprocess.run(command, env=env, check=True, capture_output=True, text=True).stdout
        return json.loads(out.splitlines()[-1])["cpu"]
    env["STEP_OVERHEAD_CALLGRIND"] = os.path.join(workdir, "libcallgrind.so")
    for old in glob.glob(os.path.join(workdir, "callgrind.out*")):
        os.remove(old)
    out_file = os.path.join(workdir, "callgrind.out")
    subprocess.run(["valgrind", "--tool=callgrind", "--instr-atstart=no", "--collect-atstart=no", f"--callgrind-out-file={out_file}",
                    *command], env=env, check=True, capture_output=True, text=True)
    with open(out_file + ".1") as dump:  # the part dumped by timed_stop
        totals = next(int(line.split()[1]) for line in dump if line.startswith("totals:"))
    return totals / (args.steps * size)


def against(args: argparse.Namespace) -> None:
    """Both versions on the same machine in the same run: one process per size, version and round, the order
    of the two versions alternating each round."""
    versions = {"before": args.against, "after": os.environ.get("PYTHONPATH", "")}
    print(f"before: {args.against}; after: {versions['after'] or 'the installed tokenmill'}")
    unit = "instructions/seq/step" if args.instructions else "CPU us/seq/step"
    print(f"| running seqs | before: {unit} | after: {unit} | after/before | load average |")
    print("|---:|---:|---:|---:|---:|")
    workdir = tempfile.mkdtemp(prefix="step_overhead_")
    if args.instructions:
        source = os.path.join(workdir, "callgrind.c")
        with open(source, "w") as file:
            file.write(CALLGRIND_SOURCE)
        subprocess.run(["cc", "-shared", "-fPIC", "-o", os.path.join(workdir, "libcallgrind.so"), source], check=True)
    for size in args.sizes:
        cpus: dict[str, list[float]] = {"before": [], "after": []}
        loads = []
        for round_ in range(args.rounds):
            for name in (("before", "after") if round_ % 2 == 0 else ("after", "before")):
                loads.append(os.getloadavg()[0])
                cpus[name].append(run_child(args, size, versions[name], workdir))
        before, after = (statistics.median(cpus[k]) for k in ("before", "after"))
        digits = 0 if args.instructions else 2
        spread = {k: f"{min(v):.{digits}f}-{max(v):.{digits}f}" for k, v in cpus.items()}
        print(f"| {size} | {before:.{digits}f} ({spread['before']}) | {after:.{digits}f} ({spread['after']}) "
              f"| {after / before:.2f} | {min(loads):.1f}-{max(loads):.1f} |", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("sizes", nargs="*", type=int, default=[256, 1024], help="running sequences")
    parser.add_argument("--context", type=int, default=680, help="mean prompt length (tokens)")
    parser.add_argument("--steps", type=int, default=60, help="timed decode steps")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy rows")
    parser.add_argument("--outputs", type=int, default=0,
                        help="steady state: requests end after ~N output tokens (N/2 to 3N/2) and are replaced at once")
    parser.add_argument("--profile", action="store_true", help="cProfile the timed steps")
    parser.add_argument("--split", action="store_true", help="CPU time per phase (schedule, inputs, ...)")
    parser.add_argument("--against", metavar="PATH", help="compare with the tokenmill checkout at PATH")
    parser.add_argument("--rounds", type=int, default=3, help="with --against: runs of each version per size")
    parser.add_argument("--instructions", action="store_true",
                        help="with --against: count instructions under callgrind instead of CPU time")
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)  # a child of --against: JSON
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    if args.against:
        against(args)
        return 0
    if args.one:
        wall, cpu = measure(args.sizes[0], args.context, args.steps, args.temperature, outputs=args.outputs)
        print(json.dumps({"wall": wall, "cpu": cpu}))
        return 0
    import tokenmill

    print(f"tokenmill from {os.path.dirname(tokenmill.__file__)}; load average {os.getloadavg()[0]:.2f}")
    print("| running seqs | context | us/seq/step (wall) | us/seq/step (CPU) | ms/step (wall) |")
    print("|---:|---:|---:|---:|---:|")
    for size in args.sizes:
        wall, cpu = measure(size, args.context, args.steps, args.temperature, args.profile, args.split, args.outputs)
        print(f"| {size} | ~{args.context} | {wall:.2f} | {cpu:.2f} | {wall * size / 1000:.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
