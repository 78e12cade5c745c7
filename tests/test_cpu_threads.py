"""`tokenmill.engine.cpu_threads`: an engine's idle OpenMP threads give their cores back soon after each op."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tokenmill.engine import cpu_threads

# After each of 40 parallel ops the main thread sleeps 20 ms; the process's CPU time meanwhile is what its idle OpenMP
# thread spent spinning before it slept.
PROBE = """
import json, os, sys, time
if sys.argv[1] == "engine":
    import tokenmill.engine
import torch
from tokenmill.engine import cpu_threads
torch.set_num_threads(2)
x = torch.ones(4_000_000)
for _ in range(3):
    x.add_(1)
idle = 0.0
for _ in range(40):
    x.add_(1)  # a parallel region: both threads work, then the second waits for the next one
    start = time.process_time()
    time.sleep(0.02)
    idle += time.process_time() - start
print(json.dumps([idle, os.environ.get("GOMP_SPINCOUNT"), cpu_threads.describe()]))
"""


def _idle_spin(mode: str, **env: str) -> list:
    clean = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    out = subprocess.run([sys.executable, "-c", PROBE, mode], env=dict(clean, OMP_NUM_THREADS="2", **env),
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="libgomp hardly spins with fewer cores than threads")
def test_once_the_engine_is_imported_idle_openmp_threads_sleep_instead_of_spinning() -> None:
    """Imported before torch, the engine limits the spin: the idle thread's CPU time over 40 pauses of 20 ms is a
    small part of what libgomp's default spin costs (torch imported first: the default, as the log says)."""
    default, default_count, default_said = _idle_spin("torch-first")
    limited, count, said = _idle_spin("engine")
    assert default_count is None and "torch was imported before" in default_said
    assert count == str(cpu_threads.SPIN_COUNT) and said == f"GOMP_SPINCOUNT={cpu_threads.SPIN_COUNT}"
    assert default > 0.01, default  # the probe sees the default's spin at all
    assert limited < default / 4, (limited, default)


def test_a_wait_policy_the_user_set_is_kept() -> None:
    for name, value in (("OMP_WAIT_POLICY", "ACTIVE"), ("GOMP_SPINCOUNT", "12345")):
        _, count, said = _idle_spin("engine", **{name: value})
        assert said == f"{name}={value} from the environment"
        assert count == (value if name == "GOMP_SPINCOUNT" else None)
