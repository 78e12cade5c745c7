"""Prometheus metrics of a worker, served on `--metrics-port` (or the next free port, up to `--metrics-port-tries`;
0: no endpoint). Counters are cumulative; engine gauges follow the engine process's status reports.
See docs/internals/worker.md, section "The engine process".
"""

from __future__ import annotations

import bisect
import errno
import logging
import threading
import time
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

from prometheus_client import REGISTRY as DEFAULT_REGISTRY
from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.samples import Sample
from prometheus_client.utils import floatToGoString

from tokenmill.worker.engine_process import EngineStatus

if TYPE_CHECKING:
    from wsgiref.simple_server import WSGIServer

log = logging.getLogger(__name__)

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800, 3600)


class WorkerMetrics:
    """All metrics of one worker process, registered in one registry."""

    def __init__(self, registry: CollectorRegistry = DEFAULT_REGISTRY) -> None:
        self.registry = registry
        self.port: int | None = None  # where the endpoint listens, once `serve` found a free port
        self._server: WSGIServer | None = None  # the endpoint's HTTP server, once `serve` started it
        self.jobs_cancelled = Counter("tokenmill_jobs_cancelled", "Jobs ended by a cancel, before or while running.",
                                      registry=registry)
        self.jobs_failed = Counter(
            "tokenmill_jobs_failed", "Jobs finished with an error, by error code.", ["code"], registry=registry
        )
        self.jobs_in_flight = Gauge("tokenmill_jobs_in_flight", "Jobs this worker holds now.", registry=registry)
        self.finished = FinishedJobs(registry)
        self.tokens_per_second = Gauge(
            "tokenmill_generation_tokens_per_second", "Tokens generated per second (last interval).", registry=registry
        )
        self.running = Gauge("tokenmill_running_sequences", "Sequences in the running batch.", registry=registry)
        self.waiting = Gauge("tokenmill_waiting_sequences", "Sequences waiting for KV cache space.", registry=registry)
        self.kv_usage = Gauge("tokenmill_kv_cache_usage_ratio", "Fraction of KV cache blocks in use.", registry=registry)
        self.engine_steps = Counter("tokenmill_engine_steps", "Engine steps (one forward pass each).", registry=registry)
        self.engine_last_status = Gauge(
            "tokenmill_engine_last_status_timestamp_seconds",
            "Unix time of the engine process's last status report (every 0.5 s while it serves; `tokenmill health`).",
            registry=registry,
        )
        self.engine_stalled = Gauge(
            "tokenmill_engine_stalled_seconds", "Seconds the engine has held jobs without a step or a message (0 while "
            "it makes progress); the worker exits at --engine-stall-timeout.", registry=registry)
        self.output_retries = Counter(
            "tokenmill_output_write_retries", "Failed attempts to write a result to S3 (retried).", registry=registry
        )

    def serve(self, port: int, addr: str = "127.0.0.1", tries: int = 1) -> int | None:
        """Start the HTTP endpoint (a daemon thread) on `port` or the first free one of the `tries` after it. Returns
        the port (also `self.port`); None when `port` is 0. Raises OSError when every port tried is taken."""
        if not port:
            log.info("metrics endpoint off (--metrics-port 0)")
            return None
        last = min(port + tries - 1, 65535)
        for candidate in range(port, last + 1):
            try:
                self._server, _ = start_http_server(candidate, addr=addr, registry=self.registry)
            except OSError as exc:
                if exc.errno != errno.EADDRINUSE:
                    raise
                continue
            self.port = candidate
            moved = f" ({port} was taken)" if candidate != port else ""
            log.info("metrics endpoint on http://%s:%d/metrics%s", addr, candidate, moved)
            return candidate
        raise OSError(errno.EADDRINUSE, f"metrics ports {port}-{last} are all in use; set --metrics-port or --metrics-port-tries")

    def close(self) -> None:
        """Stop the endpoint and unregister every metric, so that another `WorkerMetrics` may register (a service
        built again after a failed start)."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server, self.port = None, None
        for collector in vars(self).values():
            if isinstance(collector, (MetricWrapperBase, FinishedJobs)):
                self.registry.unregister(collector)

    def on_engine_status(self, stats: EngineStatus) -> None:
        self.running.set(stats.num_running)
        self.waiting.set(stats.num_waiting)
        self.kv_usage.set(stats.kv_cache_usage)
        self.tokens_per_second.set(stats.generated_tokens_per_s)
        self.engine_steps.inc(stats.new_steps)
        self.engine_last_status.set_to_current_time()


class FinishedJobs:
    """The succeeded jobs' counters and the latency histograms (`_COUNTERS`, `_HISTOGRAMS`) as plain numbers under
    one lock, made into metric families when scraped (a custom collector): the samples of `Counter`s and
    `Histogram`s at one lock per job instead of six."""

    _COUNTERS = (("tokenmill_jobs_succeeded", "Jobs finished with a result."),
                 ("tokenmill_prompt_tokens", "Prompt tokens of finished jobs."),
                 ("tokenmill_generated_tokens", "Tokens generated for finished jobs."))
    _HISTOGRAMS = (("tokenmill_queue_wait_seconds", "Submit to start of work on a worker."),
                   ("tokenmill_job_latency_seconds", "Submit to result written."),
                   ("tokenmill_time_to_first_token_seconds", "Start of work to first token."))

    def __init__(self, registry: CollectorRegistry) -> None:
        self._lock = threading.Lock()
        self._created = time.time()
        self._counts = [0, 0, 0]  # per `_COUNTERS`
        self._buckets = [[0] * (len(_LATENCY_BUCKETS) + 1) for _ in self._HISTOGRAMS]  # per bucket, not cumulative
        self._sums = [0.0] * len(self._HISTOGRAMS)
        registry.register(self)

    def succeeded(self, prompt_tokens: int | None, completion_tokens: int | None, latency: float | None,
                  first_token: float | None) -> None:
        """One succeeded job: its token counts (None: unknown), submit -> result and start -> first token (None: unknown)."""
        with self._lock:
            self._counts[0] += 1
            if prompt_tokens is not None:
                self._counts[1] += prompt_tokens
                self._counts[2] += completion_tokens or 0
            if latency is not None:
                self._observe(1, latency)
            if first_token is not None:
                self._observe(2, first_token)

    def queue_waits(self, seconds: Iterable[float]) -> None:
        """Submit -> start of work of jobs handed to the engine together."""
        with self._lock:
            for value in seconds:
                self._observe(0, value)

    def _observe(self, histogram: int, value: float) -> None:
        self._buckets[histogram][bisect.bisect_left(_LATENCY_BUCKETS, value)] += 1  # le: the first bound >= value
        self._sums[histogram] += value

    def describe(self) -> list[Metric]:
        return [*(CounterMetricFamily(name, text) for name, text in self._COUNTERS),
                *(HistogramMetricFamily(name, text) for name, text in self._HISTOGRAMS)]

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            counts, buckets, sums = list(self._counts), [list(b) for b in self._buckets], list(self._sums)
        for (name, text), value in zip(self._COUNTERS, counts):
            yield CounterMetricFamily(name, text, value=float(value), created=self._created)
        bounds = [*map(floatToGoString, _LATENCY_BUCKETS), "+Inf"]
        for (name, text), counted, total in zip(self._HISTOGRAMS, buckets, sums):
            cumulative, running = [], 0
            for bound, count in zip(bounds, counted):
                running += count
                cumulative.append((bound, float(running)))
            family = HistogramMetricFamily(name, text, buckets=cumulative, sum_value=total)
            family.samples.append(Sample(f"{name}_created", {}, self._created))
            yield family
