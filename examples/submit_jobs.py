"""Submit a few hundred jobs to a tokenmill queue and print a summary of the results.

    python examples/submit_jobs.py [--broker redis://localhost:6379/0] [--jobs 300] [--output s3://bucket/prefix] [-v]

Needs only the light client (`pip install tokenmill`): no torch. The broker defaults to
`TOKENMILL_BROKER_URL`, else redis://localhost:6379/0 (the compose stack publishes Redis there, with the
password from your .env: `TOKENMILL_BROKER_URL=redis://:$REDIS_PASSWORD@127.0.0.1:6379/0`).
Exits 1 if any job failed.
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import sys
import time

from tokenmill import Client


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--broker", default=None, help="Redis URL (default: $TOKENMILL_BROKER_URL)")
    parser.add_argument("--jobs", type=int, default=300)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--output", default=None, help="write results to s3://bucket/prefix instead of Redis")
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument("-v", "--verbose", action="store_true", help="print each result as a JSON line")
    args = parser.parse_args()

    client = Client(args.broker)
    run = time.strftime("%Y%m%d-%H%M%S")
    jobs = [
        {
            "id": f"example-{run}-{i}",  # a stable id is an idempotency key: resubmitting does not rerun a finished job
            "prompt": f"Example prompt number {i}:",
            "max_tokens": args.max_tokens,
            "temperature": 0.7,
            "seed": i,
            "metadata": {"row": i},
            **({"output": args.output} if args.output else {}),
        }
        for i in range(args.jobs)
    ]
    started = time.perf_counter()
    handles = client.submit_many(jobs)
    print(f"submitted {len(handles)} jobs in {time.perf_counter() - started:.2f}s")

    failures: collections.Counter[str] = collections.Counter()
    latencies, tokens, workers = [], 0, collections.Counter()
    for result in client.as_completed(handles, timeout=args.timeout):
        if result.ok:
            tokens += result.usage.completion_tokens if result.usage else 0
            workers[result.worker or "?"] += 1
            if result.queued_at and result.finished_at:
                latencies.append(result.finished_at - result.queued_at)
        else:
            failures[result.error.code if result.error else "?"] += 1
        if args.verbose:
            print(json.dumps(result.model_dump(exclude_none=True, exclude={"token_ids", "logprobs"})))
    elapsed = time.perf_counter() - started
    succeeded = len(handles) - sum(failures.values())
    print(f"{succeeded}/{len(handles)} succeeded in {elapsed:.1f}s: {len(handles) / elapsed:.1f} jobs/s, "
          f"{tokens / elapsed:.0f} generated tokens/s")
    if latencies:
        cuts = statistics.quantiles(latencies, n=100) if len(latencies) > 1 else latencies * 99
        print(f"submit -> result latency: p50 {cuts[49]:.2f}s, p99 {cuts[98]:.2f}s")
    print("jobs per worker: " + ", ".join(f"{name} {count}" for name, count in workers.most_common()))
    if args.output:
        print(f"full results in {args.output}/<id>.json")
    if failures:
        print(f"failed: {dict(failures)}", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
