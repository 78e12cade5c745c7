"""`tokenmill health`: exit 0 only while the worker's engine is serving (the container healthcheck).

Reads `HEARTBEAT_METRIC` from the worker's metrics endpoint (up only once the model is loaded); the engine reports
every 0.5 s, idle or busy, so a report older than `max_age` means it is not serving. Torch-free; one HTTP request.
See docs/internals/worker.md, section "The engine process".
"""

from __future__ import annotations

import time
import urllib.error
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

HEARTBEAT_METRIC = "tokenmill_engine_last_status_timestamp_seconds"


def engine_problem(url: str, max_age: float, timeout: float = 5.0, now: float | None = None) -> str | None:
    """None when the engine behind the metrics endpoint `url` reported within `max_age` seconds, else why not."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            text = response.read().decode()
    except (urllib.error.URLError, OSError) as exc:
        return f"metrics endpoint {url} does not answer ({exc}); the engine is still loading or the worker is down"
    samples = [s for family in text_string_to_metric_families(text) for s in family.samples if s.name == HEARTBEAT_METRIC]
    if not samples or samples[0].value <= 0:
        return f"{url} has no engine status report yet ({HEARTBEAT_METRIC})"
    age = (time.time() if now is None else now) - samples[0].value
    if age > max_age:
        return f"the engine last reported {age:.0f}s ago (more than {max_age:g}s): it is not serving"
    return None
