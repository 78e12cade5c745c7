"""`tokenmill health`: exit 0 only while the worker's engine is serving (the container healthcheck).

"The process exists" is not enough: a worker whose engine hangs keeps its Celery consumer alive and
keeps taking jobs it never finishes. So the check asks the worker's metrics endpoint, which starts only
once the engine process has loaded the model, for `tokenmill_engine_last_status_timestamp_seconds`:
the engine loop reports its status every 0.5 s, idle or busy (between two steps), so a report older
than `max_age` means the engine is not serving. Torch-free and fast: one HTTP request.
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
