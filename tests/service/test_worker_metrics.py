"""`FinishedJobs` keeps the finished jobs' counts and histograms as plain numbers: scraped, it must read exactly as
prometheus-client's own `Counter`s and `Histogram`s fed the same jobs (but for the creation times)."""

from __future__ import annotations

import re

from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from tokenmill.worker.metrics import _LATENCY_BUCKETS, FinishedJobs

seconds = st.floats(0, 5000, allow_nan=False) | st.sampled_from([float(b) for b in _LATENCY_BUCKETS])
jobs = st.tuples(st.none() | st.integers(0, 10_000), st.integers(0, 10_000), st.none() | seconds, st.none() | seconds)


def _text(registry: CollectorRegistry) -> str:
    """The exposition, creation times blanked (each registry made its metrics at its own moment)."""
    return re.sub(r"(_created(\{[^}]*\})?) \S+", r"\1 T", generate_latest(registry).decode())


@settings(max_examples=150, deadline=None)
@given(st.lists(jobs, max_size=12), st.lists(st.lists(seconds, max_size=5), max_size=3))
def test_finished_jobs_read_as_prometheus_clients_own_metrics(succeeded: list, waits: list) -> None:
    mine, theirs = CollectorRegistry(), CollectorRegistry()
    finished = FinishedJobs(mine)
    count, prompt, generated = (Counter(name, text, registry=theirs) for name, text in FinishedJobs._COUNTERS)
    wait, latency, first = (Histogram(name, text, buckets=_LATENCY_BUCKETS, registry=theirs)
                            for name, text in FinishedJobs._HISTOGRAMS)
    for prompt_tokens, completion_tokens, total, ttft in succeeded:
        finished.succeeded(prompt_tokens, None if prompt_tokens is None else completion_tokens, total, ttft)
        count.inc()
        if prompt_tokens is not None:
            prompt.inc(prompt_tokens)
            generated.inc(completion_tokens)
        if total is not None:
            latency.observe(total)
        if ttft is not None:
            first.observe(ttft)
    for group in waits:
        finished.queue_waits(group)
        for value in group:
            wait.observe(value)
    assert _text(mine) == _text(theirs)


def test_finished_jobs_names_are_checked_for_clashes() -> None:
    registry = CollectorRegistry(auto_describe=True)
    FinishedJobs(registry)
    try:
        Counter("tokenmill_jobs_succeeded", "again", registry=registry)
    except ValueError as exc:
        assert "Duplicated timeseries" in str(exc)
    else:
        raise AssertionError("a second tokenmill_jobs_succeeded was registered")
