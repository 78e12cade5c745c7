#!/usr/bin/env python
"""CUDA graphs of the decode step: replay against the same padded step run eagerly, bit for bit, per bucket.

A random-weight model of the Qwen2.5-0.5B shape (bf16 on CUDA) with `enforce_eager=False`: the engine captures one
graph per decode bucket at start (time and memory printed). For several batch sizes, a decode step is scheduled and
its logits taken three ways: the graph's replay, the same padded bucket run eagerly (`PaddedDecode._run`: the same
kernels, so the bits must match), and the unpadded eager step (different GEMM shapes: max difference and argmax
agreement reported). Then greedy tokens of the whole engine with graphs, with graphs and `async_scheduling` (which must
give the same tokens), and without graphs, and the time of each.

    python benchmarks/gpu_graphs.py             # CUDA
    python benchmarks/gpu_graphs.py --quick     # tiny model on CPU: the padded path eagerly (no capture)
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import sys
import tempfile
import time

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]
sys.path.append(_HERE)

import torch  # noqa: E402

from gpu_throughput import QUICK_SHAPES, SHAPES, write_model_dir  # noqa: E402


def engine(model_dir: str, graphs: bool, args: argparse.Namespace):  # noqa: ANN201
    from tokenmill import LLM
    from tokenmill.engine.padded_decode import PaddedDecode

    cuda = torch.cuda.is_available()
    llm = LLM(model_dir, dtype="bfloat16" if cuda else "float32", load_format="dummy", max_num_seqs=args.max_num_seqs,
              max_model_len=1024, enforce_eager=not graphs, seed=0,
              **({"gpu_memory_utilization": 0.4} if cuda else {"num_kv_blocks": 512}))
    runner = llm.engine.runner
    if graphs and runner.decode is None:  # CPU: the padded path, eagerly
        runner.decode = PaddedDecode(runner, llm.engine.max_model_len, capture=False)
    return llm


def check_buckets(llm, sizes: list[int], vocab: int) -> bool:  # noqa: ANN001
    from tokenmill import SamplingParams

    engine, ok = llm.engine, True
    decode = engine.runner.decode
    rng = random.Random(1)
    for size in sizes:
        for i in range(size):
            prompt = [rng.randrange(3, vocab) for _ in range(rng.randint(20, 300))]
            engine.add_request(f"{size}-{i}", prompt, SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True))
        for _ in range(50):  # until every request decodes
            engine.step()
            if all(request.output_token_ids for request in engine.requests.values()):
                break
        batch = engine.scheduler.schedule()
        if decode.fits(batch):
            ok &= compare(engine, decode, batch)
        else:
            print(f"  {size} sequences: the step is not a decode step ({len(batch.seqs)} sequences), skipped")
        for request_id in list(engine.requests):  # the scheduled step never runs: its sequences end here
            engine.abort_request(request_id)
    return ok


def compare(engine, decode, batch) -> bool:  # noqa: ANN001
    """The step three ways (see the module docstring); True when the replay equals its eager bucket bit for bit and
    picks the unpadded step's argmax in at least 90% of rows (both padded ways share the tables' strided view, so an
    error there would show only against the unpadded step; with wide weights rounding alone flips few argmaxes)."""
    with torch.inference_mode():
        replayed = decode.forward(batch).clone()
        bucket = decode.bucket(len(batch.seqs))
        padded_eager = decode._run(bucket)[: len(batch.seqs)]
        eager = engine.runner.forward(engine.runner.inputs.build(batch))
    same = torch.equal(replayed, padded_eager)
    diff = (replayed.float() - eager.float()).abs().max().item()
    argmax = (replayed.argmax(-1) == eager.argmax(-1)).float().mean().item()
    graph = "graph" if bucket in decode.graphs else "eager"
    print(f"  {len(batch.seqs):4d} sequences, bucket {bucket:4d} ({graph}): replay == padded eager bitwise: {same}; "
          f"vs unpadded eager: max |diff| {diff:.3g}, argmax agreement {argmax:.3f}", flush=True)
    return same and argmax >= 0.9


def greedy(llm, prompts: list[list[int]], max_tokens: int) -> tuple[list[list[int]], float, int]:  # noqa: ANN001
    from tokenmill import SamplingParams

    steps = llm.engine.stats().num_steps
    start = time.perf_counter()
    outputs = llm.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
                           use_tqdm=False)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return [o.token_ids for o in outputs], time.perf_counter() - start, llm.engine.stats().num_steps - steps


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="tiny model (CPU is fine)")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--requests", type=int, default=None, help="greedy comparison: default 256 (8 with --quick)")
    args = p.parse_args(argv)
    if not torch.cuda.is_available() and not args.quick:
        print("gpu_graphs: CUDA graphs need CUDA; run with --quick for the padded path on CPU; nothing was measured")
        return 0
    # wide random weights (as gpu_parity.py's): default-init logits are near flat, and greedy tokens would then part
    # on any rounding difference between a padded bucket's GEMMs and the unpadded step's
    shape = {**(QUICK_SHAPES if args.quick else SHAPES)["qwen2.5-0.5b"], "initializer_range": 0.1}
    requests = args.requests or (8 if args.quick else 256)
    sizes = [1, 3, 8, 13, 64] if args.quick else [1, 3, 8, 13, 64, 100, 256]
    sizes = [s for s in sizes if s <= args.max_num_seqs]
    with tempfile.TemporaryDirectory() as model_dir:
        write_model_dir(model_dir, shape)
        start = time.perf_counter()
        with_graphs = engine(model_dir, True, args)
        decode = with_graphs.engine.runner.decode
        memory = torch.cuda.memory_reserved() / 2**30 if torch.cuda.is_available() else 0.0
        print(f"engine with graphs built in {time.perf_counter() - start:.1f} s; buckets {decode.buckets}; "
              f"captured {sorted(decode.graphs)}; reserved {memory:.2f} GiB", flush=True)
        ok = check_buckets(with_graphs, sizes, shape["vocab_size"])
        rng = random.Random(2)
        prompts = [[rng.randrange(3, shape["vocab_size"]) for _ in range(rng.randint(16, 512))] for _ in range(requests)]
        graph_tokens, graph_s, graph_steps = greedy(with_graphs, prompts, 128)
        # The same engine and graphs with each step launched before the last one's tokens are read back: the same
        # kernels on the same inputs (the fed token ids are the ones read back), so the same tokens.
        with_graphs.engine.config.async_scheduling = True
        async_tokens, async_s, _ = greedy(with_graphs, prompts, 128)
        same_async = sum(a == b for a, b in zip(graph_tokens, async_tokens))
        ok = ok and same_async == requests
        print(f"async scheduling, the same requests: identical {same_async}/{requests}; {async_s:.2f} s against "
              f"{graph_s:.2f} s: {graph_s / async_s:.2f}x", flush=True)
        decode = with_graphs = None  # its KV cache and graphs freed before the eager engine sizes its own
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        eager_tokens, eager_s, eager_steps = greedy(engine(model_dir, False, args), prompts, 128)
        same = sum(a == b for a, b in zip(graph_tokens, eager_tokens))
        print(f"greedy, {requests} requests x 128 tokens: identical {same}/{requests}; graphs {graph_s:.2f} s "
              f"({graph_steps} steps), eager {eager_s:.2f} s ({eager_steps} steps): {eager_s / graph_s:.2f}x", flush=True)
    print("replay == padded eager on every bucket checked, argmaxes as the unpadded step's; async scheduling's tokens "
          "the same" if ok else "FAIL: a replay differs from its padded eager step, its argmaxes from the unpadded "
          "step's, or async scheduling's tokens from the step-by-step engine's")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
