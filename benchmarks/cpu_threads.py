#!/usr/bin/env python
"""tokenmill on a CPU with its idle OpenMP threads spinning more or less: wall time of the same run, side by side.

Each run is `vllm_cpu.py`'s tokenmill child (a fresh process: the random-weight Qwen2.5-0.5B shape with 4 layers,
64 requests of 128 prompt + 64 greedy output tokens, float32, 2 threads) under one of the variants below, set in its
environment before torch loads libgomp; the variants alternate, `--rounds` times. `--busy N` keeps N busy loops
(`while True: pass`) running throughout: a machine where something else wants the cores.

    tokenmill   nothing set: what `import tokenmill.engine` chooses (tokenmill/engine/cpu_threads.py)
    libgomp     GOMP_SPINCOUNT=300000, libgomp's own default count
    passive     OMP_WAIT_POLICY=PASSIVE: idle threads sleep at once
    spinN       GOMP_SPINCOUNT=N

    .venv/bin/python benchmarks/cpu_threads.py --busy 1                 # under load
    .venv/bin/python benchmarks/cpu_threads.py --rounds 5 --variants tokenmill,libgomp,spin3000
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]  # see vllm_cpu.py
sys.path.append(_HERE)
import vllm_cpu  # noqa: E402

from tokenmill.engine.cpu_threads import WAIT_VARIABLES  # noqa: E402

NAMED = {"tokenmill": {}, "libgomp": {"GOMP_SPINCOUNT": "300000"}, "passive": {"OMP_WAIT_POLICY": "PASSIVE"}}


def variant_env(name: str) -> dict[str, str]:
    if name in NAMED:
        return NAMED[name]
    if name.startswith("spin") and name[4:].isdigit():
        return {"GOMP_SPINCOUNT": name[4:]}
    raise SystemExit(f"cpu_threads: unknown variant {name!r} (tokenmill, libgomp, passive or spinN)")


def run_once(name: str, spec_path: Path, out: Path) -> float:
    env = {k: v for k, v in os.environ.items() if k not in WAIT_VARIABLES}
    env.update(OMP_NUM_THREADS="2", TOKENIZERS_PARALLELISM="false", **variant_env(name))
    command = [sys.executable, os.path.join(_HERE, "vllm_cpu.py"), "--child", "tokenmill", "--spec", str(spec_path),
               "--out", str(out)]
    done = subprocess.run(command, env=env, cwd=vllm_cpu.ROOT, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"cpu_threads: the {name} run failed: {done.stderr.strip().splitlines()[-1:]}")
    return json.loads(out.read_text())["wall"]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--busy", type=int, default=0, help="busy loops running throughout (default 0)")
    p.add_argument("--variants", default="tokenmill,libgomp,passive", help="comma-separated, the first is the base")
    args = p.parse_args()
    names = [n.strip() for n in args.variants.split(",") if n.strip()]
    for name in names:
        variant_env(name)
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.busy)]
    walls: dict[str, list[float]] = {n: [] for n in names}
    try:
        with tempfile.TemporaryDirectory(prefix="tokenmill-threads-") as tmp:
            work = Path(tmp)
            vllm_cpu.build_model_dir(work / "model", vllm_cpu.QWEN25_05B, 4, 0)
            workload = vllm_cpu.make_workload(64, 128, 64, vllm_cpu.QWEN25_05B["vocab_size"], 0)
            spec = dict(workload, model_dir=str(work / "model"), threads=2, max_model_len=256, kv_cache_gib=4,
                        max_num_batched_tokens=2048, max_num_seqs=256, vllm_eager=False, dtype="float32")
            (work / "spec.json").write_text(json.dumps(spec))
            for round_ in range(args.rounds):
                for name in names:
                    walls[name].append(run_once(name, work / "spec.json", work / "out.json"))
                    print(f"[{round_ + 1}/{args.rounds}] {name}: {walls[name][-1]:.2f} s (load {vllm_cpu.load_now()})",
                          file=sys.stderr, flush=True)
    finally:
        for loop in busy:
            loop.kill()
    base = statistics.median(walls[names[0]])
    print(f"machine: {vllm_cpu.cpu_model()}, {os.cpu_count()} CPUs; busy loops: {args.busy}; {time.strftime('%F %T')}")
    print("| variant | wall s (rounds) | median | base / variant |\n|---|---|---:|---:|")
    for name in names:
        median = statistics.median(walls[name])
        rounds = ", ".join(f"{w:.1f}" for w in walls[name])
        print(f"| {name} | {rounds} | {median:.2f} | {base / median:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
