"""`tokenmill serve`'s resources while one tenant holds many batches, and another tenant's batches meanwhile.

    python benchmarks/serve_tenants.py [--batches 800] [--bob-batches 20] [--sample 0.25]

Starts its own redis-server, one `tokenmill worker` on builtin:tiny (benchmarks/job_queue.py's `QueuePath`) and one
`tokenmill serve` (benchmarks/serve.py's `start_server`) with two tenants, alice and bob, and alice's limits raised
so that she may hold every batch at once (TOKENMILL_MAX_ACTIVE_BATCHES, TOKENMILL_RATE_LIMIT, TOKENMILL_RATE_BURST).
Alice uploads one one-line file and creates `--batches` batches of it (8 threads) while the worker is stopped
(SIGSTOP), so that she holds them all active at once; two seconds later the worker goes on (SIGCONT), bob uploads his
own file and creates `--bob-batches` batches, and both poll until every batch is final.

Meanwhile the server process is sampled every `--sample` seconds: its threads (/proc/<pid>/task), open descriptors
(/proc/<pid>/fd) and Redis connections: every client of `CLIENT LIST` and the server's own (those whose address is a
socket of the server process, from /proc/<pid>/net/tcp), and of those the subscribed ones. Prints the peaks, the
figures when alice held the most active batches, whether every bob batch completed and how long each took from its
creation, and alice's completion.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import serve  # noqa: E402  (imports job_queue, which drops this folder from sys.path again)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "service"))
from service_fixtures import socket_ports  # noqa: E402

job_queue = serve.job_queue

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from concurrent.futures import ThreadPoolExecutor  # noqa: E402

import redis  # noqa: E402

FINAL = ("completed", "failed", "cancelled", "expired")
KEYS = {"alice": "sk-alice-bench", "bob": "sk-bob-bench"}


class Sampler(threading.Thread):
    """The server's threads, descriptors and Redis connections every `interval` seconds."""

    def __init__(self, pid: int, broker: str, interval: float) -> None:
        super().__init__(daemon=True)
        self.pid, self.interval = pid, interval
        self.redis = redis.Redis.from_url(broker)
        self.samples: list[dict[str, int]] = []
        self.stopping = threading.Event()

    def sample(self) -> dict[str, int]:
        clients = self.redis.client_list()
        ports = socket_ports(self.pid)
        own = [c for c in clients if int(c["addr"].rsplit(":", 1)[1]) in ports]
        active = self.redis.scard("tokenmill:api:active")
        return {"threads": len(os.listdir(f"/proc/{self.pid}/task")), "fds": len(os.listdir(f"/proc/{self.pid}/fd")),
                "redis_clients": len(clients), "server_redis": len(own),
                "server_subscribed": sum(int(c["sub"]) > 0 for c in own), "active": active}

    def run(self) -> None:
        while not self.stopping.is_set():
            try:
                self.samples.append(self.sample())
            except (OSError, redis.RedisError):
                pass
            self.stopping.wait(self.interval)


def one_line_file(path: Path, tag: str) -> Path:
    body = {"model": "builtin:tiny", "messages": [{"role": "user", "content": f"{tag} hello"}], "max_tokens": 4,
            "temperature": 0}
    path.write_text(json.dumps({"custom_id": "r0", "method": "POST", "url": "/v1/chat/completions", "body": body}) + "\n")
    return path


