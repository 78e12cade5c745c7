#!/usr/bin/env python
"""Offline throughput: one workload, in one run, through three systems on the same weights.

  (a) transformers `generate` with static padded batches (left padding + attention mask; every batch runs
      until its longest request's max_new_tokens; each request keeps only its own first max_tokens tokens),
  (b) transformers' own continuous batching (`init_continuous_batching` manager, one `add_request` per
      request with its own `max_new_tokens`, results collected with `get_result`; SDPA attention, the
      fastest implementation it accepts on CPU),
  (c) tokenmill (`LLM.generate`).

Default workload (issue 2): a random-weight Llama (hidden 512, 8 layers, 8 heads, 4 KV heads, intermediate
1536, vocab 32000, float32) built once from a LlamaConfig with a fixed seed; (a) and (b) run that model
object, (c) loads the very same weights from a `save_pretrained` directory. 64 requests, prompt lengths
uniform in [16, 512] and output lengths uniform in [16, 128] from a fixed seed, greedy, EOS ignored. Every
system gets the same torch thread count and is warmed up on a tiny input before it is timed.

Every system must return exactly each request's max_tokens tokens (asserted). "Useful tokens/s" counts only
those tokens. The wasted-token fraction is measured, not assumed: a forward pre-hook on the model counts the
token positions each forward pass computes (`input_ids.numel()`, pad positions included); a request needs
prompt_len + max_tokens - 1 positions (its last token is sampled but never fed back), so
wasted = 1 - sum(needed) / sum(computed). Pad positions, positions past a request's own end and recomputation
after a preemption all count as waste.

    python benchmarks/throughput.py                 # the issue's workload, all three systems (~2.5 min)
    python benchmarks/throughput.py --quick         # small model and workload, a smoke test (seconds)
    python benchmarks/throughput.py --systems tokenmill --max-num-batched-tokens 2048

Timings on a shared machine are only as good as its quietest moment: the table prints each run's process
CPU time next to its wall time (about wall x threads when the run had the cores to itself), and
`--repeat N` runs the systems N times, interleaved, keeping each one's fastest run.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import random
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass, field

# Run as `python benchmarks/throughput.py`, Python puts benchmarks/ first on sys.path, where a sibling script
# may shadow a standard module (benchmarks/queue.py shadows `queue`, which torch imports). Drop that entry.
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]

import torch  # noqa: E402

sys.path.append(_HERE)  # after the standard library: sibling scripts importable, none shadowing a standard module
from gpu_throughput import collect_hf_cb  # noqa: E402

SYSTEMS = ("static", "hf-cb", "tokenmill-hf", "tokenmill")
LABELS = {"static": "(a) HF generate, static batches", "hf-cb": "(b) HF continuous batching",
          "tokenmill-hf": "(c') tokenmill on transformers' modules", "tokenmill": "(c) tokenmill"}

FULL = dict(hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4,
            intermediate_size=1536, vocab_size=32000, max_position_embeddings=2048)
QUICK = dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=256, vocab_size=1000, max_position_embeddings=512)
WARMUP = [([5, 6, 7], 3), ([8, 9], 4)]  # (prompt, max_tokens) run through each system before its timed run


# -- workload ---------------------------------------------------------------------------------------------
@dataclass
class Workload:
    prompts: list[list[int]]
    max_tokens: list[int]

    @property
    def useful_tokens(self) -> int:
        return sum(self.max_tokens)

    @property
    def needed_positions(self) -> int:
        """Token positions a pad-free, recompute-free engine must run through the model."""
        return sum(len(p) + n - 1 for p, n in zip(self.prompts, self.max_tokens))


def make_workload(count: int, prompt_range: tuple[int, int], output_range: tuple[int, int], vocab: int,
                  seed: int) -> Workload:
    rng = random.Random(seed)
    prompts, max_tokens = [], []
    for _ in range(count):
        length = rng.randint(*prompt_range)
        prompts.append([rng.randrange(3, vocab) for _ in range(length)])  # skip ids 0-2 (pad/bos/eos)
        max_tokens.append(rng.randint(*output_range))
    return Workload(prompts, max_tokens)


# -- measurement helpers ----------------------------------------------------------------------------------
class ForwardCounter:
    """Counts forward passes and the token positions they compute (pads included)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.forwards = 0
        self.positions = 0
        self.handle = model.register_forward_pre_hook(self._hook, with_kwargs=True)

    def _hook(self, module, args, kwargs):  # noqa: ANN001, ANN202
        ids = kwargs.get("input_ids")
        if ids is None and args:
            ids = args[0]
        self.forwards += 1
        self.positions += ids.numel()

    def remove(self) -> None:
        self.handle.remove()


