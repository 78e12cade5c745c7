"""Submit a batch of jobs to a tokenmill queue and print each result as it arrives.

    python examples/submit_jobs.py [--broker redis://localhost:6379/0] [--jobs 100] [--output s3://bucket/prefix]

Needs only the light client (`pip install tokenmill`): no torch. The broker defaults to
`TOKENMILL_BROKER_URL`, else redis://localhost:6379/0.
"""

from __future__ import annotations

import argparse
import json
import time

from tokenmill import Client


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--broker", default=None, help="Redis URL (default: $TOKENMILL_BROKER_URL)")
    parser.add_argument("--jobs", type=int, default=100)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--output", default=None, help="write results to s3://bucket/prefix instead of Redis")
    parser.add_argument("--timeout", type=float, default=600)
    args = parser.parse_args()

    client = Client(args.broker)
    jobs = [
        {
            "id": f"example-{i}",  # a stable id is an idempotency key: resubmitting does not rerun a finished job
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
    print(f"submitted {len(handles)} jobs in {time.perf_counter() - started:.3f}s")

    failed = 0
    for result in client.as_completed(handles, timeout=args.timeout):
        summary = {"id": result.id, "status": result.status, "row": result.metadata.get("row")}
        if result.ok:
            summary.update(tokens=result.usage.completion_tokens, finish_reason=result.finish_reason,
                           output_uri=result.output_uri, text=result.text)
        else:
            failed += 1
            summary.update(error=result.error.model_dump())
        print(json.dumps(summary))
    elapsed = time.perf_counter() - started
    print(f"{len(handles)} results ({failed} failed) in {elapsed:.2f}s: {len(handles) / elapsed:.1f} jobs/s")


if __name__ == "__main__":
    main()
