#!/usr/bin/env python
"""GPU throughput: tokenmill vs transformers `generate` (static batches) vs transformers continuous batching.

Random-weight models shaped like Qwen2.5-0.5B and Llama-3-8B (bf16), 1,000 requests of 512 random prompt
tokens and 256 output tokens each (greedy, EOS ignored), in one run:

  tokenmill   `LLM(..., load_format="dummy")`, KV pool from the memory profile (`gpu_memory_utilization`);
              its step time is split into schedule / host prep / model launch / sampler launch / wait for
              the device (host clocks around the real engine methods), plus GPU kernel time over a few
              decode steps from torch.profiler; the native model where one covers the shape;
  tokenmill-hf  the same engine on transformers' modeling code (`model_impl="transformers"`): before/after;
  tokenmill-graphs  the same engine with decode steps replayed as CUDA graphs (`enforce_eager=False`; on CPU the
              padded decode path is not attached and this is the eager engine again);
  tokenmill-async  with CUDA graphs, and each step planned and launched before the last one's tokens are read back
              (`async_scheduling=True`): the host's work beside the device's;
  static      the same model object, `model.generate` over static batches (SDPA, no padding: equal prompts);
  hf-cb       the same model object, transformers continuous batching (the manager `generate_batch` runs,
              built once and warmed up outside the timed region, with its own defaults: CUDA graphs and
              async batching left on where that version has them).

Output tokens/s, peak memory, and greedy agreement with tokenmill (bf16 kernels differ, so agreement is a
sanity check, not parity: parity is tested in float32 on CPU). Rows are printed as each system finishes and
written to `--json` (default `$OUT/gpu_throughput.json` when $OUT is set), so a run cut short keeps what it
measured. Written to fit in 9 minutes on one H200 with that machine's own torch/transformers/triton; it
never installs anything and adapts to the transformers version it finds (generate_batch's signature).

    python benchmarks/gpu_throughput.py                       # both models, all systems (CUDA)
    python benchmarks/gpu_throughput.py --quick               # tiny models and workload, runs on CPU too
    python benchmarks/gpu_throughput.py --models qwen2.5-0.5b --systems tokenmill,hf-cb --requests 200
"""

from __future__ import annotations

import argparse
import gc
import inspect
import json
import os
import random
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass, field

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]

import torch  # noqa: E402

SHAPES = {
    "qwen2.5-0.5b": dict(model_type="qwen2", hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                         num_attention_heads=14, num_key_value_heads=2, vocab_size=151936,
                         max_position_embeddings=32768, rope_theta=1000000.0, tie_word_embeddings=True,
                         use_sliding_window=False, rms_norm_eps=1e-6),
    "llama-3-8b": dict(model_type="llama", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                       num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                       max_position_embeddings=8192, rope_theta=500000.0, tie_word_embeddings=False,
                       rms_norm_eps=1e-5),
}
QUICK_SHAPES = {
    "qwen2.5-0.5b": dict(SHAPES["qwen2.5-0.5b"], hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, vocab_size=512,
                         max_position_embeddings=1024),
    "llama-3-8b": dict(SHAPES["llama-3-8b"], hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, vocab_size=512, max_position_embeddings=1024),
}
SYSTEMS = ("tokenmill", "tokenmill-graphs", "tokenmill-async", "tokenmill-hf", "static", "hf-cb")


@dataclass
class Row:
    model: str
    system: str
    requests: int = 0
    output_tokens: int = 0
    wall_s: float = 0.0
    tokens_per_s: float = 0.0
    peak_allocated_gib: float = 0.0
    device_used_gib: float = 0.0  # total - free at the end, all processes and allocators
    agreement: str = ""
    detail: dict = field(default_factory=dict)
    error: str | None = None


# -- helpers ----------------------------------------------------------------------------------------------
def on_cuda() -> bool:
    return torch.cuda.is_available()


def sync() -> None:
    if on_cuda():
        torch.cuda.synchronize()


def reset_memory() -> None:
    gc.collect()
    if on_cuda():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def memory(row: Row) -> None:
    if on_cuda():
        row.peak_allocated_gib = torch.cuda.max_memory_allocated() / 2**30
        free, total = torch.cuda.mem_get_info()
        row.device_used_gib = (total - free) / 2**30


