"""Redis memory per queued job, per finished job and per dead letter, measured on a real redis-server.

    python benchmarks/redis_memory.py [--jobs 1000] [--prompt-chars 1000] [--max-tokens 256]

Starts its own redis-server (no persistence, a free port) and one `tokenmill worker` on builtin:tiny, then:

1. queued: `submit_many` of N typical jobs (an English-like prompt of --prompt-chars characters, sampling
   settings, a small metadata dict) with no worker consuming yet; reports `INFO memory` used_memory growth
   per job and `MEMORY USAGE` of the queue list per job, plus the encoded message size;
2. finished: a worker runs them all (--max-tokens generated tokens each, EOS ignored, so every result has
   the full text and token ids); reports the growth over the empty baseline per job once the queue and the
   `unacked` hash are empty, and the mean `MEMORY USAGE` of a result key and of a delivery-counter key;
3. dead letters: N entries pushed the way a worker pushes them; `MEMORY USAGE` of the list per entry.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import redis

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tokenmill.client import Client  # noqa: E402
from tokenmill.queue import dead_letters  # noqa: E402
from tokenmill.queue.names import DEAD_LETTER_KEY, DELIVERIES_KEY  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from job_queue import free_port, wait_until  # noqa: E402  (one copy of the benchmarks' process helpers)

WORDS = "the mill grinds tokens from prompts while workers keep the batch full and results flow back".split()


def prompt(index: int, chars: int) -> str:
    words, length = [], 0
    while length < chars:
        word = WORDS[(index * 7 + len(words) * 3) % len(WORDS)]
        words.append(word)
        length += len(word) + 1
    return " ".join(words)[:chars]


def used_memory(client: redis.Redis) -> int:
    return int(client.info("memory")["used_memory"])


def mean_usage(client: redis.Redis, keys: list[bytes]) -> float:
    return sum(client.memory_usage(key, samples=0) or 0 for key in keys) / max(1, len(keys))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=1000)
    parser.add_argument("--prompt-chars", type=int, default=1000)
    parser.add_argument("--max-tokens", type=int, default=256)
    args = parser.parse_args()
    server = shutil.which("redis-server") or sys.exit("redis-server not found")
    workdir = Path(tempfile.mkdtemp(prefix="tokenmill-memory-"))
    port = free_port()
    redis_process = subprocess.Popen([server, "--port", str(port), "--bind", "127.0.0.1", "--dir", str(workdir),
                                      "--save", "", "--appendonly", "no"], stdout=subprocess.DEVNULL)
    url = f"redis://127.0.0.1:{port}/0"
    store = redis.Redis(port=port)
    worker = None
    try:
        wait_until(lambda: _pings(store), 10, "redis-server")
        client = Client(url)
        client.app.connection_for_write().ensure_connection()
        store.set("warm", 1)  # first-use allocations (client buffers) out of the baseline
        time.sleep(0.2)
        baseline = used_memory(store)
        jobs = [{"id": f"job-{i:06d}", "prompt": prompt(i, args.prompt_chars), "max_tokens": args.max_tokens,
                 "temperature": 0.7, "top_p": 0.95, "seed": i, "ignore_eos": True, "metadata": {"row": i, "split": "train"}}
                for i in range(args.jobs)]
        handles = client.submit_many(jobs)
        queued = used_memory(store) - baseline
        queue_usage = store.memory_usage(client.queue, samples=0)
        message_bytes = len(store.lindex(client.queue, 0))
        print(f"queued ({args.jobs} jobs, prompt {args.prompt_chars} chars): used_memory +{queued / args.jobs:.0f} B/job, "
              f"MEMORY USAGE of the queue {queue_usage / args.jobs:.0f} B/job, message {message_bytes} B")

        log_path = workdir / "worker.log"
        env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
        command = [sys.executable, "-m", "tokenmill.cli", "worker", "--broker", url, "--model", "builtin:tiny",
                   "--metrics-port", "0", "--hostname", "memory@%h", "--max-num-seqs", "64"]
        worker = subprocess.Popen(command, stdout=open(log_path, "wb"), stderr=subprocess.STDOUT, env=env, cwd=REPO)
        started = time.perf_counter()
        results = client.results(handles, timeout=3600)
        assert all(r.ok and len(r.token_ids) == args.max_tokens for r in results)
        print(f"ran {args.jobs} jobs in {time.perf_counter() - started:.0f}s")
        worker.terminate()
        worker.wait(timeout=120)
        worker = None
        wait_until(lambda: store.llen(client.queue) == 0 and store.hlen("unacked") == 0, 30, "an empty queue")
        finished = used_memory(store) - baseline
        result_keys = list(store.scan_iter("celery-task-meta-*", count=1000))
        delivery_keys = [DELIVERIES_KEY.format(job_id=j["id"]).encode() for j in jobs if store.exists(DELIVERIES_KEY.format(job_id=j["id"]))]
        text_chars = sum(len(r.text) for r in results) / len(results)
        print(f"finished ({args.max_tokens} tokens, {text_chars:.0f} text chars each): used_memory +{finished / args.jobs:.0f} B/job "
              f"over the empty baseline, result key {mean_usage(store, result_keys):.0f} B ({len(result_keys)} keys), "
              f"delivery counter {mean_usage(store, delivery_keys):.0f} B ({len(delivery_keys)} keys)")

        store.delete(DEAD_LETTER_KEY)
        for job in jobs:
            dead_letters.push(store, client.prepare(job), "delivered 6 times and no earlier delivery finished", 6,
                              max_len=10 * args.jobs, expires=86400)
        usage = store.memory_usage(DEAD_LETTER_KEY, samples=0)
        print(f"dead letters: MEMORY USAGE {usage / args.jobs:.0f} B/entry ({store.llen(DEAD_LETTER_KEY)} entries)")
        client.close()
    finally:
        if worker is not None:
            worker.kill()
        redis_process.kill()
        shutil.rmtree(workdir, ignore_errors=True)


def _pings(store: redis.Redis) -> bool:
    try:
        return bool(store.ping())
    except redis.RedisError:
        return False


if __name__ == "__main__":
    main()
