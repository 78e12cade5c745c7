"""The worker and its engine process never wedge each other on their pipes, whatever crosses them at once.

Bursts of adds from several threads, cancels and aborts of requests in flight, and a stream of finished outputs, with
the worker's reader slowed down: both pipes fill. Every request must still be answered exactly once (its output, its
cancelled output, or `CancelledError` for an abort), within a bound. A real engine process on builtin:tiny.
"""

from __future__ import annotations

import multiprocessing
import random
import threading
import time
from collections import Counter
from concurrent.futures import CancelledError
from typing import Any

import pytest

from tokenmill.sampling_params import SamplingParams
from tokenmill.worker.engine_process import EngineOutput, EngineProcess

REQUESTS_PER_SENDER = 1_500
SENDERS = 3
GROUP = 50
DEADLINE = 120.0  # seconds for everything to be answered (~10 s here); wedged pipes answer nothing more, ever


@pytest.fixture(scope="module")
def engine() -> Any:
    engine = EngineProcess("builtin:tiny", {"max_model_len": 64, "max_num_seqs": 256})
    engine.start(timeout=300)
    yield engine
    for child in multiprocessing.active_children():  # a wedged engine could not read a stop
        child.kill()
    engine.stop(timeout=5)


def test_bursts_of_adds_cancels_and_outputs_are_each_answered_once(engine: EngineProcess, random_seed: int) -> None:
    rng = random.Random(random_seed)
    answers: Counter[str] = Counter()
    kinds: dict[str, str] = {}
    answered = threading.Condition()
    sent: list[str] = []
    sent_lock = threading.Lock()

    def slow_sink(request_id: str, answer: Any) -> None:
        """The reader thread, slowed: it falls behind the engine's outputs, whose pipe fills."""
        if len(answers) % 8 == 0:
            time.sleep(0.002)
        with answered:
            answers[request_id] += 1
            kinds[request_id] = ("cancelled" if isinstance(answer, CancelledError) else
                                 answer.finish_reason if isinstance(answer, EngineOutput) else type(answer).__name__)
            answered.notify_all()

    def send(sender: int, seed: int) -> None:
        local = random.Random(seed)
        for first in range(0, REQUESTS_PER_SENDER, GROUP):
            group = []
            for n in range(first, first + GROUP):
                params = SamplingParams(max_tokens=local.randint(1, 12), temperature=0.0, ignore_eos=True)
                prompt = [local.randint(3, 200) for _ in range(local.randint(1, 24))]
                group.append((f"s{sender}-{n}", params, prompt, None, None))
            engine.send_many(group, slow_sink)
            with sent_lock:
                sent.extend(request_id for request_id, *_ in group)

    def interrupt(seed: int, stop: threading.Event) -> None:
        """Bursts of cancels (a Ctrl-C of a run) and a few aborts, of requests sent and maybe finished."""
        local = random.Random(seed)
        while not stop.is_set():
            with sent_lock:
                burst = local.sample(sent, min(len(sent), local.randint(50, 400)))
            for request_id in burst:
                if local.random() < 0.05:
                    engine.abort(request_id)
                else:
                    engine.cancel(request_id, "cancelled")
            time.sleep(local.uniform(0.0, 0.05))

    stop = threading.Event()
    threads = [threading.Thread(target=send, args=(n, rng.randrange(2**32)), daemon=True) for n in range(SENDERS)]
    threads.append(threading.Thread(target=interrupt, args=(rng.randrange(2**32), stop), daemon=True))
    for thread in threads:
        thread.start()
    total = SENDERS * REQUESTS_PER_SENDER
    with answered:
        done = answered.wait_for(lambda: len(answers) >= total, timeout=DEADLINE)
    stop.set()
    assert done, (f"{len(answers)} of {total} requests answered in {DEADLINE:.0f}s: the pipes are wedged; threads: "
                  f"{[t.name for t in threads if t.is_alive()]}")
    for thread in threads:
        thread.join(timeout=30)
        assert not thread.is_alive(), "a sender or the canceller is still blocked"
    time.sleep(1.0)  # time for a second answer to any request to arrive
    assert sorted(answers) == sorted(sent) and len(sent) == total
    twice = [request_id for request_id, count in answers.items() if count != 1]
    assert not twice, f"answered more than once: {twice[:10]}"
    assert set(kinds.values()) <= {"length", "cancelled"}, Counter(kinds.values())
    assert Counter(kinds.values())["cancelled"] > 0 and Counter(kinds.values())["length"] > 0
