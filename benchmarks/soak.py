"""Soak test of the queue's delivery guarantees: thousands of jobs through real workers while workers are
killed with `kill -9` (each replaced), redis-server is restarted (AOF, `appendfsync always`; half
SIGTERM, half kill -9) and bursts of cancels hit the jobs, at random points of the run.

    python benchmarks/soak.py --jobs 3000 --kills 8 --restarts 8 --cancels 4

Prints one table row per run: jobs, faults, lost (must be 0), failed, cancelled (each by a burst), reruns (job
starts beyond the first: the jobs a killed worker held start again elsewhere), wall time, throughput and machine
load. Exits 1 if any job was lost or failed, one ended cancelled that no burst named, or a worker died unasked (a
wedged worker exits: see --engine-stall-timeout). Uses the service tests' real components (tests/service).

    python benchmarks/soak.py --recovery 3 12

instead measures, for each visibility timeout, how long after a `kill -9` the jobs the killed worker held
start again on the other worker.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "service"))

from service_fixtures import RedisServer, Worker, run_with_faults, wait_for  # noqa: E402


def measure_recovery(visibility_timeout: float, jobs: int = 40, tokens: int = 300) -> tuple[int, float]:
    """kill -9 one of two workers with all jobs in flight; returns (jobs rerun, seconds until the first rerun)."""
    from tokenmill.client import Client

    with tempfile.TemporaryDirectory(prefix="tokenmill-recovery-") as tmp:
        root = Path(tmp)
        server = RedisServer(root / "redis")
        server.start()
        options = {"visibility-timeout": visibility_timeout}
        doomed, survivor = (Worker(server.url, root / f"{name}.log", name, options) for name in ("doomed", "survivor"))
        try:
            doomed.wait_ready(180)
            survivor.wait_ready(180)
            client = Client(server.url)
            handles = client.submit_many([{"prompt": f"recovery {i}", "max_tokens": tokens, "ignore_eos": True}
                                          for i in range(jobs)])
            broker = server.client()
            wait_for(lambda: broker.zcard("unacked_index") == jobs, 120, "all jobs in flight")
            doomed.kill()
            killed_at = time.time()
            rerun = [r for r in client.results(handles, timeout=600) if r.attempt >= 2]
            client.close()
            return len(rerun), min((r.started_at for r in rerun), default=float("nan")) - killed_at
        finally:
            doomed.close()
            survivor.close()
            server.kill()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", type=int, default=3000)
    parser.add_argument("--kills", type=int, default=8, help="kill -9 of a random worker, each replaced")
    parser.add_argument("--restarts", type=int, default=8, help="redis-server restarts")
    parser.add_argument("--cancels", type=int, default=0, help="bursts of cancels of --cancel-burst random jobs")
    parser.add_argument("--cancel-burst", type=int, default=200)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--shares", type=int, default=0, help="queue the jobs in this many fair shares (0: none)")
    parser.add_argument("--max-tokens", type=int, default=32, help="jobs generate 8..max-tokens tokens")
    parser.add_argument("--visibility-timeout", type=float, default=3.0)
    parser.add_argument("--recovery", type=float, nargs="+", metavar="TIMEOUT",
                        help="measure kill -9 recovery for these visibility timeouts instead")
    args = parser.parse_args()
    if args.recovery:
        print("| visibility timeout (s) | jobs rerun | first rerun started after kill -9 (s) | load (1 min) |")
        print("|---|---|---|---|")
        for timeout in args.recovery:
            count, seconds = measure_recovery(timeout)
            print(f"| {timeout:g} | {count} | {seconds:.1f} | {os.getloadavg()[0]:.1f} |", flush=True)
        return 0

    rows = []
    failed = False
    for run_index in range(args.runs):
        with tempfile.TemporaryDirectory(prefix="tokenmill-soak-") as tmp:
            root = Path(tmp)
            server = RedisServer(root / "redis")
            server.start()
            workers: list[Worker] = []

            def start_worker(broker_url: str, name: str, **options: Any) -> Worker:
                options = {"visibility-timeout": args.visibility_timeout, **options}
                worker = Worker(broker_url, root / f"{name}.log", name, options)
                workers.append(worker)
                return worker

            jobs = [{"prompt": f"soak {run_index} {i}", "max_tokens": 8 + i % max(1, args.max_tokens - 7),
                     "ignore_eos": True, "temperature": 0.0} for i in range(args.jobs)]
            try:
                run = run_with_faults(server, start_worker, jobs, workers=args.workers, kills=args.kills,
                                      restarts=args.restarts, seed=args.seed + run_index, timeout=1800,
                                      cancels=args.cancels, cancel_burst=args.cancel_burst, shares=args.shares)
            finally:
                for worker in workers:
                    worker.close()
                server.kill()
        load = os.getloadavg()[0]
        failed |= bool(run.lost or run.failed or run.workers_died or run.cancelled_unasked)
        rows.append((run.jobs, run.kills, run.restarts, run.cancels, len(run.lost), len(run.failed), run.cancelled,
                     len(run.cancelled_unasked), run.reruns, run.seconds, run.jobs_per_second, load,
                     len(run.workers_died)))

    header = ("jobs", "kill -9", "redis restarts", "cancel bursts", "lost", "failed", "cancelled", "cancelled unasked",
              "reruns", "seconds", "jobs/s", "load (1 min)", "workers died")
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for row in rows:
        *counts, seconds, rate, load, died = row
        print("| " + " | ".join(map(str, counts)) + f" | {seconds:.0f} | {rate:.1f} | {load:.1f} | {died} |")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