def write_model_dir(path: str, shape: dict) -> None:
    """config.json and a word-level tokenizer over the whole vocabulary (prompts are token ids; tokenmill
    loads a tokenizer with every model and only decodes with it)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import AutoConfig, PreTrainedTokenizerFast

    values = {k: v for k, v in shape.items() if k != "model_type"}
    AutoConfig.for_model(shape["model_type"], bos_token_id=1, eos_token_id=2, pad_token_id=0,
                         **values).save_pretrained(path)
    vocab = {f"<t{i}>": i for i in range(shape["vocab_size"])}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<t0>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.decoder = decoders.Fuse()
    PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<t0>", bos_token="<t1>",
                            eos_token="<t2>").save_pretrained(path)


def agreement(reference: list[list[int]] | None, outputs: list[list[int]]) -> str:
    """Identical outputs / compared, and the mean share of each output equal before the first difference."""
    if reference is None:
        return ""
    exact, prefix = 0, 0.0
    for a, b in zip(reference, outputs):
        common = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        exact += a == b
        prefix += common / max(len(a), 1)
    n = min(len(reference), len(outputs))
    return f"{exact}/{n} identical, {100 * prefix / max(n, 1):.1f}% common prefix"


# -- tokenmill with a step-time split ---------------------------------------------------------------------
class StepClock:
    """Host seconds spent in each engine phase, by wrapping the real engine's methods on the instance."""

    PHASES = ("schedule", "host_prep", "model", "sampler", "wait")

    def __init__(self, engine) -> None:  # noqa: ANN001
        import tokenmill.engine.sampler as sampler_module
        import tokenmill.engine.transfer as transfer

        self.seconds = dict.fromkeys(self.PHASES, 0.0)
        runner = engine.runner
        engine.scheduler.schedule = self._timed("schedule", engine.scheduler.schedule)
        runner.inputs.build = self._timed("host_prep", runner.inputs.build)
        runner.forward = self._timed("model", runner.forward)
        if runner.decode is not None:  # a decode step on CUDA graphs: its inputs written, then the graph replayed
            runner.decode.forward = self._timed("model", runner.decode.forward)
            runner.decode._write = self._timed("host_prep", runner.decode._write, inside="model")
        self._module, self._read_back = sampler_module, sampler_module.read_back
        self._pending_wait = transfer.PendingRead.wait
        if engine.config.async_scheduling:  # a step's tokens are read back during the next one (`_land`)
            runner.sampler.launch = self._timed("sampler", runner.sampler.launch)
            transfer.PendingRead.wait = self._timed("wait", transfer.PendingRead.wait)
        else:
            runner.sampler = self._timed("sampler", runner.sampler)
        sampler_module.read_back = self._timed("wait", sampler_module.read_back, inside="sampler")

    def _timed(self, phase: str, function, inside: str | None = None):  # noqa: ANN001, ANN202
        def run(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            start = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                spent = time.perf_counter() - start
                self.seconds[phase] += spent
                if inside:
                    self.seconds[inside] -= spent
        return run

    def restore(self) -> None:
        import tokenmill.engine.transfer as transfer

        self._module.read_back = self._read_back
        transfer.PendingRead.wait = self._pending_wait


def gpu_busy(engine, steps: int = 5) -> float | None:  # noqa: ANN001
    """GPU kernel time / wall time over `steps` engine steps under torch.profiler (a lower bound: the
    profiler slows the host)."""
    if not on_cuda() or not engine.has_unfinished():
        return None
    try:
        return _gpu_busy(engine, steps)
    except Exception as error:  # noqa: BLE001  (profiler APIs differ across torch versions)
        print(f"gpu_busy: {error!r}", flush=True)
        return None


def _gpu_busy(engine, steps: int) -> float:  # noqa: ANN001
    from torch.profiler import ProfilerActivity, profile

    sync()
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            engine.step()
        sync()
        wall = time.perf_counter() - start
    kernel_us = sum(e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
                    for e in prof.key_averages() if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA)
    return kernel_us / 1e6 / wall


def run_tokenmill(name: str, model_dir: str, prompts: list[list[int]], max_tokens: int,
                  args: argparse.Namespace, impl: str = "auto", graphs: bool = False, overlap: bool = False
                  ) -> tuple[Row, list[list[int]], object]:
    from tokenmill import LLM, SamplingParams

    reset_memory()
    dtype = "bfloat16" if on_cuda() else "float32"
    llm = LLM(model_dir, dtype=dtype, load_format="dummy", max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens, gpu_memory_utilization=args.gpu_memory_utilization,
              max_model_len=len(prompts[0]) + max_tokens + 16, seed=args.seed, model_impl=impl,
              enforce_eager=not graphs, async_scheduling=overlap, **({} if on_cuda() else {"num_kv_blocks": 4096}))
    engine = llm.engine
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    llm.generate([[5, 6, 7]] * 4, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True), use_tqdm=False)
    clock = StepClock(engine)
    outputs: dict[str, list[int]] = {}
    steps_before = engine.stats().num_steps
    busy = None
    sync()
    start = time.perf_counter()
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
    while engine.has_unfinished():
        for out in engine.step():
            outputs[out.request_id] = out.token_ids
        if busy is None and len(outputs) == 0 and engine.stats().num_steps - steps_before == args.profile_after:
            busy = gpu_busy(engine)  # mid-run, decode-heavy: the first wave of requests is decoding
    sync()
    wall = time.perf_counter() - start
    clock.restore()
    steps = engine.stats().num_steps - steps_before
    ordered = [outputs[str(i)] for i in range(len(prompts))]
    system = ("tokenmill-async" if overlap else "tokenmill-graphs" if graphs else "tokenmill" if impl == "auto"
              else "tokenmill-hf")
    row = Row(name, system, len(prompts), sum(map(len, ordered)), wall)
    row.tokens_per_s = row.output_tokens / wall
    memory(row)
    row.detail = {
        "steps": steps,
        "kv_blocks": engine.runner.num_blocks,
        "ms_per_step": 1e3 * wall / max(steps, 1),
        "host_ms_per_step": {k: round(1e3 * v / max(steps, 1), 3) for k, v in clock.seconds.items()},
        "gpu_busy_fraction_5_profiled_steps": busy,
        "attention_backend": engine.runner.backend.name,
        "cuda_graphs": sorted(engine.runner.decode.graphs) if engine.runner.decode is not None else None,
    }
    return row, ordered, llm


