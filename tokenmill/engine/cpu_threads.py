"""How long a CPU engine's OpenMP threads spin waiting for work before they sleep. Torch-free: it must run first.

torch's CPU build runs its parallel ops (and oneDNN's) on GNU OpenMP, whose idle threads spin up to 300,000 times
(`GOMP_SPINCOUNT`'s default: milliseconds) before sleeping. Between two parallel ops of an engine step the host works
alone, so on a machine where anything else wants a core (the worker's own threads, Redis, other processes) the
spinning threads take it, and a thread spun out of its core delays the next op. `limit_spinning` sets
`GOMP_SPINCOUNT` to `SPIN_COUNT` for this process and the processes it starts: long enough to span the host's work
between two ops, short enough to give the core back soon after. libgomp reads it once, when torch loads it: it is
set only while torch is not yet imported, and never over the user's own `GOMP_SPINCOUNT` or `OMP_WAIT_POLICY`.
"""

from __future__ import annotations

import os
import sys

#: Spins of an idle OpenMP thread before it sleeps (how it was chosen: docs/benchmarks/throughput.md,
#: "OpenMP threads that spin").
SPIN_COUNT = 10_000
_USERS = ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")
_decided: str | None = None  # what `limit_spinning` found, for `describe`


def limit_spinning() -> None:
    """Set `GOMP_SPINCOUNT` to `SPIN_COUNT` unless the user chose a wait policy or torch already loaded libgomp."""
    global _decided
    if _decided is not None:
        return
    chosen = next((name for name in _USERS if name in os.environ), None)
    if chosen:
        _decided = f"{chosen}={os.environ[chosen]} from the environment"
    elif "torch" in sys.modules:
        _decided = "libgomp's default (torch was imported before tokenmill.engine; set GOMP_SPINCOUNT to choose)"
    else:
        os.environ["GOMP_SPINCOUNT"] = str(SPIN_COUNT)
        _decided = f"GOMP_SPINCOUNT={SPIN_COUNT}"


def describe() -> str:
    """The idle OpenMP threads' spin, as decided at import (for the engine's start log)."""
    return _decided or "not decided"
