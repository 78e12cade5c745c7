"""CPUs of the engine process and of the worker around it (`WorkerSettings.engine_cpus`). Linux only; torch-free.

A CPU of its own keeps the engine's steps off the CPU of the worker's work. Off by default: it helps long generations
but hurts one-token jobs, and each worker placed this way claims its CPUs, so workers sharing a machine each need
their own list.
See docs/internals/worker.md, section "The engine process".
"""

from __future__ import annotations

import os

#: What `engine_cpus` may say besides a CPU list ("2" or "2-3,6").
OFF, AUTO = "off", "auto"


def parse_cpu_list(text: str) -> set[int]:
    """CPU numbers from a list such as "0,2-3" (the syntax of `taskset -c` and /proc's `Cpus_allowed_list`)."""
    cpus: set[int] = set()
    for part in text.split(","):
        first, dash, last = part.strip().partition("-")
        if not first.isdigit() or (dash and not last.isdigit()) or (dash and int(last) < int(first)):
            raise ValueError(f"{text!r} is not a CPU list such as 2 or 2-3,6")
        cpus.update(range(int(first), int(last if dash else first) + 1))
    return cpus


def format_cpu_list(cpus: set[int]) -> str:
    return ",".join(str(cpu) for cpu in sorted(cpus))


def split_cpus(spec: str, available: set[int]) -> tuple[set[int], set[int]] | None:
    """(the engine process's CPUs, the worker's) for `spec` among the `available` ones; None to leave both as they
    are ("off", or "auto" with fewer than two CPUs). "auto": the last available CPU for the engine, the rest for the
    worker. Raises ValueError naming what cannot be done."""
    spec = spec.strip().lower()
    if spec == OFF:
        return None
    if spec == AUTO:
        if len(available) < 2:
            return None
        engine = {max(available)}
    else:
        engine = parse_cpu_list(spec)
        missing = engine - available
        if missing:
            raise ValueError(f"CPU {format_cpu_list(missing)} is not available to this process "
                             f"(available: {format_cpu_list(available)})")
    worker = available - engine
    if not worker:
        raise ValueError(f"{spec!r} leaves no CPU for the worker itself (available: {format_cpu_list(available)})")
    return engine, worker


def placement(spec: str) -> tuple[set[int], set[int]] | None:
    """`split_cpus` of this process's available CPUs; None for "off" on any system."""
    if spec.strip().lower() == OFF:
        return None
    if not hasattr(os, "sched_getaffinity"):
        raise ValueError("CPUs can be chosen on Linux only")
    return split_cpus(spec, set(os.sched_getaffinity(0)))


def pin_process(cpus: set[int]) -> None:
    """Every thread of this process on `cpus` (set per thread; threads started later inherit their starter's)."""
    for thread in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(thread), cpus)
        except (ProcessLookupError, FileNotFoundError):  # a thread that ended meanwhile
            continue
