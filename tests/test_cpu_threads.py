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
    """[idle CPU seconds, GOMP_SPINCOUNT in the environment, `describe()`, the spin count libgomp says it read]."""
    clean = {k: v for k, v in os.environ.items() if k not in cpu_threads.WAIT_VARIABLES}
    out = subprocess.run([sys.executable, "-c", PROBE, mode],
                         env=dict(clean, OMP_NUM_THREADS="2", OMP_DISPLAY_ENV="VERBOSE", **env),
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    read = [line.split("=", 1)[1].strip(" '") for line in out.stderr.splitlines() if "GOMP_SPINCOUNT =" in line]
    return [*json.loads(out.stdout.strip().splitlines()[-1]), read]


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="libgomp hardly spins with fewer cores than threads")
def test_once_the_engine_is_imported_idle_openmp_threads_sleep_instead_of_spinning() -> None:
    """Imported before torch, the engine limits the spin: libgomp reads the engine's count, and the idle thread's CPU
    time over 40 pauses of 20 ms is a small part of what libgomp's default spin costs (torch imported first: the
    default, as `describe` says). The CPU times are compared twice at most: a loaded machine can starve one probe."""
    for _ in range(2):
        default, default_count, default_said, default_read = _idle_spin("torch-first")
        limited, count, said, read = _idle_spin("engine")
        assert default_count is None and "loaded before tokenmill.engine" in default_said and default_read == ["300000"]
        assert count == str(cpu_threads.SPIN_COUNT) and said == f"GOMP_SPINCOUNT={cpu_threads.SPIN_COUNT}"
        assert read == [str(cpu_threads.SPIN_COUNT)]
        if default > 0.005 and limited < default / 3:  # the default's spin seen at all, and cut
            return
    pytest.fail(f"idle CPU {limited:.4f} s with the engine's spin against {default:.4f} s with libgomp's default")


def test_a_wait_policy_the_user_set_is_kept_and_an_empty_one_is_not_a_choice() -> None:
    for name, value in (("OMP_WAIT_POLICY", "ACTIVE"), ("GOMP_SPINCOUNT", "12345")):
        _, count, said, _ = _idle_spin("engine", **{name: value})
        assert said == f"{name}={value} from the environment"
        assert count == (value if name == "GOMP_SPINCOUNT" else None)
    _, count, said, read = _idle_spin("engine", GOMP_SPINCOUNT="")
    assert count == str(cpu_threads.SPIN_COUNT) and read == [count]
