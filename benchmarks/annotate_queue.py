"""Annotate benchmark, queue overhead: the same 2,000 short rows embedded vs distributed on one worker.

    python benchmarks/annotate_queue.py [--rows 2000] [--max-tokens 8] [--rows-per-message 32] [--rounds 5]

Starts its own redis-server and one `tokenmill worker` on builtin:tiny (as benchmarks/job_queue.py does),
loads the same model with the same engine options in this process, then runs `tokenmill.annotate` over one
generated JSONL dataset (distinct rows, EOS ignored so both paths generate exactly max_tokens per row):

* embedded: the engine in this process (`llm=`);
* distributed: `broker=...`, rows grouped `--rows-per-message` per `tokenmill.generate_batch` message.

Each run starts from an empty checkpoint and a template no earlier run used and is timed end to end (read, render, compute, checkpoint, write
the output). A round runs embedded, then distributed; its ratio embedded wall / distributed wall is the
distributed throughput relative to embedded (goal >= 0.9). The median of the rounds' ratios is reported, with
every round's figures and the machine load (`os.getloadavg`).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import tokenmill  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=2000)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--rows-per-message", type=int, default=32)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()

    from job_queue import LocalPath, QueuePath

    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp)
        data = directory / "rows.jsonl"
        data.write_text("".join(json.dumps({"id": i, "text": f"review number {i}: it was fine"}) + "\n" for i in range(args.rows)))
        load_before = os.getloadavg()
        queue = QueuePath(directory, args.max_num_seqs, args.threads, None)
        local = LocalPath(args.max_num_seqs, args.threads)
        options = dict(max_tokens=args.max_tokens, ignore_eos=True, quiet=True)

        # Each round has its own template: job ids are row keys, and a key computed in an earlier round would be
        # answered from its stored result (idempotency) instead of being generated.
        def embedded(name: str, rows: str = str(data)) -> float:
            template = f"[{name[1:]}] Classify the sentiment of: {{{{ text }}}}"
            return tokenmill.annotate(rows, str(directory / f"{name}.jsonl"), template, llm=local.llm, **options).wall_s

        def distributed(name: str, rows: str = str(data)) -> float:
            template = f"[{name[1:]}] Classify the sentiment of: {{{{ text }}}}"
            return tokenmill.annotate(rows, str(directory / f"{name}.jsonl"), template, broker=queue.broker,
                                      rows_per_message=args.rows_per_message, **options).wall_s

        try:
            warm = directory / "warm.jsonl"
            warm.write_text("".join(json.dumps({"text": f"warm {i}"}) + "\n" for i in range(600)))
            embedded("ewarm", str(warm))
            distributed("dwarm", str(warm))
            # This process holds the embedded model (~460,000 objects): a full garbage collection here takes
            # ~180 ms and lands in whichever path is running, the distributed client's included (a real
            # `annotate --broker` process holds no model). Frozen, as the worker's own processes freeze theirs.
            gc.collect()
            gc.freeze()
            walls: dict[str, list[float]] = {"embedded": [], "distributed": []}
            for r in range(args.rounds):
                walls["embedded"].append(embedded(f"e{r}"))
                walls["distributed"].append(distributed(f"d{r}"))
            same = all((directory / f"e{r}.jsonl").read_text() == (directory / f"d{r}.jsonl").read_text() for r in range(args.rounds))
        finally:
            gc.unfreeze()  # collectable again before exit (triton's bindings report frozen objects as leaks)
            queue.close()
        load_after = os.getloadavg()
    # Each round runs embedded then distributed back to back: the ratio of a round compares two runs under the
    # same machine speed, and the median of those ratios ignores a round that a load spike or a drift hit.
    median = {name: statistics.median(values) for name, values in walls.items()}
    ratios = [e / d for e, d in zip(walls["embedded"], walls["distributed"])]
    tokens = args.rows * args.max_tokens
    print(f"\n{args.rows} rows, max_tokens {args.max_tokens} (EOS ignored), builtin:tiny, max_num_seqs {args.max_num_seqs}, "
          f"{args.rows_per_message} rows per queue message, {args.rounds} round(s), medians")
    print("| | embedded | distributed (Redis + 1 worker) |\n|---|---:|---:|")
    print(f"| wall s | {median['embedded']:.2f} | {median['distributed']:.2f} |")
    print(f"| rows / s | {args.rows / median['embedded']:.0f} | {args.rows / median['distributed']:.0f} |")
    print(f"| generated tok / s | {tokens / median['embedded']:.0f} | {tokens / median['distributed']:.0f} |")
    print(f"\nratio distributed / embedded throughput (median of the rounds' ratios): {statistics.median(ratios):.2f} "
          f"(goal >= 0.9); outputs identical: {same}")
    print("per round, wall s embedded / distributed (ratio): "
          + ", ".join(f"{e:.2f} / {d:.2f} ({e / d:.2f})" for e, d in zip(walls["embedded"], walls["distributed"])))
    print(f"load average before {load_before[0]:.2f}, after {load_after[0]:.2f}")


if __name__ == "__main__":
    main()
