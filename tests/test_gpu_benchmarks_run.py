"""The GPU-path benchmarks run end to end on CPU in their small modes, so a GPU session can run them as is."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run(*args: str, tmp_path: Path) -> str:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), OUT=str(tmp_path))
    done = subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


def test_step_overhead_prints_a_row_per_size(tmp_path: Path) -> None:
    out = run("benchmarks/step_overhead.py", "8", "24", "--context", "40", "--steps", "3", "--split", tmp_path=tmp_path)
    rows = [line for line in out.splitlines() if line.startswith("| 8 |") or line.startswith("| 24 |")]
    assert len(rows) == 2 and "inputs" in out


def test_step_overhead_runs_the_steady_state_of_short_jobs(tmp_path: Path) -> None:
    out = run("benchmarks/step_overhead.py", "16", "--context", "8", "--outputs", "4", "--steps", "6",
              tmp_path=tmp_path)
    [row] = [line for line in out.splitlines() if line.startswith("| 16 |")]
    assert float(row.split("|")[4]) > 0, out  # CPU µs per sequence per step


def test_gpu_throughput_quick_runs_on_cpu(tmp_path: Path) -> None:
    out = run("benchmarks/gpu_throughput.py", "--quick", "--models", "qwen2.5-0.5b", "--systems", "tokenmill,static",
              "--requests", "3", tmp_path=tmp_path)
    rows = json.loads((tmp_path / "gpu_throughput.json").read_text())
    assert [r["system"] for r in rows] == ["tokenmill", "static"] and not any(r["error"] for r in rows), out
    assert rows[0]["output_tokens"] == 3 * 8 and rows[0]["detail"]["host_ms_per_step"]["schedule"] > 0
    assert rows[1]["agreement"].startswith("3/3 identical")  # float32 on CPU: the same greedy tokens


def test_kernels_gpu_says_it_needs_cuda(tmp_path: Path) -> None:
    assert "nothing was measured" in run("benchmarks/kernels_gpu.py", "--deadline", "1", tmp_path=tmp_path)
