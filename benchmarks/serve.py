"""`tokenmill serve` against `tokenmill batch --broker`: the same kind of file on the same worker.

    python benchmarks/serve.py [--lines 10000] [--max-tokens 16] [--rounds 2]

Starts its own redis-server, one `tokenmill worker` on builtin:tiny (benchmarks/job_queue.py's `QueuePath`) and
one `tokenmill serve` subprocess. Each round runs one file through `tokenmill.apps.batch.batch(broker=...)` and
one through the server with the `openai` SDK (upload, create, poll every 0.2 s, download the output), the two
alternating which goes first; every file has the same shape (lines, prompt lengths, max_tokens) but new prompts, so
no stored result is reused. Reports each path's median wall time, their ratio (serve / batch throughput; the goal
is >= 0.95x) and the server process's CPU seconds per line (user + system, from /proc).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import job_queue  # noqa: E402  (drops this folder from sys.path again: its name shadows the stdlib's queue)

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import urllib.request  # noqa: E402

from tokenmill.apps.batch import batch  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
KEY = "sk-bench"


def write_file(path: Path, lines: int, max_tokens: int, tag: str) -> Path:
    with open(path, "w") as out:
        for i in range(lines):
            body = {"model": "builtin:tiny", "messages": [{"role": "user", "content": f"{tag} line {i}"}],
                    "max_tokens": max_tokens, "temperature": 0}
            out.write(json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions", "body": body}) + "\n")
    return path


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def start_server(broker: str, directory: Path, keys: str = KEY) -> tuple[subprocess.Popen, int]:
    port = job_queue.free_port()
    env = {**os.environ, "PYTHONPATH": str(REPO), "TOKENMILL_API_KEYS": keys}
    process = subprocess.Popen([sys.executable, "-m", "tokenmill.cli", "serve", "--broker", broker, "--port", str(port),
                                "--files-dir", str(directory / "files"), "--log-level", "warning"],
                               stdout=open(directory / "serve.log", "wb"), stderr=subprocess.STDOUT, env=env, cwd=REPO)

    def answers() -> bool:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=2)
        except urllib.error.HTTPError:
            return True
        except OSError:
            return False
        return True

    job_queue.wait_until(answers, 60, "tokenmill serve")
    return process, port


def through_serve(client, path: Path) -> float:
    started = time.perf_counter()
    with open(path, "rb") as handle:
        file = client.files.create(file=handle, purpose="batch")
    created = client.batches.create(input_file_id=file.id, endpoint="/v1/chat/completions", completion_window="24h")
    while (found := client.batches.retrieve(created.id)).status not in ("completed", "failed", "cancelled", "expired"):
        time.sleep(0.2)
    assert found.status == "completed" and found.request_counts.failed == 0, found
    client.files.content(found.output_file_id).read()
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lines", type=int, default=10_000)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    args = parser.parse_args()
    from openai import OpenAI

    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp)
        path = job_queue.QueuePath(directory, args.max_num_seqs, threads=1, concurrency=None)
        server, port = start_server(path.broker, directory)
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=KEY, max_retries=0)
        walls: dict[str, list[float]] = {"batch": [], "serve": []}
        cpu = 0.0
        try:
            for round_ in range(args.rounds):
                order = ["batch", "serve"] if round_ % 2 == 0 else ["serve", "batch"]
                for kind in order:
                    source = write_file(directory / f"{kind}{round_}.jsonl", args.lines, args.max_tokens, f"{kind} {round_}")
                    if kind == "batch":
                        started = time.perf_counter()
                        batch(str(source), str(directory / f"out{round_}.jsonl"), broker=path.broker, quiet=True)
                        walls[kind].append(time.perf_counter() - started)
                    else:
                        before = cpu_seconds(server.pid)
                        walls[kind].append(through_serve(client, source))
                        cpu += cpu_seconds(server.pid) - before
        finally:
            server.kill()
            path.close()
    serve_s, batch_s = statistics.median(walls["serve"]), statistics.median(walls["batch"])
    print(f"{args.lines} lines x {args.max_tokens} tokens, {args.rounds} rounds: tokenmill batch --broker "
          f"{batch_s:.2f} s, tokenmill serve {serve_s:.2f} s (throughput ratio {batch_s / serve_s:.2f}x); "
          f"server CPU {cpu / (args.rounds * args.lines) * 1000:.2f} ms per line")


if __name__ == "__main__":
    main()
