"""`tokenmill.engine.cpu_memory`: a CPU engine's freed tensors come back from the heap, not as fresh pages."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

import pytest

PROBE = """
import json, resource, sys
import torch
kept = None
if sys.argv[1] == "engine":
    from tokenmill import LLM
    from tokenmill.engine import cpu_memory
    LLM("builtin:tiny")  # a CPU engine
    kept = cpu_memory.keep_freed_memory()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(20):
    torch.empty(40 << 20, dtype=torch.uint8).fill_(1)  # above glibc's largest mmap threshold, freed at once
print(json.dumps([resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before, kept]))
"""


def _faults(mode: str) -> list:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("MALLOC_") and k not in ("LD_PRELOAD", "GLIBC_TUNABLES")}
    out = subprocess.run([sys.executable, "-c", PROBE, mode], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's mallopt")
def test_after_a_cpu_engine_starts_a_freed_large_tensor_is_reused_not_faulted_in_again() -> None:
    """20 tensors of 40 MiB, each freed before the next: without the engine each one maps and faults its 10,240 pages
    afresh; once a CPU engine has started (`keep_freed_memory`), only the first does."""
    (alone, _), (with_engine, kept) = _faults("alone"), _faults("engine")
    assert alone > 15 * 10_240, alone  # the probe measures what it should: each tensor faulted in
    if not kept:
        pytest.skip("this glibc refused the thresholds (the engine logs it and leaves them)")
    assert with_engine < 3 * 10_240, with_engine
