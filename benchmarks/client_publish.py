"""Client benchmark: a lone job's publish through Celery's own path against tokenmill's publisher, side by side.

    python benchmarks/client_publish.py [--jobs 400] [--worker-jobs 600] [--pause 0.01]

A lone job (one now and then, the case where nothing is warm) waits for its client's `LPUSH` before any worker sees
it. Two ways to publish the same task message, alternating job by job in one run, `--pause` seconds apart:

* Celery's: `app.amqp.as_task_v2`, then `send_task_message` through a producer taken from the app's pool (kombu's
  retrying publish, `Producer.publish`, the queue's declaration check), as `Client.submit` did until 2026-12-03;
* tokenmill's: `Client.submit`'s publisher (`tokenmill.queue.publisher`: the same message on a kombu channel kept
  open; the queued envelope is equal but for the delivery tag, the body once decoded, see tests/service/test_publisher.py).

Measured: the publish alone (the same validated job, to a redis-server of its own), then lone one-token jobs through
one `tokenmill worker` on builtin:tiny, submit -> result. Prints p50 and p90 of each way and their ratio.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "service"))

from service_fixtures import RedisServer, Worker  # noqa: E402

from tokenmill.client import Client, JobHandle, content_hash  # noqa: E402
from tokenmill.queue.names import JOB_HASH_HEADER, TASK_NAME  # noqa: E402

JOB = {"prompt": "Summarize the following sentence in three words: the cat sat on the mat", "max_tokens": 1,
       "temperature": 0.0, "ignore_eos": True}


def celery_publish(client: Client, wire: dict[str, Any], job_hash: str) -> None:
    """A validated job published as `Client.submit` did before 2026-12-03: Celery's `send_task_message` on a pooled
    producer."""
    amqp = client.app.amqp
    message = amqp.as_task_v2(wire["id"], TASK_NAME, args=[wire], kwargs={}, argsrepr=f"[<job {wire['id']}>]",
                              kwargsrepr="{}")
    message.headers[JOB_HASH_HEADER] = job_hash
    with client.app.producer_or_acquire() as producer:
        amqp.send_task_message(producer, TASK_NAME, message, queue=client.queue, retry=True)


def celery_submit(client: Client, fields: dict[str, Any]) -> JobHandle:
    """`Client.submit` as it was before 2026-12-03 (`celery_publish`)."""
    wire = client.prepare(dict(fields))
    handle = JobHandle(wire["id"], client, content_hash(wire))
    celery_publish(client, wire, handle.job_hash)
    return handle


def alternate(ways: dict[str, Callable[[], None]], rounds: int, pause: float) -> dict[str, list[float]]:
    """Seconds per call of each way, the ways taking turns (which goes first alternates too), `pause` before each."""
    times: dict[str, list[float]] = {name: [] for name in ways}
    order = list(ways)
    for index in range(rounds):
        for name in order if index % 2 else reversed(order):
            time.sleep(pause)
            started = time.perf_counter()
            ways[name]()
            times[name].append(time.perf_counter() - started)
    return times


def report(title: str, times: dict[str, list[float]]) -> None:
    (first, a), (second, b) = times.items()

    def ms(values: list[float], q: int) -> float:
        return statistics.quantiles(values, n=10)[q // 10 - 1] * 1e3

    print(f"\n{title} ({len(a)} each, alternating)\n")
    print(f"| ms | {first} | {second} | ratio |\n|---|---:|---:|---:|")
    for q in (50, 90):
        print(f"| p{q} | {ms(a, q):.3f} | {ms(b, q):.3f} | {ms(b, q) / ms(a, q):.2f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", type=int, default=400, help="publishes of each way, no worker")
    parser.add_argument("--worker-jobs", type=int, default=600, help="lone jobs of each way through a worker")
    parser.add_argument("--pause", type=float, default=0.01, help="seconds idle before each job")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="tokenmill-client-bench-") as tmp:
        root = Path(tmp)
        server = RedisServer(root / "redis", appendonly=False)
        server.start()
        try:
            client = Client(server.url)
            wire = client.prepare(dict(JOB))
            job_hash = content_hash(wire)

            ways = {"Celery's send_task_message": lambda: celery_publish(client, wire, job_hash),
                    "tokenmill's publisher": lambda: client.publisher.publish(*client._task(wire, job_hash))}
            alternate(ways, 50, 0.0)  # warm both
            report(f"the publish alone, {args.pause * 1e3:g} ms idle before each", alternate(ways, args.jobs, args.pause))
            server.client().delete(client.queue)

            worker = Worker(server.url, root / "worker.log", "bench", {}).wait_ready()
            try:
                client.results([client.submit(**JOB) for _ in range(20)], timeout=120)
                through = {"Celery's send_task_message": lambda: celery_submit(client, JOB).result(timeout=60),
                           "tokenmill's publisher": lambda: client.submit(**JOB).result(timeout=60)}
                report(f"a lone one-token job through one worker, submit -> result, {args.pause * 1e3:g} ms idle before each",
                       alternate(through, args.worker_jobs, args.pause))
            finally:
                worker.process.terminate()
                worker.process.wait(timeout=60)
        finally:
            server.stop()


if __name__ == "__main__":
    main()