@dataclass
class Result:
    system: str
    wall: float
    cpu: float  # process CPU seconds over the timed region, all threads: ~wall x threads when it owns the cores
    outputs: list[list[int]]
    forwards: int
    positions: int
    extra: dict = field(default_factory=dict)


class Timer:
    def __enter__(self) -> Timer:
        gc.collect()
        self.wall, self.cpu = time.perf_counter(), time.process_time()
        return self

    def __exit__(self, *exc: object) -> None:
        self.wall, self.cpu = time.perf_counter() - self.wall, time.process_time() - self.cpu


def check_lengths(name: str, outputs: list[list[int]], workload: Workload) -> None:
    bad = [(i, None if o is None else len(o), n)
           for i, (o, n) in enumerate(zip(outputs, workload.max_tokens)) if o is None or len(o) != n]
    assert not bad, f"{name}: requests with the wrong number of tokens (index, got, wanted): {bad[:5]}"


def load_now() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "n/a"


# -- (a) transformers generate, static padded batches -----------------------------------------------------
def run_static(model, workload: Workload, batch_size: int, pad_id: int) -> Result:  # noqa: ANN001
    from transformers import GenerationConfig

    def generate(prompts: list[list[int]], new_tokens: int) -> torch.Tensor:
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for row, prompt in enumerate(prompts):  # left padding
            ids[row, width - len(prompt):] = torch.tensor(prompt)
            mask[row, width - len(prompt):] = 1
        # No EOS, and min_new_tokens in case a default EOS creeps back in: every row runs all new_tokens steps.
        config = GenerationConfig(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                                  eos_token_id=None, pad_token_id=pad_id, use_cache=True)
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=mask, generation_config=config)
        assert out.shape[1] == width + new_tokens, f"generate gave {out.shape[1] - width} tokens, not {new_tokens}"
        return out[:, width:]

    generate([p for p, _ in WARMUP], max(n for _, n in WARMUP))
    batches = [list(range(first, min(first + batch_size, len(workload.prompts))))
               for first in range(0, len(workload.prompts), batch_size)]
    outputs: list[list[int] | None] = [None] * len(workload.prompts)
    counter = ForwardCounter(model)
    with Timer() as timer:
        for index in batches:
            new = generate([workload.prompts[i] for i in index], max(workload.max_tokens[i] for i in index))
            for row, i in enumerate(index):
                outputs[i] = new[row, : workload.max_tokens[i]].tolist()
    counter.remove()
    # Where the waste is, from the batch shapes: left-pad positions, and positions after a request's own end.
    # The request with the longest prompt of each batch carries no padding (used for the parity check).
    pad = sum(max(len(workload.prompts[i]) for i in b) - len(workload.prompts[i]) for b in batches for i in b)
    past_end = sum(max(workload.max_tokens[i] for i in b) - workload.max_tokens[i] for b in batches for i in b)
    assert counter.positions == workload.needed_positions + pad + past_end, (counter.positions, pad, past_end)
    unpadded = [max(b, key=lambda i: len(workload.prompts[i])) for b in batches]
    return Result("static", timer.wall, timer.cpu, outputs, counter.forwards, counter.positions,
                  {"unpadded": unpadded, "pad": pad, "past_end": past_end})


