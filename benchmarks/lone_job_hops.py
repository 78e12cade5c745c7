"""Where a lone job's time goes, hop by hop: stamps in the client, the worker and its engine process.

    python benchmarks/lone_job_hops.py [--jobs 300] [--max-tokens 1] [--pause 0.01]

Starts its own redis-server and one `tokenmill worker` on builtin:tiny (as `benchmarks/job_queue.py` does) under
`benchmarks/hop_stamps.py`, which writes the wall-clock time at entry (">") and exit ("<") of the functions a job
passes through in the worker and its engine process; the client's are stamped here. It then sends `--jobs` jobs one
at a time, each `--pause` seconds after the last one's result, and prints every stamp's time since `submit` began
(p50, p10 and p90 over the jobs), in the order a lone job reaches them, and the job's time outside the engine's
steps. A job's stamps are those between its `submit` and its result, each name's first (and, for the steps, the
last exit). A stamp costs ~1 µs, ~30 a job: this finds where the time goes; the goal's figure is `job_queue.py`'s.

    python benchmarks/lone_job_hops.py --steps --max-tokens 40 --jobs 100

`--steps` also runs each job in-process beside it (the engine in this process, its `LLMEngine.step` stamped too; the
queue's job first in even pairs, the in-process one first in odd pairs) and compares the decode steps themselves: per
step index, the median time of that step in the worker's engine process and in-process, their sums over a job (also
per order), and the time the engine loop spent between steps. `job_queue.py` reports a lone job's decode steps as
slower in the engine process; this tells work the engine process adds from the same work run slower, and whether
going first is what costs. Where `nvidia-smi` runs, it samples the GPU's SM clock every 20 ms meanwhile, and the
median clock during each path's jobs is printed: a GPU that clocks down while idle runs whichever job goes first
on a slower clock. A third run of each job goes to the same in-process engine in a child process of this one,
started as the worker starts its engine process ("spawn"), its steps stamped alike (it runs last in two pairs of
jobs, first in the next two): on 2026-12-04's H200 the engine process's decode steps were ~10% slower than
in-process (+11 ms over 40 steps) while on CPUs they are within 0.5-3%. Steps as slow in that child say the cause
is being a child process (the CPU it is placed on, its own CUDA context); steps as fast as in-process put it in
the engine process's own setup or loop.
"""

from __future__ import annotations

import argparse
import datetime
import multiprocessing
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import hop_stamps  # noqa: E402
import job_queue  # noqa: E402  (it drops this folder from sys.path again: nothing else is imported from it)

from tokenmill.client import Client  # noqa: E402
from tokenmill.queue.publisher import Publisher  # noqa: E402

CLIENT_HOPS = {"client.prepare": (Client, "prepare"), "client.publish": (Publisher, "publish")}


def stamp_client(stamps: list[tuple[str, float]]) -> None:
    for label, (owner, name) in CLIENT_HOPS.items():
        setattr(owner, name, hop_stamps.stamped(getattr(owner, name), label, stamps))


def read_stamps(directory: Path) -> list[tuple[float, str]]:
    stamps = []
    for path in directory.glob("*.stamps"):
        for line in path.read_text().splitlines():
            name, at = line.split()
            stamps.append((float(at), name))
    return stamps


def per_job(stamps: list[tuple[float, str]], windows: list[tuple[float, float]]) -> list[dict[str, float]]:
    """Per job, each stamp's first time since its submit (ms), and "steps": first step entry to last step exit."""
    stamps.sort()
    jobs, at = [], 0
    for started, ended in windows:
        while at < len(stamps) and stamps[at][0] < started:
            at += 1
        first: dict[str, float] = {}
        last_step_exit = None
        index = at
        while index < len(stamps) and stamps[index][0] <= ended:
            moment, name = stamps[index]
            first.setdefault(name, (moment - started) * 1e3)
            if name == "_Loop._step<":
                last_step_exit = (moment - started) * 1e3
            index += 1
        if "_Loop._step>" in first and last_step_exit is not None:
            first["steps"] = last_step_exit - first["_Loop._step>"]
        first["result returned"] = (ended - started) * 1e3
        jobs.append(first)
    return jobs


