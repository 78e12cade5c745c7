#!/usr/bin/env python
"""Embeddings: prompt tokens per second of `LLM.embed` beside the engine's prefill and transformers, in one run.

  (a) tokenmill `LLM.embed(prompts)`: the prefill-only path (last-token pooling, L2-normalised),
  (b) the engine's prefill on the same prompts: `LLM.generate(prompts, max_tokens=1)` (greedy, EOS ignored), the same
      engine object as (a),
  (c) transformers padded batches of 32 prompts in input order, the sentence-transformers way: `AutoModel` forward
      with right padding and the attention mask (SDPA attention, inference mode), the last real token's hidden state
      found through the mask, L2-normalised;
  (c') the same with the prompts sorted longest first before batching, as `SentenceTransformer.encode` sorts them
      (`--no-sorted` leaves it out).

Model: random weights of Qwen2.5-0.5B's config (hidden 896, 14 heads, 2 KV heads, intermediate 4864, vocab 151936)
with `--layers` of its 24 decoder layers, built with transformers and saved once (`benchmarks/vllm_cpu.py`'s
`build_model_dir`, nothing downloaded); float32, CPU, the same torch thread count for every system, each warmed up
on a few prompts before it is timed. Workload: `--prompts` prompts of random token ids, lengths uniform in
`--min-len`..`--max-len` from a fixed seed. Prefix caching is off in the engine, so that neither (a) nor (b) finds
the other's blocks. tokens/s = the prompts' tokens / wall seconds of the call; the table also gives CPU seconds (about
wall x threads when the run had the cores to itself) and, for (c), the positions computed, pads included.
`--rounds N` runs the systems N times in turn (each round starting one system later), keeping each one's fastest.
The lowest cosine between (a)'s and (c)'s vectors checks that both computed the same thing. Goals (issue 58):
(a)/(b) >= 0.9 and (a)/(c) >= 2; the ratios are also given per CPU second, steadier on a shared machine.

    .venv/bin/python benchmarks/embeddings.py                          # 256 prompts of 16-512 tokens, 4 layers
    .venv/bin/python benchmarks/embeddings.py --prompts 128 --layers 2 --rounds 2  # docs/benchmarks/embeddings.md
    .venv/bin/python benchmarks/embeddings.py --quick                  # tiny model and workload, a smoke test
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import random
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

# Run as `python benchmarks/embeddings.py`, Python puts benchmarks/ first on sys.path, where a sibling script may
# shadow a standard module (benchmarks/queue.py shadows `queue`, which torch imports). Drop that entry.
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

sys.path.append(_HERE)  # after the standard library: sibling scripts importable, none shadowing a standard module
from vllm_cpu import QUICK, QWEN25_05B, build_model_dir, cpu_model, load_now  # noqa: E402

PAD_ID = 0  # the saved tokenizer's pad token
LABELS = {"embed": "(a) tokenmill LLM.embed", "prefill": "(b) tokenmill generate, max_tokens=1",
          "hf": "(c) transformers, batches of 32 in input order", "hf-sorted": "(c') transformers, sorted by length"}


@dataclass
class Run:
    wall: float
    cpu: float
    vectors: list[list[float]] | None = None
    positions: int = 0


def timed(function, *args) -> Run:  # noqa: ANN001
    gc.collect()
    wall, cpu = time.perf_counter(), time.process_time()
    vectors, positions = function(*args)
    return Run(time.perf_counter() - wall, time.process_time() - cpu, vectors, positions)


def make_prompts(count: int, low: int, high: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(low, high))] for _ in range(count)]  # no pad/bos/eos


def embed(llm, prompts: list[list[int]]) -> tuple[list[list[float]], int]:  # noqa: ANN001
    return [out.embedding for out in llm.embed(prompts)], sum(map(len, prompts))


def prefill(llm, prompts: list[list[int]]) -> tuple[None, int]:  # noqa: ANN001
    from tokenmill import SamplingParams

    outs = llm.generate(prompts, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True), use_tqdm=False)
    assert all(len(out.token_ids) == 1 for out in outs), [out.error for out in outs if len(out.token_ids) != 1][:3]
    return None, sum(map(len, prompts))


def transformers_batches(model, prompts: list[list[int]], batch_size: int,  # noqa: ANN001
                         by_length: bool = False) -> tuple[list[list[float]], int]:
    """Padded batches as sentence-transformers runs them (`by_length`: sorted longest first, as its `encode` does),
    the vectors back in input order; and the positions computed, pads included."""
    order = sorted(range(len(prompts)), key=lambda i: -len(prompts[i])) if by_length else list(range(len(prompts)))
    vectors: list[list[float] | None] = [None] * len(prompts)
    positions = 0
    with torch.inference_mode():
        for start in range(0, len(order), batch_size):
            chosen = order[start : start + batch_size]
            longest = max(len(prompts[i]) for i in chosen)
            ids = torch.tensor([prompts[i] + [PAD_ID] * (longest - len(prompts[i])) for i in chosen])
            mask = torch.tensor([[1] * len(prompts[i]) + [0] * (longest - len(prompts[i])) for i in chosen])
            hidden = model(input_ids=ids, attention_mask=mask).last_hidden_state
            last = F.normalize(hidden[torch.arange(len(chosen)), mask.sum(1) - 1], dim=-1)
            for i, vector in zip(chosen, last.tolist()):
                vectors[i] = vector
            positions += ids.numel()
    return vectors, positions  # type: ignore[return-value]


def min_cosine(a: list[list[float]], b: list[list[float]]) -> float:
    return float(F.cosine_similarity(torch.tensor(a), torch.tensor(b), dim=-1).min())


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompts", type=int, default=256)
    parser.add_argument("--min-len", type=int, default=16)
    parser.add_argument("--max-len", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4, help="decoder layers of Qwen2.5-0.5B's 24")
    parser.add_argument("--batch-size", type=int, default=32,
                        help="transformers' batch size (sentence-transformers' default)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--no-sorted", action="store_true", help="leave out (c'), the length-sorted batches")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="tiny model and workload, a smoke test")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args(argv)
    if args.quick:
        args.prompts, args.min_len, args.max_len, args.layers = 24, 4, 96, 2
        args.max_num_batched_tokens = 256
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    from transformers import AutoModel

    from tokenmill import LLM

    shape = QUICK if args.quick else QWEN25_05B
    prompts = make_prompts(args.prompts, args.min_len, args.max_len, shape["vocab_size"], args.seed)
    warmup = make_prompts(4, 8, 40, shape["vocab_size"], args.seed + 1)
    with tempfile.TemporaryDirectory(prefix="tokenmill-embeddings-") as workdir:
        model_dir = Path(workdir) / "model"
        build_model_dir(model_dir, shape, args.layers, args.seed)
        llm = LLM(str(model_dir), dtype="float32", model_impl="native", enable_prefix_caching=False,
                  max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=args.max_len + 8)
        hf = AutoModel.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa").eval()
        systems = {"embed": lambda: embed(llm, prompts), "prefill": lambda: prefill(llm, prompts),
                   "hf": lambda: transformers_batches(hf, prompts, args.batch_size)}
        if not args.no_sorted:
            systems["hf-sorted"] = lambda: transformers_batches(hf, prompts, args.batch_size, by_length=True)
        llm.embed(warmup), prefill(llm, warmup), transformers_batches(hf, warmup, args.batch_size)
        runs: dict[str, list[Run]] = {name: [] for name in systems}
        names = list(systems)
        for round_ in range(args.rounds):  # each round starts one system later: none always runs first
            for name in names[round_ % len(names):] + names[: round_ % len(names)]:
                runs[name].append(timed(systems[name]))
                print(f"  {LABELS[name]}: {runs[name][-1].wall:.2f} s", file=sys.stderr, flush=True)
    report(args, prompts, {name: min(done, key=lambda r: r.wall) for name, done in runs.items()})
    return 0


def report(args: argparse.Namespace, prompts: list[list[int]], best: dict[str, Run]) -> None:
    tokens = sum(map(len, prompts))
    rate = {name: tokens / run.wall for name, run in best.items()}
    print(f"machine: {cpu_model()}, {os.cpu_count()} cores, load {load_now()}; torch {torch.__version__}, "
          f"{args.threads} threads, Python {platform.python_version()}")
    print(f"model: Qwen2.5-0.5B shape{' (--quick: tiny)' if args.quick else ''}, {args.layers} layers, random weights, "
          f"float32; {len(prompts)} prompts of {args.min_len}-{args.max_len} tokens ({tokens} in all), "
          f"budget {args.max_num_batched_tokens}, best of {args.rounds} round(s)")
    print("| system | wall s | CPU s | positions computed | tokens/s |\n|---|---:|---:|---:|---:|")
    for name, run in best.items():
        print(f"| {LABELS[name]} | {run.wall:.2f} | {run.cpu:.1f} | {run.positions or tokens} | {rate[name]:,.0f} |")
    ratios = {"(a)/(b)": rate["embed"] / rate["prefill"], "(a)/(c)": rate["embed"] / rate["hf"]}
    if "hf-sorted" in rate:
        ratios["(a)/(c')"] = rate["embed"] / rate["hf-sorted"]
    goals = {"(a)/(b)": 0.9, "(a)/(c)": 2.0}
    print("; ".join(f"{k} = {v:.2f}x" + (f" (goal >= {goals[k]})" if k in goals else "") for k, v in ratios.items()))
    per_cpu = {k: best[b].cpu / best["embed"].cpu for k, b in (("(a)/(b)", "prefill"), ("(a)/(c)", "hf"),
                                                              ("(a)/(c')", "hf-sorted")) if b in best}
    print("per CPU second (steadier than wall time on a shared machine): "
          + "; ".join(f"{k} = {v:.2f}x" for k, v in per_cpu.items()))
    cosine = min_cosine(best["embed"].vectors, best["hf"].vectors)  # type: ignore[arg-type]
    print(f"lowest cosine between (a) and (c): {cosine:.6f}")
    if args.json:
        args.json.write_text(json.dumps({"tokens": tokens, "rates": rate, "ratios": ratios, "per_cpu": per_cpu,
                                         "min_cosine": cosine, "wall": {k: r.wall for k, r in best.items()},
                                         "cpu": {k: r.cpu for k, r in best.items()}}, indent=2))


if __name__ == "__main__":
    sys.exit(main())