def wait_final(client, ids: list[str], created: dict[str, float], deadline: float) -> dict[str, tuple[str, float]]:
    """Each batch's final status and seconds from its creation to when this poll saw it final."""
    done: dict[str, tuple[str, float]] = {}
    while len(done) < len(ids) and time.monotonic() < deadline:
        for batch_id in ids:
            if batch_id not in done:
                found = client.batches.retrieve(batch_id)
                if found.status in FINAL:
                    done[batch_id] = (found.status, time.monotonic() - created[batch_id])
        time.sleep(0.5)
    return done


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, default=800, help="alice's one-line batches")
    parser.add_argument("--bob-batches", type=int, default=20)
    parser.add_argument("--sample", type=float, default=0.25, help="seconds between samples of the server")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds to wait for every batch to end")
    parser.add_argument("--max-num-seqs", type=int, default=64)
    args = parser.parse_args()
    from openai import OpenAI

    os.environ.update(TOKENMILL_MAX_ACTIVE_BATCHES=str(args.batches + 1), TOKENMILL_RATE_LIMIT="1000000",
                      TOKENMILL_RATE_BURST="100000")
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp)
        path = job_queue.QueuePath(directory, args.max_num_seqs, threads=1, concurrency=None)
        server, port = serve.start_server(path.broker, directory, ",".join(f"{t}={k}" for t, k in KEYS.items()))
        clients = {t: OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=k, max_retries=0) for t, k in KEYS.items()}
        sampler = Sampler(server.pid, path.broker, args.sample)
        idle = sampler.sample()
        sampler.start()
        created: dict[str, float] = {}
        try:
            alice = clients["alice"]
            file_id = alice.files.create(file=one_line_file(directory / "a.jsonl", "alice").open("rb"), purpose="batch").id

            def create(client, file_id: str) -> str:
                batch = client.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions",
                                              completion_window="24h")
                created[batch.id] = time.monotonic()
                return batch.id

            workers = [pid for pid in (path.worker.pid, path.engine_pid) if pid]
            for pid in workers:
                os.kill(pid, signal.SIGSTOP)
            started = time.monotonic()
            with ThreadPoolExecutor(8) as pool:
                alice_ids = list(pool.map(lambda _: create(alice, file_id), range(args.batches)))
            alice_created = time.monotonic() - started
            time.sleep(2)  # samples of the server holding them all
            for pid in workers:
                os.kill(pid, signal.SIGCONT)
            bob = clients["bob"]
            bob_file = bob.files.create(file=one_line_file(directory / "b.jsonl", "bob").open("rb"), purpose="batch").id
            bob_ids = [create(bob, bob_file) for _ in range(args.bob_batches)]
            deadline = time.monotonic() + args.timeout
            bob_done = wait_final(bob, bob_ids, created, deadline)
            bob_finished = time.monotonic() - started
            alice_done = wait_final(alice, alice_ids, created, deadline)
            alice_finished = time.monotonic() - started
        finally:
            sampler.stopping.set()
            sampler.join()
            server.kill()
            server.wait()
            path.close()
    samples = sampler.samples
    peak = {name: max(s[name] for s in samples) for name in samples[0]}
    busiest = max(samples, key=lambda s: s["active"])
    bob_ok = sum(status == "completed" for status, _ in bob_done.values())
    alice_ok = sum(status == "completed" for status, _ in alice_done.values())
    bob_waits = sorted(seconds for _, seconds in bob_done.values())
    print(f"alice: {args.batches} one-line batches created in {alice_created:.1f} s; bob: {args.bob_batches} after them")
    print(f"server at rest: {idle['threads']} threads, {idle['fds']} fds, {idle['server_redis']} Redis connections "
          f"({idle['redis_clients']} clients on the Redis)")
    print(f"peak ({len(samples)} samples every {args.sample:g} s): {peak['threads']} threads, {peak['fds']} fds, "
          f"{peak['server_redis']} Redis connections of the server ({peak['redis_clients']} clients on the Redis; "
          f"{peak['server_subscribed']} of the server's subscribed), {peak['active']} active batches")
    print(f"at the most active batches ({busiest['active']}): {busiest['threads']} threads, {busiest['fds']} fds, "
          f"{busiest['server_redis']} server Redis connections")
    print(f"bob: {bob_ok}/{args.bob_batches} completed"
          + (f", creation to completion median {statistics.median(bob_waits):.1f} s, max {bob_waits[-1]:.1f} s, all "
             f"done {bob_finished:.1f} s after alice's first" if bob_waits else ""))
    print(f"alice: {alice_ok}/{args.batches} completed, all final {alice_finished:.1f} s after her first")


if __name__ == "__main__":
    main()
