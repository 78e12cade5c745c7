"""Writing a result to S3 (or an S3-compatible store), retrying while the store is down.

The job's message stays unacked while this retries, so a crash loses nothing. A refusal retrying cannot fix ends the
job failed (`output_write_failed`), its full result kept in Redis. `output_refusal` confines writes to the worker's
`output_prefixes`, checked before the job is generated.
See docs/internals/worker.md, section "The pipeline".
"""

from __future__ import annotations

import logging
import random
import threading
from collections.abc import Callable
from dataclasses import dataclass

import boto3
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError

from tokenmill.queue.schemas import S3Location

log = logging.getLogger(__name__)

#: 4xx codes that are worth retrying (throttling, timeouts); every other 4xx is permanent.
_RETRYABLE_CLIENT_CODES = {"RequestTimeout", "RequestTimeTooSkewed", "SlowDown", "Throttling", "ThrottlingException"}


def output_refusal(location: S3Location, allowed: list[str] | None) -> str | None:
    """Why a job may not write under `location` given the allowed `s3://bucket/prefix/` list, or None if it may.

    A prefix allows its bucket's keys under it segment by segment (`s3://b/team-a/` allows `team-a/run1`, not
    `team-ab`); `.`, `..` and empty segments are refused outright, since some S3-compatible stores normalize them.
    """
    uri = location.uri_for("<id>")
    if not allowed:
        return f"this worker writes no S3 output ({uri}): its output_prefixes setting (TOKENMILL_OUTPUT_PREFIXES) is unset"
    segments = location.prefix.split("/") if location.prefix else []
    if any(segment in ("", ".", "..") for segment in segments):
        return f"{uri}: empty, '.' and '..' path segments are not allowed"
    for entry in allowed:
        prefix = S3Location.parse(entry)
        inside = not prefix.prefix or location.prefix == prefix.prefix or location.prefix.startswith(prefix.prefix + "/")
        if prefix.bucket == location.bucket and inside:
            return None
    return f"{uri} is outside the S3 prefixes this worker may write: {', '.join(allowed)}"


class OutputWriteError(Exception):
    """The store refused the write for a reason retrying will not fix."""


class WriteAbandoned(Exception):
    """The worker is shutting down while the store is still unreachable; the job must be requeued."""


@dataclass
class RetryPolicy:
    """Exponential backoff with equal jitter (each wait between half and all of the delay), the delay doubling from
    `initial` up to `max_delay` seconds, without limit on attempts."""

    initial: float = 0.25
    max_delay: float = 30.0

    def delays(self):
        delay = self.initial
        while True:
            yield random.uniform(delay / 2, delay)
            delay = min(delay * 2, self.max_delay)


class S3Sink:
    """Puts result JSON at `s3://bucket/prefix/<job id>.json`."""

    def __init__(
        self,
        endpoint_url: str | None = None,
        region: str | None = None,
        retry: RetryPolicy | None = None,
        on_retry: Callable[[], None] | None = None,
    ) -> None:
        # No botocore retries: `write` retries, so each attempt is short and `stop` is checked between attempts.
        config = Config(connect_timeout=3, read_timeout=10, retries={"max_attempts": 1, "mode": "standard"})
        self._client = boto3.client("s3", endpoint_url=endpoint_url, region_name=region, config=config)
        self._retry = retry or RetryPolicy()
        self._on_retry = on_retry

    def write(self, location: S3Location, job_id: str, body: bytes, stop: threading.Event) -> str:
        """Write until it succeeds; returns the object's URI.

        Raises `OutputWriteError` for a permanent refusal, `WriteAbandoned` if `stop` is set while the
        store is still failing.
        """
        key = location.key_for(job_id)
        for attempt, delay in enumerate(self._retry.delays(), start=1):
            try:
                self._client.put_object(Bucket=location.bucket, Key=key, Body=body, ContentType="application/json")
                return location.uri_for(job_id)
            except ClientError as exc:
                if not _retryable(exc):
                    raise OutputWriteError(f"S3 refused {location.uri_for(job_id)}: {exc}") from exc
                error: Exception = exc
            except BotoCoreError as exc:  # connection refused/reset, timeouts, DNS
                error = exc
            if self._on_retry is not None:
                self._on_retry()
            log.warning("job %s: S3 write attempt %d failed (%s); retrying in %.1fs", job_id, attempt, error, delay)
            if stop.wait(delay):
                raise WriteAbandoned(f"worker stopping; S3 still failing: {error}")
        raise AssertionError("unreachable")


def _retryable(exc: ClientError) -> bool:
    code = exc.response.get("Error", {}).get("Code", "")
    status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 500)
    return status >= 500 or status == 429 or code in _RETRYABLE_CLIENT_CODES