def report(jobs: list[dict[str, float]], args: argparse.Namespace) -> None:
    names = {name for job in jobs for name in job if name != "steps"}
    rows = []
    for name in names:
        values = sorted(job[name] for job in jobs if name in job)
        rows.append((statistics.median(values), values[len(values) // 10], values[9 * len(values) // 10], name, len(values)))
    print(f"\n{len(jobs)} lone jobs, max_tokens {args.max_tokens}, {args.pause * 1e3:g} ms idle before each; "
          "ms since `submit` began\n")
    print("| stamp | p50 | p10 | p90 | jobs |\n|---|---:|---:|---:|---:|")
    for median, low, high, name, count in sorted(rows):
        print(f"| {name} | {median:.3f} | {low:.3f} | {high:.3f} | {count} |")
    totals = [job["result returned"] for job in jobs]
    outside = [job["result returned"] - job["steps"] for job in jobs if "steps" in job]
    print(f"\nsubmit -> result p50 {statistics.median(totals):.3f} ms; in the engine's steps p50 "
          f"{statistics.median([job['steps'] for job in jobs if 'steps' in job]):.3f}; outside them p50 "
          f"{statistics.median(outside):.3f} ({len(outside)} jobs with the engine's stamps)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", type=int, default=300)
    parser.add_argument("--max-tokens", type=int, default=1)
    parser.add_argument("--pause", type=float, default=0.01, help="seconds idle before each job")
    parser.add_argument("--steps", action="store_true", help="compare each decode step with the same job in-process")
    args = parser.parse_args()
    workload = job_queue.make_workload(args.jobs, 1, args.max_tokens, args.max_tokens)
    with tempfile.TemporaryDirectory(prefix="tokenmill-hops-") as tmp:
        stamp_dir = Path(tmp) / "stamps"
        stamp_dir.mkdir()
        os.environ["HOP_STAMPS"] = str(stamp_dir)  # the worker inherits it; this process stamps its own below
        queue = job_queue.QueuePath(Path(tmp) / "queue", 256, 1, None, entry=(str(HERE / "hop_stamps.py"),))
        try:
            queue.warm_up(workload)
            time.sleep(2 * hop_stamps.FLUSH_INTERVAL)
            for path in stamp_dir.glob("*.stamps"):  # the warm-up's
                path.unlink()
            client_stamps: list[tuple[str, float]] = []
            stamp_client(client_stamps)
            local = in_process(workload, client_stamps) if args.steps else None
            child = SpawnedEngine(workload) if args.steps else None
            clocks = GpuClocks(Path(tmp) / "clocks.csv") if args.steps else None
            windows, local_windows, child_windows = [], [], []
            for index in range(args.jobs):
                time.sleep(args.pause)

                def through_queue() -> None:
                    started = time.time()
                    queue.client.submit(**workload.job(index)).result(timeout=60)
                    windows.append((started, time.time()))

                def here() -> None:
                    started = time.time()
                    local.probe(workload, index)
                    local_windows.append((started, time.time()))

                def in_child() -> None:
                    started = time.time()
                    client_stamps.extend(child.probe(index))
                    child_windows.append((started, time.time()))

                # the pair shares the machine's speed of the moment; which goes first alternates
                runs = ((through_queue, here) if index % 2 == 0 else (here, through_queue)) if local else (through_queue,)
                if child is not None:
                    runs = (*runs, in_child) if index % 4 < 2 else (in_child, *runs)
                for run in runs:
                    run()
            if child is not None:
                child.close()
            time.sleep(3 * hop_stamps.FLUSH_INTERVAL)
            if clocks is not None:
                clocks.report(windows, local_windows)
            stamps = read_stamps(stamp_dir) + [(at, name) for name, at in client_stamps]
            queue.log_tail()
        finally:
            queue.close()
    report(per_job(stamps, windows), args)
    if args.steps:
        report_steps(stamps, windows, local_windows, child_windows)


class GpuClocks:
    """The GPU's SM clock, sampled every 20 ms by `nvidia-smi` in the background (nothing where it does not run)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            self.sampler: subprocess.Popen | None = subprocess.Popen(
                ["nvidia-smi", "--query-gpu=timestamp,clocks.sm", "--format=csv,noheader,nounits", "-lms", "20"],
                stdout=open(path, "w"), stderr=subprocess.DEVNULL)
        except OSError:
            self.sampler = None

    def report(self, windows: list[tuple[float, float]], local_windows: list[tuple[float, float]]) -> None:
        if self.sampler is None:
            return
        self.sampler.terminate()
        self.sampler.wait()
        times, values = [], []
        for line in self.path.read_text().splitlines():  # "2026/12/04 13:45:01.234, 1980" (local time)
            stamp, _, clock = line.partition(",")
            try:
                times.append(datetime.datetime.strptime(stamp.strip(), "%Y/%m/%d %H:%M:%S.%f").timestamp())
                values.append(int(clock))
            except ValueError:
                continue
        if not values:
            print("\nGPU SM clock: no samples")
            return

        def during(spans: list[tuple[float, float]]) -> str:
            inside = [v for t, v in zip(times, values) if any(a <= t <= b for a, b in spans)]
            return f"{statistics.median(inside):.0f} MHz ({len(inside)} samples)" if inside else "no samples"

        print(f"\nGPU SM clock (nvidia-smi every 20 ms), median: during the queue's jobs {during(windows)}, during the "
              f"in-process jobs {during(local_windows)}; over the whole run {min(values)}-{max(values)} MHz")


def in_process(workload: job_queue.Workload, stamps: list[tuple[str, float]],
               label: str = "local.step") -> job_queue.LocalPath:
    """The same engine in this process, its steps stamped as `label` (as the engine loop's are)."""
    from tokenmill.engine.llm_engine import LLMEngine

    LLMEngine.step = hop_stamps.stamped(LLMEngine.step, label, stamps)
    local = job_queue.LocalPath(256, 1)
    local.warm_up(workload)
    del stamps[:]  # the warm-up's
    return local


class SpawnedEngine:
    """`in_process` in a child process started with "spawn", as the worker starts its engine process; its steps
    stamped as "child.step" and sent back with each job (the module docstring says what it tells apart)."""

    def __init__(self, workload: job_queue.Workload) -> None:
        context = multiprocessing.get_context("spawn")
        self.conn, child_conn = context.Pipe()
        self.process = context.Process(target=_serve_spawned, args=(child_conn, workload), daemon=True)
        self.process.start()
        self.conn.recv()  # warmed up

    def probe(self, index: int) -> list[tuple[str, float]]:
        """Job `index` run alone in the child; its steps' stamps."""
        self.conn.send(index)
        return self.conn.recv()

    def close(self) -> None:
        self.conn.send(None)
        self.process.join(timeout=30)


def _serve_spawned(conn: Any, workload: job_queue.Workload) -> None:
    """The child's loop: each index received is run as `LocalPath.probe` and answered with its steps' stamps."""
    stamps: list[tuple[str, float]] = []
    local = in_process(workload, stamps, "child.step")
    conn.send("ready")
    while (index := conn.recv()) is not None:
        local.probe(workload, index)
        conn.send(stamps[:])
        del stamps[:]


def step_times(stamps: list[tuple[float, str]], name: str,
               windows: list[tuple[float, float]]) -> list[list[tuple[float, float]]]:
    """Per job window, the (entry, exit) times of its `name` stamps, in order."""
    pairs, opened = [], None
    for at, stamp in sorted(stamps):
        if stamp == name + ">":
            opened = at
        elif stamp == name + "<" and opened is not None:
            pairs.append((opened, at))
            opened = None
    return [[(entry, leave) for entry, leave in pairs if started <= entry <= ended] for started, ended in windows]


def report_steps(stamps: list[tuple[float, str]], windows: list[tuple[float, float]],
                 local_windows: list[tuple[float, float]], child_windows: list[tuple[float, float]]) -> None:
    """Per step index, the engine process's step against the same job's in-process step (ms, medians over jobs), and
    the same job's step in a spawned child beside them."""
    queue_jobs, local_jobs = step_times(stamps, "_Loop._step", windows), step_times(stamps, "local.step", local_windows)
    child_jobs = step_times(stamps, "child.step", child_windows)

    def durations(job: list[tuple[float, float]]) -> list[float]:
        return [(leave - entry) * 1e3 for entry, leave in job]

    def gaps(job: list[tuple[float, float]]) -> float:
        return sum(job[i + 1][0] - job[i][1] for i in range(len(job) - 1)) * 1e3

    steps = min(len(job) for job in queue_jobs + local_jobs + child_jobs)
    print(f"\ndecode steps of the same {len(queue_jobs)} jobs, the worker's engine process against in-process beside it "
          "(ms, medians over jobs); the engine loop's step includes the pipe write of a finished job's result; the "
          "same engine as in-process in a spawned child process\n")
    print("| step | engine process | in-process | difference | spawned child | child - in-process |\n"
          "|---:|---:|---:|---:|---:|---:|")

    def row(label: str, figure: Any) -> None:
        mine, theirs, child = (statistics.median(figure(job) for job in jobs) for jobs in (queue_jobs, local_jobs, child_jobs))
        print(f"| {label} | {mine:.3f} | {theirs:.3f} | {mine - theirs:+.3f} | {child:.3f} | {child - theirs:+.3f} |")

    for index in sorted({0, 1, 2, 4, 8, steps // 2, steps - 2, steps - 1} & set(range(steps))):
        row(str(index), lambda job, index=index: durations(job)[index])
    row("all steps, a job", lambda job: sum(durations(job)))
    row("between steps, a job", gaps)
    for label, first in (("all steps, the queue's job first", 0), ("all steps, the in-process job first", 1)):
        pairs = [(queue_jobs[i], local_jobs[i]) for i in range(first, min(len(queue_jobs), len(local_jobs)), 2)]
        if pairs:
            mine = statistics.median(sum(durations(job)) for job, _ in pairs)
            theirs = statistics.median(sum(durations(job)) for _, job in pairs)
            print(f"| {label} ({len(pairs)} jobs) | {mine:.3f} | {theirs:.3f} | {mine - theirs:+.3f} |")


if __name__ == "__main__":
    main()
