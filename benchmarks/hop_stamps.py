"""`tokenmill worker` with hop stamps: the wall-clock time at entry and exit of the functions a job passes through, in
the worker and in its engine process. `benchmarks/lone_job_hops.py` starts a worker this way and reads the stamps.

    HOP_STAMPS=/some/dir python benchmarks/hop_stamps.py worker --broker ... (the `tokenmill` command's arguments)

Run as a script, never installed: the engine process, started by multiprocessing's "spawn", runs this file again as
its `__mp_main__`, so the engine loop's functions are stamped there. Each process keeps its stamps in memory
(a list append, ~1 µs a stamp) and appends them to `<dir>/<pid>.stamps` every `FLUSH_INTERVAL` seconds, one
"<name>> <time>" line at entry and "<name>< <time>" at exit. Without `HOP_STAMPS` nothing is stamped.
"""

from __future__ import annotations

import functools
import importlib
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

#: module -> the "Class.method" names stamped in the worker process, in the order a lone job reaches them.
WORKER_HOPS = {
    "tokenmill.queue.transport": ("Channel._brpop_read", "Channel._decode", "Channel._claim_many"),
    "kombu.transport.virtual.base": ("Transport._deliver",),
    "tokenmill.worker.intake": ("Intake.offer", "IntakeRun.admit", "IntakeRun.finish"),
    "tokenmill.worker.batch_task": ("BatchRun._parse", "BatchRun._check_in", "BatchRun._submit"),
    "tokenmill.worker.engine_process": ("EngineProcess.tokenize", "EngineProcess._resolve"),
    "tokenmill.worker.service": ("WorkerService.store_results",),
}
#: The same for the engine process.
ENGINE_HOPS = {"tokenmill.worker.engine_process": ("_Loop._handle", "_Loop._step", "_Loop._send_done")}
FLUSH_INTERVAL = 0.2


def stamped(function: Callable[..., Any], label: str, stamps: list[tuple[str, float]]) -> Callable[..., Any]:
    """`function`, appending (label + ">", entry time) and (label + "<", exit time) to `stamps`."""

    @functools.wraps(function)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        stamps.append((label + ">", time.time()))
        try:
            return function(*args, **kwargs)
        finally:
            stamps.append((label + "<", time.time()))

    return wrapper


def stamp_methods(hops: dict[str, tuple[str, ...]], stamps: list[tuple[str, float]]) -> None:
    """Replace each named method on its class by its `stamped` version (before any instance binds it)."""
    for module_name, names in hops.items():
        module = importlib.import_module(module_name)
        for name in names:
            class_name, method = name.split(".")
            owner = getattr(module, class_name)
            setattr(owner, method, stamped(getattr(owner, method), name, stamps))


def write_stamps(directory: str, stamps: list[tuple[str, float]]) -> None:
    """Append the stamps taken so far to this process's file, every `FLUSH_INTERVAL` seconds (a daemon thread)."""
    path = os.path.join(directory, f"{os.getpid()}.stamps")

    def flush() -> None:
        while True:
            time.sleep(FLUSH_INTERVAL)
            taken = len(stamps)
            if taken:
                with open(path, "a") as file:
                    file.writelines(f"{name} {at:.6f}\n" for name, at in stamps[:taken])
                del stamps[:taken]

    threading.Thread(target=flush, name="hop-stamps", daemon=True).start()


def install(hops: dict[str, tuple[str, ...]]) -> None:
    directory = os.environ.get("HOP_STAMPS")
    if directory:
        stamps: list[tuple[str, float]] = []
        stamp_methods(hops, stamps)
        write_stamps(directory, stamps)


if __name__ == "__mp_main__":  # the engine process
    install(ENGINE_HOPS)

if __name__ == "__main__":
    # Python put this file's folder first on sys.path: the benchmarks there must not shadow what the worker imports
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != os.path.dirname(os.path.abspath(__file__))]
    install(WORKER_HOPS)
    from tokenmill.cli import main

    sys.exit(main())
