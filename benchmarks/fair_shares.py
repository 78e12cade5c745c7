"""Fair shares benchmark: how long a small job waits behind another run's backlog, first in first out and in shares.

    python benchmarks/fair_shares.py [--backlog 3000] [--max-tokens 64] [--probes 5] [--rounds 2] [--groups 32] [--varied]

Starts its own redis-server and one `tokenmill worker` on builtin:tiny (benchmarks/job_queue.py's `QueuePath`),
then, in one run, times a small job (one prompt, 16 tokens) from submit to result:

* alone, the worker idle;
* behind a backlog of `--backlog` jobs of `--max-tokens` tokens queued just before it by another client on the
  queue's own list (first in, first out: what every run got before shares);
* behind the same backlog queued in a share of its own (`Client(share=...)`, as `annotate --broker` runs and
  `serve` tenants queue), the small job from a plain client and from a client of another share.

`--groups N` queues the backlog as `annotate --broker` queues its rows (group messages of N jobs, `QueueRunner`);
`--varied` spreads its jobs' lengths evenly over 1..`--max-tokens` (outputs ending at EOS), where the default, every
job `--max-tokens` long, makes the running sequences end together, the longest wait for a free sequence slot.

Each backlog is cancelled once its probe is back, and the queue drained, before the next. Prints the median of
`--probes` probes per case (the two backlog layouts alternate over `--rounds`), each case's ratio to alone, and
where the probe's time went (`PHASES`, from its result's stamps).

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


def _length(index: int, max_tokens: int, varied: bool) -> int:
    """A backlog job's tokens: `max_tokens` each, or (`varied`) spread evenly over 1..`max_tokens` in a fixed
    shuffled order, as outputs that end at their EOS are."""
    return 1 + (index * 7919) % max_tokens if varied else max_tokens


def _queue_backlog(producer: Client, tag: str, backlog: int, max_tokens: int, varied: bool, groups: int
                   ) -> list[str]:
    """Queue the backlog in `producer`'s share: single-job messages, or (`groups` > 0) group messages of `groups`
    jobs as `annotate --broker` queues its rows (`QueueRunner`). Returns the job ids in queue order."""
    jobs = [_job(tag, i, _length(i, max_tokens, varied)) for i in range(backlog)]
    if not groups:
        return [handle.id for handle in producer.submit_many(jobs)]
    from tokenmill.apps.runners import QueueRunner, Unit

    units = [Unit(key=job["id"], prompt=job["prompt"], messages=None, job_id=job["id"],
                  sampling={k: job[k] for k in ("max_tokens", "ignore_eos", "temperature")}) for job in jobs]
    QueueRunner(producer, rows_per_message=groups, run_id=tag).submit(units)
    return [unit.job_id for unit in units]


#: Where a probe's time went, from its result's stamps (wall clock, worker and client on one host).
PHASES = ("queue", "engine queue", "decode", "result")


def probe(client: Client, phases: dict[str, list[float]] | None = None) -> float:
    """Seconds from submitting one small job to its result; with `phases`, each phase's seconds appended to it: in
    the queue (submit to the worker taking it), in the engine's queue (to its first token), decode (to its last) and
    the result's way back (to the client having it)."""
    submitted = time.time()
    started = time.perf_counter()
    handle = client.submit(_job(f"probe-{uuid.uuid4().hex[:8]}", 0, 16))
    result = handle.result(timeout=600)
    seconds = time.perf_counter() - started
    if phases is not None:
        stamps = [submitted, result.started_at, result.first_token_at, result.finished_at, submitted + seconds]
        for name, begin, end in zip(PHASES, stamps, stamps[1:]):
            phases.setdefault(name, []).append(end - begin)
    return seconds


def behind_backlog(path: job_queue.QueuePath, args: argparse.Namespace, share: str | None, prober: Client,
                   phases: dict[str, list[float]] | None = None) -> float:
    """A small job's time to result, submitted once the worker runs a backlog queued by another client (`probe`'s
    `phases`)."""
    tag = f"backlog-{uuid.uuid4().hex[:8]}"
    with Client(path.broker, share=share) as producer:
        handles = _queue_backlog(producer, tag, args.backlog, args.max_tokens, args.varied, args.groups)
        first = [DELIVERIES_KEY.format(job_id=h) for h in handles[:8]]
        job_queue.wait_until(lambda: all(path.pinged.mget(first)), 120, "the backlog running")
        seconds = probe(prober, phases)
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
    parser.add_argument("--varied", action="store_true",
                        help="backlog jobs of 1..--max-tokens tokens, spread evenly (outputs ending at EOS)")
    parser.add_argument("--groups", type=int, default=0,
                        help="the backlog in group messages of this many jobs, as annotate --broker queues (0: single)")
    args = parser.parse_args()
    cases: dict[str, list[float]] = {"alone": [], "fifo": [], "shares, plain client": [], "shares, another share": []}
    phases: dict[str, dict[str, list[float]]] = {name: {} for name in cases}
    with tempfile.TemporaryDirectory() as directory:
        path = job_queue.QueuePath(Path(directory), args.max_num_seqs, 1, None)
        other = Client(path.broker, share="probe-share")
        try:
            for _ in range(3):
                probe(path.client)  # warm
            for round_ in range(args.rounds):
                for _ in range(args.probes):
                    cases["alone"].append(probe(path.client, phases["alone"]))
                layouts = [("fifo", None, path.client), ("shares, plain client", "run-big", path.client),
                           ("shares, another share", "run-big", other)]
                for name, share, prober in layouts[:: 1 if round_ % 2 == 0 else -1]:
                    for _ in range(max(1, args.probes // args.rounds)):
                        cases[name].append(behind_backlog(path, args, share, prober, phases[name]))
            if args.serve_lines:
                served = serve_cases(path, Path(directory), args.serve_lines, args.max_tokens, args.probes)
        finally:
            other.close()
            path.close()
    alone = statistics.median(cases["alone"])
    backlog = (f"{args.backlog} jobs x {'1-' if args.varied else ''}{args.max_tokens} tokens"
               f"{f' in groups of {args.groups}' if args.groups else ''}")
    print(f"| a 16-token job ({backlog} queued just before it) | median s | "
          f"probes | / alone | {' | '.join(f'{phase} (median s)' for phase in PHASES)} |")
    print("|---|---|---|---|" + "---|" * len(PHASES))
    for name, seconds in cases.items():
        median = statistics.median(seconds)
        split = " | ".join(f"{statistics.median(phases[name][phase]):.3f}" for phase in PHASES)
        print(f"| {name} | {median:.3f} | {len(seconds)} | {median / alone:.1f}x | {split} |")
    if args.serve_lines:
        alone = statistics.median(served["serve: one-line batch alone"])
        for name, seconds in served.items():
            median = statistics.median(seconds)
            print(f"| {name} | {median:.3f} | {len(seconds)} | {median / alone:.1f}x |")


if __name__ == "__main__":
    main()