# -- transformers baselines -----------------------------------------------------------------------------
def baseline_model(model_dir: str, seed: int):  # noqa: ANN201
    """The model tokenmill's dummy load would build (same config, seed, dtype, device), for when it failed."""
    from transformers import AutoConfig, AutoModelForCausalLM

    device = torch.device("cuda" if on_cuda() else "cpu")
    with torch.device(device), torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir), attn_implementation="sdpa",
                                                dtype=torch.bfloat16 if on_cuda() else torch.float32).eval()


def run_static(name: str, model, prompts: list[list[int]], max_tokens: int,  # noqa: ANN001
               args: argparse.Namespace, reference: list[list[int]] | None) -> Row:
    from transformers import GenerationConfig

    reset_memory()
    model.set_attn_implementation("sdpa")
    device = next(model.parameters()).device
    config = GenerationConfig(max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False,
                              eos_token_id=None, pad_token_id=0, use_cache=True)
    outputs: list[list[int]] = []
    sync()
    start = time.perf_counter()
    with torch.inference_mode():
        for first in range(0, len(prompts), args.static_batch):
            ids = torch.tensor(prompts[first : first + args.static_batch], device=device)
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=config)
            outputs += out[:, ids.shape[1]:].tolist()
    sync()
    row = Row(name, "static", len(outputs), sum(map(len, outputs)), time.perf_counter() - start)
    row.tokens_per_s = row.output_tokens / row.wall_s
    row.agreement = agreement(reference, outputs)
    row.detail = {"batch_size": args.static_batch, "attention": "sdpa"}
    memory(row)
    return row


