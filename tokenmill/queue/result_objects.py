"""Reading a result object back from S3 (or any S3-compatible store) for `JobResult.read`.

boto3 is imported only when an object is read, so a producer that never reads S3 results need not install it.
One boto3 client per endpoint is made at the first read through it and kept (boto3 clients are thread-safe);
it finds its credentials and region the way boto3 does (environment, config files, instance role).
"""

from __future__ import annotations

import functools
import os
from typing import Any

#: The endpoint setting the worker and `tokenmill annotate` read too (MinIO, moto, ...).
ENDPOINT_ENV = "TOKENMILL_S3_ENDPOINT_URL"
INSTALL_HINT = "pip install boto3 (or pip install 'tokenmill[worker]', which includes it)"


class ResultReadError(RuntimeError):
    """A result object could not be read or is not the result asked for; `uri` names it, the message the cause."""

    def __init__(self, uri: str, cause: str) -> None:
        super().__init__(f"cannot read {uri}: {cause}")
        self.uri = uri


def s3_endpoint(explicit: str | None = None) -> str | None:
    """`explicit`, else `TOKENMILL_S3_ENDPOINT_URL`, else None (boto3's own: `AWS_ENDPOINT_URL_S3`, ..., AWS)."""
    return explicit or os.environ.get(ENDPOINT_ENV) or None


def split_uri(uri: str) -> tuple[str, str]:
    """(bucket, key) of `s3://bucket/key`; `ResultReadError` for anything else."""
    bucket, _, key = uri.removeprefix("s3://").partition("/")
    if not uri.startswith("s3://") or not bucket or not key:
        raise ResultReadError(uri, "not an s3://bucket/key URI")
    return bucket, key


def read_object(uri: str, endpoint_url: str | None = None) -> bytes:
    """The bytes of the object at `uri`, through `endpoint_url` (see `s3_endpoint`).

    Raises `ResultReadError` naming `uri` and the cause (no such key or bucket, access denied, no credentials,
    endpoint unreachable); `ImportError` saying what to install when boto3 is missing.
    """
    bucket, key = split_uri(uri)
    client = s3_client(s3_endpoint(endpoint_url))
    from botocore.exceptions import BotoCoreError, ClientError

    try:
        return client.get_object(Bucket=bucket, Key=key)["Body"].read()
    except ClientError as exc:
        raise ResultReadError(uri, client_error_cause(exc)) from exc
    except BotoCoreError as exc:
        raise ResultReadError(uri, f"{type(exc).__name__}: {exc}") from exc


def client_error_cause(exc: Any) -> str:
    """`Code: message` of a botocore `ClientError` (`NoSuchKey: The specified key does not exist.`)."""
    error = exc.response.get("Error", {})
    code = error.get("Code") or exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", "error")
    return f"{code}: {error.get('Message') or exc}"


@functools.lru_cache(maxsize=8)
def s3_client(endpoint_url: str | None) -> Any:
    """The boto3 S3 client for `endpoint_url`, made once; `ImportError` naming the install when boto3 is missing."""
    try:
        import boto3
    except ImportError as exc:
        raise ImportError(f"reading a result from S3 needs boto3: {INSTALL_HINT}") from exc
    return boto3.session.Session().client("s3", endpoint_url=endpoint_url)  # a session of its own: thread-safe
