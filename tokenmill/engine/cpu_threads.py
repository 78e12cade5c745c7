"""How long a CPU engine's OpenMP threads spin waiting for work before they sleep. Torch-free: it must run first.

torch's CPU build runs its parallel ops (and oneDNN's) on GNU OpenMP, whose idle threads spin up to 300,000 times
(`GOMP_SPINCOUNT`'s default: milliseconds) before sleeping. Between two parallel ops of an engine step the host works
alone, so on a machine where anything else wants a core (the worker's own threads, Redis, other processes) the
spinning threads take it, and a thread spun out of its core delays the next op. `limit_spinning` sets
`GOMP_SPINCOUNT` to `SPIN_COUNT` for this process and the processes it starts: long enough to span the host's work
between two ops, short enough to give the core back soon after. libgomp reads it once, when torch loads it: it is
set only while no libgomp is loaded yet, and never over the user's own `GOMP_SPINCOUNT` or `OMP_WAIT_POLICY`.
"""

from __future__ import annotations

import os
import sys

#: Spins of an idle OpenMP thread before it sleeps (how it was chosen: docs/benchmarks/throughput.md,
#: "OpenMP threads that spin").
SPIN_COUNT = 10_000
#: The variables by which a user chooses the wait policy: set (non-empty), left as they are.
WAIT_VARIABLES = ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")
_decided: str | None = None  # what `limit_spinning` found, for `describe`


def limit_spinning() -> None:
    """Set `GOMP_SPINCOUNT` to `SPIN_COUNT` unless the user chose a wait policy or libgomp is already loaded."""
    global _decided
    if _decided is not None:
        return
    chosen = next((name for name in WAIT_VARIABLES if os.environ.get(name)), None)
    if chosen == "GOMP_SPINCOUNT" and os.environ[chosen] == str(SPIN_COUNT):
        _decided = f"GOMP_SPINCOUNT={SPIN_COUNT}"  # ours, inherited (a worker's engine process) or the same value
    elif chosen:
        _decided = f"{chosen}={os.environ[chosen]} from the environment"
    elif _libgomp_loaded():
        _decided = "libgomp's default (loaded before tokenmill.engine: import tokenmill first, or set GOMP_SPINCOUNT)"
    else:
        os.environ["GOMP_SPINCOUNT"] = str(SPIN_COUNT)
        _decided = f"GOMP_SPINCOUNT={SPIN_COUNT}"


def _libgomp_loaded() -> bool:
    """Whether this process has loaded libgomp already (with torch or another library): it has read its variables."""
    if "torch" in sys.modules:
        return True
    try:
        with open("/proc/self/maps") as maps:
            return any("libgomp" in line for line in maps)
    except OSError:  # not Linux: torch's import is the one sign
        return False


def describe() -> str:
    """The idle OpenMP threads' spin, as decided at import (for the engine's start log)."""
    return _decided or "not decided"