def run_hf_cb(name: str, model, prompts: list[list[int]], max_tokens: int,  # noqa: ANN001
              args: argparse.Namespace, reference: list[list[int]] | None) -> Row:
    """transformers' continuous batching manager, the engine behind `generate_batch`, with its defaults
    (CUDA graphs, async batching where that version has them). The manager is built and warmed up once,
    outside the timed region, as tokenmill's engine is; then every request is added and collected."""
    import transformers
    from transformers import GenerationConfig

    reset_memory()
    model.set_attn_implementation("sdpa")
    config = GenerationConfig(max_new_tokens=max_tokens, do_sample=False, eos_token_id=-1, pad_token_id=0)
    options = {}
    if "workload_hints" in inspect.signature(model.init_continuous_batching).parameters:
        from transformers.generation.continuous_batching.utils import WorkloadHints

        options["workload_hints"] = WorkloadHints(max_prompt_length=len(prompts[0]), max_generated_length=max_tokens,
                                                  num_requests=len(prompts))
    setup = time.perf_counter()
    with torch.inference_mode():
        manager = model.init_continuous_batching(generation_config=config, **options)
        manager.start()
        try:
            manager.add_request(prompts[0][:8], request_id="warmup", max_new_tokens=4)
            collect_hf_cb(manager, 1)
            setup = time.perf_counter() - setup
            sync()
            start = time.perf_counter()
            for i, prompt in enumerate(prompts):
                manager.add_request(prompt, request_id=f"r{i}", max_new_tokens=max_tokens)
            done = collect_hf_cb(manager, len(prompts))
            sync()
            wall = time.perf_counter() - start
        finally:
            manager.stop(block=True)
    outputs = [done[f"r{i}"] for i in range(len(prompts))]
    row = Row(name, "hf-cb", len(outputs), sum(map(len, outputs)), wall)
    row.tokens_per_s = row.output_tokens / wall
    row.agreement = agreement(reference, outputs)
    config_used = getattr(manager, "continuous_batching_config", None)
    row.detail = {"transformers": transformers.__version__, "setup_and_warmup_s": round(setup, 2),
                  "config": {k: getattr(config_used, k, None) for k in
                             ("use_cuda_graph", "use_async_batching", "max_batch_tokens", "num_blocks", "page_size")}}
    memory(row)
    return row


def collect_hf_cb(manager, count: int) -> dict[str, list[int]]:  # noqa: ANN001
    """Generated tokens by request id of `count` requests finished by transformers' continuous-batching
    manager (also used by throughput.py); tolerant of the result API of other transformers versions."""
    done: dict[str, list[int]] = {}
    while len(done) < count:
        result = manager.get_result(timeout=1)
        if result is None:
            if not manager.is_running():
                raise RuntimeError("transformers' continuous batching thread stopped")
            continue
        if getattr(result, "error", None):
            raise RuntimeError(f"hf-cb request {result.request_id}: {result.error}")
        finished = result.is_finished() if hasattr(result, "is_finished") else str(result.status).endswith("FINISHED")
        if finished:
            done[result.request_id] = list(result.generated_tokens)
    return done


# -- main -------------------------------------------------------------------------------------------------
def emit(row: Row, rows: list[Row], path: str | None) -> None:
    rows.append(row)
    status = f"ERROR {row.error}" if row.error else (
        f"{row.tokens_per_s:10.1f} tok/s  {row.wall_s:7.1f} s  {row.output_tokens} tokens  "
        f"peak {row.peak_allocated_gib:.1f} GiB  used {row.device_used_gib:.1f} GiB  {row.agreement}")
    print(f"[{row.model:>13}] {row.system:>9}: {status}", flush=True)
    if row.detail:
        print(f"{'':>27}{json.dumps(row.detail)}", flush=True)
    if path:
        with open(path, "w") as f:
            json.dump([asdict(r) for r in rows], f, indent=1)


