"""`tokenmill worker` whose engine process logs every engine step: when it began, and how many sequences were running
and waiting before it. `benchmarks/job_queue.py` runs its workers this way to print how full the steps of each path
were: the in-process engine has all of a burst's requests at its first step, the worker's engine gets them as the
worker takes them, and on a GPU a step costs its kernel launches more than its tokens.

    STEP_LOG=/some/dir python benchmarks/step_log.py worker --broker ... (the `tokenmill` command's arguments)

Run as a script, never installed: the engine process, started by multiprocessing's "spawn", runs this file again as
its `__mp_main__`, where the engine loop's engine gets its `step` wrapped. Each step keeps (time, running, waiting) in memory (~1 µs; a
write to a file at each step would add a system call to each of a lone job's decode steps); on SIGUSR1, which the
benchmark sends before it reads them, a thread of the engine process appends them to `<dir>/<pid>.steps` as "<time> <running> <waiting>" lines.
Without `STEP_LOG` nothing is logged. The worker process itself writes its threads' names and native ids to
`<dir>/<pid>.threads` on `THREADS_SIGNAL` (`log_threads`): the benchmark's worker CPU by thread.

`STEP_FLOOR_MS` (with `STEP_LOG`): each step lasts at least that long, sleeping what it did not take (`logging_step`).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import Any


def logging_step(engine: Any, steps: list[tuple[float, int, int]], floor_s: float = 0.0) -> Callable[[], Any]:
    """`engine.step`, keeping (time, running, waiting) before each step in `steps`. With `floor_s`, a step that took
    less sleeps the rest before its outputs are returned: a GPU's step, whose host cost is its kernel launches and
    barely grows with its sequences, imitated on a CPU, where a step costs about its tokens (`job_queue.py
    --step-floor`). Sleeping, not spinning: the CPUs stay free for the client, worker and Redis, as a GPU machine's
    other cores would be."""
    step, scheduler = engine.step, engine.scheduler

    def logged() -> Any:
        began = time.time()
        steps.append((began, len(scheduler.running), len(scheduler.waiting)))
        outputs = step()
        if floor_s and (left := began + floor_s - time.time()) > 0:
            time.sleep(left)
        return outputs

    return logged


def log_steps(directory: str, floor_s: float = 0.0) -> None:
    # torch-free here: the engine (and torch) come in `serve`, after it set the process's CPUs (`--engine-cpus`)
    from tokenmill.worker import engine_process

    if not hasattr(engine_process, "_Loop"):  # a checkout older than the engine loop (`job_queue.py --against`)
        return
    steps: list[tuple[float, int, int]] = []
    fd = os.open(os.path.join(directory, f"{os.getpid()}.steps"), os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    start_loop = engine_process._Loop.__init__

    def start_logged_loop(loop: Any, engine: Any, *args: Any) -> None:  # (conn) or (conn, outbox), by checkout
        start_loop(loop, engine, *args)
        engine.step = logging_step(engine, steps, floor_s)

    def write_out() -> None:
        taken = len(steps)  # the engine's thread appends meanwhile: only these are written and removed
        os.write(fd, "".join(f"{at:.6f} {running} {waiting}\n" for at, running, waiting in steps[:taken]).encode())
        del steps[:taken]

    engine_process._Loop.__init__ = start_logged_loop  # type: ignore[method-assign]
    answer(signal.SIGUSR1, write_out, "step-log-writer")


def answer(signum: int, action: Callable[[], None], name: str) -> None:
    """Run `action` on a thread of its own each time `signum` arrives: the signal is blocked in this thread, and so in
    every thread started from here on (torch's and CUDA's in the engine process, Celery's in the worker), and that one
    thread waits for it. A Python handler runs only on the main thread, once it wakes: a signal the kernel gave to
    another thread while the main one waited on a pipe was handled at the next message, after the benchmark had read
    (a likely cause of the two runs on the H200 whose engine process wrote no steps when asked)."""
    signal.pthread_sigmask(signal.SIG_BLOCK, {signum})

    def wait() -> None:
        while True:
            signal.sigwait({signum})
            action()

    threading.Thread(target=wait, name=name, daemon=True).start()


#: The signal `log_threads` answers: a real-time one, which Celery's worker leaves alone (it takes SIGUSR1 and SIGUSR2).
THREADS_SIGNAL = signal.SIGRTMIN + 4


def log_threads(directory: str) -> None:
    """On `THREADS_SIGNAL`, this process's threads as "<native id> <name>" lines in `<dir>/<pid>.threads`: the
    benchmark reads each thread's CPU from /proc and names it from these (Python 3.11 gives its threads no OS name)."""
    path = os.path.join(directory, f"{os.getpid()}.threads")

    def write_out() -> None:
        text = "".join(f"{thread.native_id} {thread.name}\n" for thread in threading.enumerate())
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        try:
            os.write(fd, text.encode())
        finally:
            os.close(fd)

    answer(THREADS_SIGNAL, write_out, "thread-names-writer")


if __name__ == "__mp_main__" and os.environ.get("STEP_LOG"):  # the engine process
    log_steps(os.environ["STEP_LOG"], float(os.environ.get("STEP_FLOOR_MS") or 0) / 1000)

if __name__ == "__main__":
    # Python put this file's folder first on sys.path: the benchmarks there must not shadow what the worker imports
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != os.path.dirname(os.path.abspath(__file__))]
    if os.environ.get("STEP_LOG"):
        log_threads(os.environ["STEP_LOG"])
    from tokenmill.cli import main

    sys.exit(main())
