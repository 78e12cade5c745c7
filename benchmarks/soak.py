"""Soak test of the queue's delivery guarantees: thousands of jobs through real workers while workers are
killed with `kill -9` (each replaced) and redis-server is restarted (AOF, `appendfsync always`; half
SIGTERM, half kill -9) at random points of the run.

    python benchmarks/soak.py --jobs 3000 --kills 8 --restarts 8

Prints one table row per run: jobs, faults, lost (must be 0), failed, reruns (job starts beyond the
first: the jobs a killed worker held start again elsewhere), wall time, throughput and machine load.
Exits 1 if any job was lost or failed. Uses the service tests' real components (tests/service).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "service"))

from service_fixtures import RedisServer, Worker, run_with_faults  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", type=int, default=3000)
    parser.add_argument("--kills", type=int, default=8, help="kill -9 of a random worker, each replaced")
    parser.add_argument("--restarts", type=int, default=8, help="redis-server restarts")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-tokens", type=int, default=32, help="jobs generate 8..max-tokens tokens")
    parser.add_argument("--visibility-timeout", type=float, default=3.0)
    args = parser.parse_args()

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
                                      restarts=args.restarts, seed=args.seed + run_index, timeout=1800)
            finally:
                for worker in workers:
                    worker.close()
                server.kill()
        load = os.getloadavg()[0]
        failed |= bool(run.lost or run.failed or run.workers_died)
        rows.append((run.jobs, run.kills, run.restarts, len(run.lost), len(run.failed), run.reruns,
                     run.seconds, run.jobs_per_second, load, len(run.workers_died)))

    header = ("jobs", "kill -9", "redis restarts", "lost", "failed", "reruns", "seconds", "jobs/s", "load (1 min)",
              "workers died")
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for row in rows:
        jobs, kills, restarts, lost, bad, reruns, seconds, rate, load, died = row
        print(f"| {jobs} | {kills} | {restarts} | {lost} | {bad} | {reruns} | {seconds:.0f} | {rate:.1f} | {load:.1f} | {died} |")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