def table(rows: list[Row]) -> str:
    lines = ["| model | system | requests | output tok/s | vs static | vs hf-cb | wall s | peak GiB | greedy agreement |",
             "|---|---|---:|---:|---:|---:|---:|---:|---|"]
    for row in rows:
        if row.error:
            lines.append(f"| {row.model} | {row.system} | | error: {row.error[:60]} | | | | | |")
            continue
        base = {r.system: r.tokens_per_s for r in rows if r.model == row.model and not r.error}
        ratio = lambda s: f"{row.tokens_per_s / base[s]:.2f}x" if base.get(s) else ""  # noqa: E731
        lines.append(f"| {row.model} | {row.system} | {row.requests} | {row.tokens_per_s:.0f} | {ratio('static')} | "
                     f"{ratio('hf-cb')} | {row.wall_s:.1f} | {row.peak_allocated_gib:.1f} | {row.agreement} |")
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="tiny models, 8 requests of 32+8 tokens (CPU is fine)")
    p.add_argument("--models", default=",".join(SHAPES))
    p.add_argument("--systems", default=",".join(SYSTEMS))
    p.add_argument("--requests", type=int, default=None, help="default 1000 (8 with --quick)")
    p.add_argument("--prompt-tokens", type=int, default=None, help="default 512 (32 with --quick)")
    p.add_argument("--output-tokens", type=int, default=None, help="default 256 (8 with --quick)")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.5,
                   help="tokenmill's KV pool share (its KV cache is freed before the baselines run)")
    p.add_argument("--static-batch", type=int, default=256)
    p.add_argument("--profile-after", type=int, default=40, help="tokenmill step after which 5 steps are profiled")
    p.add_argument("--deadline", type=float, default=520.0, help="seconds; systems not started by then are skipped")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    args.requests = args.requests or (8 if args.quick else 1000)
    args.prompt_tokens = args.prompt_tokens or (32 if args.quick else 512)
    args.output_tokens = args.output_tokens or (8 if args.quick else 256)
    if args.json is None and os.environ.get("OUT"):
        args.json = os.path.join(os.environ["OUT"], "gpu_throughput.json")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    began = time.perf_counter()
    import transformers

    device = torch.cuda.get_device_name() if on_cuda() else "cpu"
    print(f"gpu_throughput: {device}, torch {torch.__version__}, transformers {transformers.__version__}, "
          f"{args.requests} requests x ({args.prompt_tokens} prompt + {args.output_tokens} output) tokens", flush=True)
    shapes = QUICK_SHAPES if args.quick else SHAPES
    systems = args.systems.split(",")
    rows: list[Row] = []
    for name in args.models.split(","):
        shape = shapes[name]
        rng = random.Random(args.seed)
        prompts = [[rng.randrange(3, shape["vocab_size"]) for _ in range(args.prompt_tokens)]
                   for _ in range(args.requests)]
        reference, llm = None, None
        with tempfile.TemporaryDirectory() as model_dir:
            write_model_dir(model_dir, shape)
            for impl, system in (("auto", "tokenmill"), ("auto", "tokenmill-graphs"), ("auto", "tokenmill-async"),
                                 ("transformers", "tokenmill-hf")):
                if system not in systems and (system != "tokenmill" or reference is not None):
                    continue  # tokenmill always runs: its tokens are the baselines' reference
                try:  # tokenmill on transformers' modules builds the model the baselines reuse (dummy weights)
                    llm = None
                    reset_memory()
                    row, tokens, llm = run_tokenmill(name, model_dir, prompts, args.output_tokens, args, impl,
                                                     graphs=system in ("tokenmill-graphs", "tokenmill-async"),
                                                     overlap=system == "tokenmill-async")
                    if reference is not None:
                        row.agreement = agreement(reference, tokens)
                    reference = reference or tokens
                    if system in systems:
                        emit(row, rows, args.json)
                except Exception as error:  # noqa: BLE001
                    traceback.print_exc()
                    emit(Row(name, system, error=repr(error)), rows, args.json)
            runner = getattr(llm, "engine", None) and llm.engine.runner
            model = runner.model if runner is not None and not runner.native else baseline_model(model_dir, args.seed)
        if runner is not None:
            runner.kv_caches = []  # give the baselines tokenmill's KV memory
        for system in [s for s in systems if not s.startswith("tokenmill")]:
            if time.perf_counter() - began > args.deadline:
                emit(Row(name, system, error="skipped: deadline"), rows, args.json)
                continue
            try:
                runner = run_static if system == "static" else run_hf_cb
                emit(runner(name, model, prompts, args.output_tokens, args, reference), rows, args.json)
            except Exception as error:  # noqa: BLE001
                traceback.print_exc()
                emit(Row(name, system, error=repr(error)), rows, args.json)
        llm = model = None
        reset_memory()
    print(table(rows), flush=True)
    print(f"total {time.perf_counter() - began:.0f} s", flush=True)
    return 0 if rows and not any(r.error for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
