"""Where a lone job's time goes, hop by hop: stamps in the client, the worker and its engine process.

    python benchmarks/lone_job_hops.py [--jobs 300] [--max-tokens 1] [--pause 0.01]

Starts its own redis-server and one `tokenmill worker` on builtin:tiny (as `benchmarks/job_queue.py` does) under
`benchmarks/hop_stamps.py`, which writes the wall-clock time at entry (">") and exit ("<") of the functions a job
passes through in the worker and its engine process; the client's are stamped here. It then sends `--jobs` jobs one
at a time, each `--pause` seconds after the last one's result, and prints every stamp's time since `submit` began
(p50, p10 and p90 over the jobs), in the order a lone job reaches them, and the job's time outside the engine's
steps. A job's stamps are those between its `submit` and its result, each name's first (and, for the steps, the
last exit). A stamp costs ~1 µs, ~30 a job: this finds where the time goes; the goal's figure is `job_queue.py`'s.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

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
            windows = []
            for index in range(args.jobs):
                time.sleep(args.pause)
                started = time.time()
                queue.client.submit(**workload.job(index)).result(timeout=60)
                windows.append((started, time.time()))
            time.sleep(3 * hop_stamps.FLUSH_INTERVAL)
            stamps = read_stamps(stamp_dir) + [(at, name) for name, at in client_stamps]
            queue.log_tail()
        finally:
            queue.close()
    report(per_job(stamps, windows), args)


if __name__ == "__main__":
    main()
