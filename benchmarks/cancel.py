"""Cancel benchmark: how fast a cancel frees a running job's slot, and what cancels cost the jobs that go on.

    python benchmarks/cancel.py [--cancels 200] [--max-num-seqs 64] [--jobs 400] [--rounds 2]

Starts its own redis-server and one `tokenmill worker` on builtin:tiny (benchmarks/job_queue.py's `QueuePath`),
then measures, in one run:

* cancel latency: with the engine's batch full of long jobs (and more queued behind them), `Client.cancel` of
  one running job at a time until its `cancelled` result is stored (the worker stores it after the engine
  freed the job's blocks and slot, so this bounds the slot's release too); p50/p99 over `--cancels`;
* throughput: the same `--jobs` jobs with none cancelled, and with 10% of them cancelled as soon as they
  start; tokens/s of the jobs that finish ("useful" tokens) in both, and their ratio (goal: >= 1, the
  cancelled jobs' slots go to the others). The two alternate for `--rounds` rounds (which goes first alternates); medians are reported.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import job_queue  # noqa: E402  (drops this folder from sys.path again: its name shadows the stdlib's queue)

import argparse  # noqa: E402
import random  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

from tokenmill.queue.names import DELIVERIES_KEY  # noqa: E402


def _job(index: int, tag: str, max_tokens: int) -> dict:
    return {"id": f"{tag}-{index}", "prompt": f"job {index}: tell me about mills", "max_tokens": max_tokens,
            "ignore_eos": True, "temperature": 0.0}


def _started(path: job_queue.QueuePath, ids: list[str]) -> list[str]:
    counts = path.client.app.backend.client.mget([DELIVERIES_KEY.format(job_id=i) for i in ids])
    return [job_id for job_id, count in zip(ids, counts) if count is not None]


def cancel_latency(path: job_queue.QueuePath, cancels: int, batch: int) -> list[float]:
    client = path.client
    handles = client.submit_many(_job(i, "long", 2000) for i in range(batch + cancels + 8))
    ids = [h.id for h in handles]
    job_queue.wait_until(lambda: len(_started(path, ids)) >= batch, 300, "a full batch")
    latencies, done = [], set()
    for _ in range(cancels):
        job_queue.wait_until(lambda: set(_started(path, ids)) - done, 60, "a running job")
        victim = sorted(set(_started(path, ids)) - done)[0]
        sent = time.perf_counter()
        client.cancel(victim)
        result = next(client.as_completed([victim], timeout=60))
        latencies.append(time.perf_counter() - sent)
        assert result.status == "cancelled", result
        done.add(victim)
    client.cancel(ids)  # the rest
    client.results(handles, timeout=120)
    return latencies


def throughput(path: job_queue.QueuePath, jobs: int, tag: str, cancel_share: float, seed: int) -> tuple[float, int, int]:
    """(useful tokens/s, useful tokens, cancelled jobs) of one round."""
    client = path.client
    started = time.perf_counter()
    handles = client.submit_many(_job(i, tag, 64) for i in range(jobs))
    doomed = set(random.Random(seed).sample([h.id for h in handles], int(jobs * cancel_share)))
    while doomed:
        hit = _started(path, sorted(doomed))
        if hit:
            client.cancel(hit)
            doomed -= set(hit)
        time.sleep(0.02)
    results = client.results(handles, timeout=600)
    elapsed = time.perf_counter() - started
    useful = sum(r.usage.completion_tokens for r in results if r.ok)
    return useful / elapsed, useful, sum(r.status == "cancelled" for r in results)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cancels", type=int, default=200)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--jobs", type=int, default=400)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as directory:
        path = job_queue.QueuePath(Path(directory), args.max_num_seqs, args.threads, None)
        try:
            throughput(path, 100, "warm", 0.0, 0)
            latencies = cancel_latency(path, args.cancels, args.max_num_seqs)
            plain, cancelled = [], []
            for round_ in range(args.rounds):  # alternating which goes first: the machine's load drifts
                order = [(plain, "plain", 0.0), (cancelled, "cut", 0.1)][:: 1 if round_ % 2 == 0 else -1]
                for runs, tag, share in order:
                    runs.append(throughput(path, args.jobs, f"{tag}{round_}", share, round_))
        finally:
            path.close()
    ms = [1000 * x for x in latencies]
    print(f"cancel latency over {len(ms)} cancels of running jobs (batch of {args.max_num_seqs} full, more queued): "
          f"p50 {job_queue.percentile(ms, 50):.0f} ms, p99 {job_queue.percentile(ms, 99):.0f} ms, max {max(ms):.0f} ms")
    base = statistics.median(r[0] for r in plain)
    cut = statistics.median(r[0] for r in cancelled)
    print(f"| run ({args.jobs} jobs x 64 tokens) | useful tokens/s (median of {args.rounds}) | useful tokens | cancelled |")
    print("|---|---|---|---|")
    print(f"| none cancelled | {base:.0f} | {plain[0][1]} | {plain[0][2]} |")
    print(f"| 10% cancelled as they start | {cut:.0f} | {cancelled[0][1]} | {cancelled[0][2]} |")
    print(f"ratio (10% cancelled / none), per useful token: {cut / base:.2f}")


if __name__ == "__main__":
    main()
