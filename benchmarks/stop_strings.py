#!/usr/bin/env python
"""A bystander's slowdown from a neighbour with many stop strings (issue 18 item 10).

Two greedy requests decode together on builtin:tiny, EOS ignored, `--max-tokens` each: a bystander without
stop strings and a neighbour. The neighbour first has no stop strings (baseline), then `--stops` stop strings
of `--stop-chars` characters that never match (`--stops 40000 --stop-chars 20`: the 829 KB job of the issue).
A version that refuses that many (the `stop` bounds) runs the largest neighbour it accepts instead:
`MAX_STOP_STRINGS` strings holding `MAX_STOP_CHARS` characters in all. Printed: wall time of the
bystander's run with each neighbour (median of `--rounds`) and the ratio.

    python benchmarks/stop_strings.py
    PYTHONPATH=/path/to/other/checkout python benchmarks/stop_strings.py   # the same on another version
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import string
import sys
import time

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]

import torch  # noqa: E402

from tokenmill import InvalidRequestError, SamplingParams  # noqa: E402
from tokenmill.engine.llm_engine import LLMEngine  # noqa: E402


def neighbour_stops(count: int, chars: int) -> list[str]:
    """`count` random stop strings of `chars` characters (with a character no output decodes to), or the largest
    set this version accepts."""
    rng = random.Random(0)
    stops = ["\x01" + "".join(rng.choices(string.ascii_letters, k=chars - 1)) for _ in range(count)]
    try:
        SamplingParams(stop=stops)
        return stops
    except InvalidRequestError as exc:
        from tokenmill.sampling_params import MAX_STOP_CHARS, MAX_STOP_STRINGS

        print(f"refused ({exc}); using the bound: {MAX_STOP_STRINGS} strings, {MAX_STOP_CHARS} characters in all")
        each = MAX_STOP_CHARS // MAX_STOP_STRINGS
        return ["\x01" + "".join(rng.choices(string.ascii_letters, k=each - 1)) for _ in range(MAX_STOP_STRINGS)]


def bystander_seconds(engine: LLMEngine, stops: list[str], max_tokens: int, run: int) -> float:
    bystander = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    neighbour = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, stop=stops)
    started = time.perf_counter()
    engine.add_request(f"bystander-{run}", "The bystander's prompt", bystander)
    engine.add_request(f"neighbour-{run}", "The neighbour's prompt", neighbour)
    finished: set[str] = set()
    while f"bystander-{run}" not in finished:
        finished.update(output.request_id for output in engine.step())
    elapsed = time.perf_counter() - started
    while engine.has_unfinished():
        engine.step()
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stops", type=int, default=40_000)
    parser.add_argument("--stop-chars", type=int, default=20)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    engine = LLMEngine("builtin:tiny", num_kv_blocks=256)
    stops = neighbour_stops(args.stops, args.stop_chars)
    bystander_seconds(engine, [], args.max_tokens, -1)  # warm-up
    plain, stopped = [], []
    for run in range(args.rounds):  # alternated, so both see the same machine load
        plain.append(bystander_seconds(engine, [], args.max_tokens, 2 * run))
        stopped.append(bystander_seconds(engine, stops, args.max_tokens, 2 * run + 1))
    base, slow = statistics.median(plain), statistics.median(stopped)
    size = sum(len(s) for s in stops)
    print(f"neighbour: {len(stops)} stop strings, {size} characters; max_tokens {args.max_tokens}")
    print(f"bystander wall s (median of {args.rounds}): neighbour without stops {base:.3f}, with stops {slow:.3f}")
    print(f"slowdown {slow / base:.2f}x")


if __name__ == "__main__":
    main()