# -- (b) transformers continuous batching -----------------------------------------------------------------
def run_hf_cb(model, workload: Workload, args: argparse.Namespace) -> Result:  # noqa: ANN001
    from transformers import ContinuousBatchingConfig, GenerationConfig

    page = args.hf_page_size
    tokens = sum(len(p) + n for p, n in zip(workload.prompts, workload.max_tokens))
    # Enough cache for the whole workload at once (as for tokenmill): no request ever waits for memory.
    num_blocks = -(-tokens // page) + len(workload.prompts)
    cb_config = ContinuousBatchingConfig(
        page_size=page, num_blocks=num_blocks, max_batch_tokens=args.hf_max_batch_tokens,
        max_requests_per_batch=min(len(workload.prompts), args.max_num_seqs),
        use_cuda_graph=False, use_async_batching=False, allow_block_sharing=False, auto_switch_to_flash=False,
    )
    # eos_token_id=-1 is the manager's own "no EOS" value.
    gen_config = GenerationConfig(do_sample=False, eos_token_id=-1, pad_token_id=0,
                                  max_new_tokens=max(workload.max_tokens))
    model.set_attn_implementation(args.hf_cb_attn)
    with torch.inference_mode():
        manager = model.init_continuous_batching(generation_config=gen_config, continuous_batching_config=cb_config)
        manager.start()
        try:
            for i, (prompt, n) in enumerate(WARMUP):
                manager.add_request(prompt, request_id=f"warmup{i}", max_new_tokens=n)
            collect_hf_cb(manager, len(WARMUP))
            counter = ForwardCounter(model)
            with Timer() as timer:
                for i, (prompt, n) in enumerate(zip(workload.prompts, workload.max_tokens)):
                    manager.add_request(prompt, request_id=f"r{i}", max_new_tokens=n)
                done = collect_hf_cb(manager, len(workload.prompts))
            counter.remove()
        finally:
            manager.stop(block=True)  # also restores the model's attention implementation
    outputs = [done[f"r{i}"] for i in range(len(workload.prompts))]
    resolved = manager.continuous_batching_config
    return Result("hf-cb", timer.wall, timer.cpu, outputs, counter.forwards, counter.positions,
                  {"attn": args.hf_cb_attn, "max_batch_tokens": resolved.max_batch_tokens, "page_size": page})


# -- (c) tokenmill ----------------------------------------------------------------------------------------
def save_model_dir(model, path: str, vocab_size: int) -> None:  # noqa: ANN001
    """The model as `save_pretrained` writes it, plus a word-level tokenizer covering the whole vocabulary
    (tokenmill loads a tokenizer with every model; prompts here are token ids, so it only decodes outputs)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    model.save_pretrained(path)
    vocab = {f"<t{i}>": i for i in range(vocab_size)}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<t0>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.decoder = decoders.Fuse()
    PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<t0>", bos_token="<t1>",
                            eos_token="<t2>").save_pretrained(path)


def run_tokenmill(model_dir: str, workload: Workload, args: argparse.Namespace, impl: str = "auto") -> Result:
    """`impl`: the engine's `model_impl` ("transformers": tokenmill running transformers' modeling code, (c'))."""
    from tokenmill import LLM, SamplingParams

    block = 16
    blocks = sum(-(-(len(p) + n) // block) for p, n in zip(workload.prompts, workload.max_tokens))
    llm = LLM(model_dir, dtype="float32", device="cpu", load_format="auto",
              max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
              num_kv_blocks=args.num_kv_blocks or blocks + 8, block_size=block, model_impl=impl)
    warm = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for _, n in WARMUP]
    llm.generate([p for p, _ in WARMUP], warm, use_tqdm=False)
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in workload.max_tokens]
    counter = ForwardCounter(llm.engine.runner.model)
    before = llm.engine.stats()
    with Timer() as timer:
        outs = llm.generate(workload.prompts, params, use_tqdm=False)
    after = llm.engine.stats()
    counter.remove()
    assert all(o.finish_reason == "length" for o in outs), {o.finish_reason for o in outs}
    extra = {
        "steps": after.num_steps - before.num_steps,
        "preemptions": after.num_preemptions - before.num_preemptions,
        "prefix_hit_tokens": after.num_prefix_hit_tokens - before.num_prefix_hit_tokens,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "max_num_seqs": args.max_num_seqs,
        "kv_blocks": llm.engine.runner.num_blocks,
    }
    return Result("tokenmill" if impl == "auto" else "tokenmill-hf", timer.wall, timer.cpu, [o.token_ids for o in outs],
                  counter.forwards,
                  counter.positions, extra)


# -- report -----------------------------------------------------------------------------------------------
def agreement(a: list[list[int]], b: list[list[int]], subset: list[int] | None = None) -> tuple[int, int, float]:
    """(identical outputs, requests compared, mean share of each output that matches before the first difference)."""
    index = subset if subset is not None else list(range(len(a)))
    exact, prefix = 0, 0.0
    for i in index:
        x, y = a[i], b[i]
        common = next((k for k, (p, q) in enumerate(zip(x, y)) if p != q), min(len(x), len(y)))
        exact += x == y
        prefix += common / max(len(x), 1)
    return exact, len(index), prefix / max(len(index), 1)


def seconds(x: float) -> str:
    return f"{x:.1f}" if x >= 1 else f"{x:.3f}"


def report(results: dict[str, Result], walls: dict[str, list[float]], workload: Workload,
           args: argparse.Namespace, header: dict) -> str:
    useful, needed = workload.useful_tokens, workload.needed_positions
    rate = {name: useful / r.wall for name, r in results.items()}
    lines = [
        f"workload: {len(workload.prompts)} requests, {sum(map(len, workload.prompts))} prompt tokens, "
        f"{useful} useful generated tokens, {needed} positions a pad-free engine computes",
        f"model: {header['model']}; torch threads {torch.get_num_threads()}; "
        f"load average (1/5/15 min) before {header['load_before']}, after {load_now()}",
        "",
        "| system | wall s | cpu s | useful tok/s | vs (a) | vs (b) | wasted-token fraction | forwards | notes |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for name in SYSTEMS:
        if name not in results:
            continue
        r, e = results[name], results[name].extra
        vs_a = f"{rate[name] / rate['static']:.2f}x" if "static" in rate else "-"
        vs_b = f"{rate[name] / rate['hf-cb']:.2f}x" if "hf-cb" in rate else "-"
        if name == "static":
            notes = (f"batch size {args.batch_size}; left pad {e['pad'] / r.positions:.1%} + "
                     f"past own end {e['past_end'] / r.positions:.1%} of positions")
        elif name == "hf-cb":
            notes = f"attn {e['attn']}, max_batch_tokens {e['max_batch_tokens']}, page {e['page_size']}"
        else:
            notes = (f"steps {e['steps']}, preemptions {e['preemptions']}, max_num_batched_tokens "
                     f"{e['max_num_batched_tokens']}, max_num_seqs {e['max_num_seqs']}")
        if len(walls[name]) > 1:
            notes += "; walls " + " ".join(seconds(w) for w in walls[name])
        lines.append(f"| {LABELS[name]} | {seconds(r.wall)} | {seconds(r.cpu)} | {rate[name]:.1f} | {vs_a} | {vs_b} "
                     f"| {1 - needed / r.positions:.1%} | {r.forwards} | {notes} |")
    lines.append("")
    if args.repeat > 1:
        lines.append(f"Each system ran {args.repeat} times, interleaved; the table shows each one's fastest run.")
    lines += [
        "cpu s: process CPU time over the timed region; about wall x threads when the run had the cores to itself.",
        "wasted-token fraction: 1 - sum(prompt_len + max_tokens - 1) / (token positions counted by a forward "
        "pre-hook on the model); pad positions, positions past a request's own end and recomputation count as waste.",
    ]
    if "tokenmill" in results:
        lines.append(f"tokenmill prefix-cache hit tokens: {results['tokenmill'].extra['prefix_hit_tokens']} "
                     "(random prompts share no prefix)")
    for x, y in [("static", "tokenmill"), ("hf-cb", "tokenmill"), ("static", "hf-cb"), ("tokenmill-hf", "tokenmill")]:
        if x in results and y in results:
            exact, count, share = agreement(results[x].outputs, results[y].outputs)
            line = f"greedy agreement {x} vs {y}: {exact}/{count} identical, mean matching prefix {share:.1%}"
            if x == "static":
                e2, c2, s2 = agreement(results[x].outputs, results[y].outputs, results[x].extra["unpadded"])
                line += f"; on the {c2} requests that had no padding: {e2}/{c2} identical, prefix {s2:.1%}"
            lines.append(line)
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=None, help="number of requests (default 64; 12 with --quick)")
    p.add_argument("--batch-size", type=int, default=None,
                   help="static batch size for (a) (default 16; 4 with --quick)")
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="tokenmill token budget per step (default 1024, its fastest of 512-4096 here; "
                        "256 with --quick)")
    p.add_argument("--max-num-seqs", type=int, default=256,
                   help="tokenmill max_num_seqs and hf-cb max_requests_per_batch (default 256)")
    p.add_argument("--num-kv-blocks", type=int, default=None,
                   help="tokenmill KV blocks of 16 tokens (default: enough for the whole workload at once)")
    p.add_argument("--hf-max-batch-tokens", type=int, default=None,
                   help="hf-cb max_batch_tokens (default 512, its fastest of 512-4096 here; 256 with --quick)")
    p.add_argument("--hf-page-size", type=int, default=256, help="hf-cb page size (its default, 256)")
    p.add_argument("--hf-cb-attn", default="sdpa",
                   help="hf-cb attention implementation: sdpa (default) or paged|eager, the two it accepts on CPU")
    p.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma-separated subset of {','.join(SYSTEMS)}")
    p.add_argument("--quick", action="store_true", help="small model and workload, for a smoke test")
    p.add_argument("--repeat", type=int, default=1,
                   help="run the systems this many times, interleaved, and report each one's fastest run")
    p.add_argument("--seed", type=int, default=0, help="seed of the weights and of the workload")
    p.add_argument("--threads", type=int, default=2, help="torch.set_num_threads, the same for every system")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    args = p.parse_args(argv)
    args.requests = args.requests or (12 if args.quick else 64)
    args.batch_size = args.batch_size or (4 if args.quick else 16)
    args.max_num_batched_tokens = args.max_num_batched_tokens or (256 if args.quick else 1024)
    args.hf_max_batch_tokens = args.hf_max_batch_tokens or (256 if args.quick else 512)
    args.systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = set(args.systems) - set(SYSTEMS)
    if unknown:
        p.error(f"--systems: unknown {sorted(unknown)}; choose from {', '.join(SYSTEMS)}")
    if args.repeat < 1:
        p.error("--repeat: must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    logging.getLogger("ContinuousBatchingLogger").setLevel(logging.CRITICAL)  # "install psutil" noise on CPU
    shape = QUICK if args.quick else FULL
    prompt_range, output_range = ((4, 64), (4, 16)) if args.quick else ((16, 512), (16, 128))
    workload = make_workload(args.requests, prompt_range, output_range, shape["vocab_size"], args.seed)
    config = LlamaConfig(**shape, bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)
    torch.manual_seed(args.seed)
    model = LlamaForCausalLM(config).to(torch.float32).eval()
    model.set_attn_implementation("sdpa")
    header = {"model": ", ".join(f"{k}={v}" for k, v in shape.items())
              + f", float32, random weights (seed {args.seed})", "load_before": load_now()}
    results: dict[str, Result] = {}
    walls: dict[str, list[float]] = {name: [] for name in args.systems}
    with tempfile.TemporaryDirectory(prefix="tokenmill-bench-") as model_dir:
        if {"tokenmill", "tokenmill-hf"} & set(args.systems):
            save_model_dir(model, model_dir, shape["vocab_size"])
        for repeat in range(args.repeat):  # interleaved, so that a burst of load hits one round, not one system
            for name in SYSTEMS:
                if name not in args.systems:
                    continue
                print(f"[{repeat + 1}/{args.repeat}] {LABELS[name]} (load {load_now()}) ...", file=sys.stderr,
                      flush=True)
                if name == "static":
                    result = run_static(model, workload, args.batch_size, pad_id=0)
                elif name == "hf-cb":
                    result = run_hf_cb(model, workload, args)
                else:
                    result = run_tokenmill(model_dir, workload, args, "transformers" if name == "tokenmill-hf" else "auto")
                check_lengths(name, result.outputs, workload)
                print(f"  {seconds(result.wall)} s wall, {seconds(result.cpu)} s cpu, "
                      f"{workload.useful_tokens / result.wall:.1f} useful tok/s", file=sys.stderr, flush=True)
                walls[name].append(result.wall)
                if name not in results or result.wall < results[name].wall:
                    results[name] = result
    print(report(results, walls, workload, args, header))
    if args.json:
        summary = {name: {"wall": r.wall, "cpu": r.cpu, "walls": walls[name], "forwards": r.forwards,
                          "useful_tok_s": workload.useful_tokens / r.wall, "positions": r.positions,
                          "wasted_fraction": 1 - workload.needed_positions / r.positions,
                          **{k: v for k, v in r.extra.items() if k != "unpadded"}}
                   for name, r in results.items()}
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
