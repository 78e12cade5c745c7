"""Fair shares benchmark: how long a small job waits behind another run's backlog, first in first out and in shares.

    python benchmarks/fair_shares.py [--backlog 3000] [--max-tokens 64] [--probes 5] [--rounds 2]

Starts its own redis-server and one `tokenmill worker` on builtin:tiny (benchmarks/job_queue.py's `QueuePath`),
then, in one run, times a small job (one prompt, 16 tokens) from submit to result:

* alone, the worker idle;
* behind a backlog of `--backlog` jobs of `--max-tokens` tokens queued just before it by another client on the
  queue's own list (first in, first out: what every run got before shares);
* behind the same backlog queued in a share of its own (`Client(share=...)`, as `annotate --broker` runs and
  `serve` tenants queue), the small job from a plain client and from a client of another share.

Each backlog is cancelled once its probe is back, and the queue drained, before the next. Prints the median of
`--probes` probes per case (the two backlog layouts alternate over `--rounds`) and each case's ratio to alone.

With `--serve-lines N`, also through a `tokenmill serve` subprocess with two tenants (benchmarks/serve.py's
`through_serve`, the `openai` SDK polling every 0.2 s): tenant bob's one-line batch alone, and while tenant
alice's N-line batch runs (cancelled after each probe).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import job_queue  # noqa: E402  (drops this folder from sys.path again: its name shadows the stdlib's queue)

import argparse  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import uuid  # noqa: E402

from tokenmill.client import Client  # noqa: E402
from tokenmill.queue.names import DELIVERIES_KEY  # noqa: E402


def _job(tag: str, index: int, max_tokens: int) -> dict:
    return {"id": f"{tag}-{index}", "prompt": f"job {index}: tell me about mills", "max_tokens": max_tokens,
            "ignore_eos": True, "temperature": 0.0}


def probe(client: Client) -> float:
    """Seconds from submitting one small job to its result."""
    started = time.perf_counter()
    handle = client.submit(_job(f"probe-{uuid.uuid4().hex[:8]}", 0, 16))
    handle.result(timeout=600)
    return time.perf_counter() - started


def behind_backlog(path: job_queue.QueuePath, backlog: int, max_tokens: int, share: str | None,
                   prober: Client) -> float:
    """A small job's time to result, submitted once the worker runs a backlog queued by another client."""
    tag = f"backlog-{uuid.uuid4().hex[:8]}"
    with Client(path.broker, share=share) as producer:
        handles = producer.submit_many(_job(tag, i, max_tokens) for i in range(backlog))
        first = [DELIVERIES_KEY.format(job_id=h.id) for h in handles[:8]]
        job_queue.wait_until(lambda: all(path.pinged.mget(first)), 120, "the backlog running")
        seconds = probe(prober)
        producer.cancel(handles)
        producer.results(handles, timeout=600)
    return seconds


def serve_cases(path: job_queue.QueuePath, directory: Path, lines: int, max_tokens: int, probes: int
                ) -> dict[str, list[float]]:
    """Tenant bob's one-line batch: alone, and behind tenant alice's `lines`-line batch (see the module docstring)."""
    import importlib.util

    from openai import OpenAI

    spec = importlib.util.spec_from_file_location("serve_benchmark", Path(__file__).with_name("serve.py"))
    serve = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(serve)
    server, port = serve.start_server(path.broker, directory, keys="alice=sk-alice,bob=sk-bob")
    alice, bob = (OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=key, max_retries=0)
                  for key in ("sk-alice", "sk-bob"))
    cases: dict[str, list[float]] = {"serve: one-line batch alone": [], f"serve: behind another tenant's "
                                     f"{lines}-line batch": []}
    try:
        for probe_ in range(probes):
            one = serve.write_file(directory / f"one{probe_}.jsonl", 1, 16, f"bob {probe_}")
            cases["serve: one-line batch alone"].append(serve.through_serve(bob, one))
            big = serve.write_file(directory / f"big{probe_}.jsonl", lines, max_tokens, f"alice {probe_}")
            with open(big, "rb") as handle:
                file = alice.files.create(file=handle, purpose="batch")
            running = alice.batches.create(input_file_id=file.id, endpoint="/v1/chat/completions",
                                           completion_window="24h")
            job_queue.wait_until(lambda: (alice.batches.retrieve(running.id).request_counts.completed or 0) > 0,  # noqa: B023
                                 300, "alice's batch running")
            one = serve.write_file(directory / f"two{probe_}.jsonl", 1, 16, f"bob behind {probe_}")
            cases[list(cases)[1]].append(serve.through_serve(bob, one))
            alice.batches.cancel(running.id)
            job_queue.wait_until(lambda: alice.batches.retrieve(running.id).status == "cancelled", 600,  # noqa: B023
                                 "alice's batch cancelled")
    finally:
        server.kill()
    return cases


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backlog", type=int, default=3000)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--probes", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--serve-lines", type=int, default=0, help="also through tokenmill serve (0: not)")
    args = parser.parse_args()
    cases: dict[str, list[float]] = {"alone": [], "fifo": [], "shares, plain client": [], "shares, another share": []}
    with tempfile.TemporaryDirectory() as directory:
        path = job_queue.QueuePath(Path(directory), args.max_num_seqs, 1, None)
        other = Client(path.broker, share="probe-share")
        try:
            for _ in range(3):
                probe(path.client)  # warm
            for round_ in range(args.rounds):
                for _ in range(args.probes):
                    cases["alone"].append(probe(path.client))
                layouts = [("fifo", None, path.client), ("shares, plain client", "run-big", path.client),
                           ("shares, another share", "run-big", other)]
                for name, share, prober in layouts[:: 1 if round_ % 2 == 0 else -1]:
                    for _ in range(max(1, args.probes // args.rounds)):
                        cases[name].append(behind_backlog(path, args.backlog, args.max_tokens, share, prober))
            if args.serve_lines:
                served = serve_cases(path, Path(directory), args.serve_lines, args.max_tokens, args.probes)
        finally:
            other.close()
            path.close()
    alone = statistics.median(cases["alone"])
    print(f"| a 16-token job ({args.backlog} jobs x {args.max_tokens} tokens queued just before it) | median s | "
          f"probes | / alone |")
    print("|---|---|---|---|")
    for name, seconds in cases.items():
        median = statistics.median(seconds)
        print(f"| {name} | {median:.3f} | {len(seconds)} | {median / alone:.1f}x |")
    if args.serve_lines:
        alone = statistics.median(served["serve: one-line batch alone"])
        for name, seconds in served.items():
            median = statistics.median(seconds)
            print(f"| {name} | {median:.3f} | {len(seconds)} | {median / alone:.1f}x |")


if __name__ == "__main__":
    main()
