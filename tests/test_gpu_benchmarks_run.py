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


def test_gpu_graphs_quick_runs_the_padded_path_on_cpu(tmp_path: Path) -> None:
    out = run("benchmarks/gpu_graphs.py", "--quick", "--max-num-seqs", "16", "--requests", "3", tmp_path=tmp_path)
    compared = [line for line in out.splitlines() if "replay == padded eager bitwise: True" in line]
    assert len(compared) == 4 and "identical 3/3" in out and "on every bucket checked" in out, out
    assert "async scheduling, the same requests: identical 3/3" in out, out


def test_kernels_gpu_says_it_needs_cuda(tmp_path: Path) -> None:
    assert "nothing was measured" in run("benchmarks/kernels_gpu.py", "--deadline", "1", tmp_path=tmp_path)


def test_gpu_parity_quick_runs_on_cpu(tmp_path: Path) -> None:
    out = run("benchmarks/gpu_parity.py", "--quick", "--requests", "2", tmp_path=tmp_path)
    rows = json.loads((tmp_path / "gpu_parity.json").read_text())
    assert [(r["dtype"], r["backend"]) for r in rows] == 2 * [("float32", "triton"), ("float32", "torch"),
                                                            ("bfloat16", "triton")], out
    assert all(r["identical"] == r["requests"] == 2 and not r["failed"] for r in rows if r["required"]), out


def test_kernel_invariance_check_runs_the_split_path_on_cpu(monkeypatch) -> None:
    """kernels_gpu's bitwise invariance check, which a GPU session runs for the default tiles and the split decode
    path, through Triton's interpreter: a prompt of three partitions, its chunks of 1 past the first split. The
    interpreter's dot is made row-independent as on a GPU (tests/test_triton_attention.py); in float32, where a
    difference shows that bfloat16's rounding could hide."""
    import torch
    from test_triton_attention import row_independent_dot
    from triton.runtime import interpreter

    from tokenmill.kernels.triton_attention import TileConfig

    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import kernels_gpu
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_dot", row_independent_dot)
    monkeypatch.setattr(kernels_gpu, "DTYPE", torch.float32)
    for config in (None, TileConfig(32, 16, partition=16)):
        assert kernels_gpu.check_invariance((8, 2, 16), config, length=45, device="cpu") == "bitwise equal"


def test_kernel_check_fails_a_wrong_or_unwritten_row() -> None:
    """kernels_gpu's check against float64: the torch backend's output passes, a NaN (unwritten) row or a small
    error in one row fails it."""
    import torch

    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import kernels_gpu
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    from tokenmill.kernels.torch_attention import TorchBackend

    batch = kernels_gpu.make_batch(3, 5, 37, (4, 2, 16), device="cpu", dtype=torch.float32)
    out = TorchBackend().paged_attention(*batch.args())
    assert kernels_gpu.check(batch, out).endswith(" ok")
    for row, error in ((0, float("nan")), (2 * 5 + 4, 0.05)):
        wrong = out.clone()
        wrong[row, 1, 3] += error
        verdict = kernels_gpu.check(batch, wrong)
        assert verdict.endswith("FAIL"), verdict
    assert kernels_gpu.poisoned(out).isnan().all()
