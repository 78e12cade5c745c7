"""File contents by id: in a local (or shared) directory, or in S3 (`s3://bucket/prefix`, MinIO in compose).
Metadata lives in Redis (`records`); a store only keeps bytes.

Both stores make a file appear whole or not at all: the directory writes a temporary name and renames it, S3
makes an object visible only once its upload completed. So a killed server never leaves half a file under a
real id. The driver reads input files through `uri` with `tokenmill batch`'s own reader (`read_lines`, which
takes local paths and `s3://` alike).
"""

from __future__ import annotations

import os
import tempfile
import uuid
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, BinaryIO, Protocol

from tokenmill.apps.api.errors import not_found, upload_too_large
from tokenmill.queue.schemas import S3Location

_CHUNK = 1 << 20


def new_file_id() -> str:
    return f"file-{uuid.uuid4().hex[:24]}"


def checked(file_id: str) -> str:
    """The id, if it is one this server could have made (so it is safe as a file name or object key)."""
    if not file_id.startswith("file-") or not file_id[5:].replace("-", "").isalnum():
        raise not_found("file", file_id)
    return file_id


def upload_size(source: BinaryIO, limit: int) -> int:
    """The size of an upload (spooled by the ASGI stack, so seekable); 413 over `limit` bytes."""
    size = source.seek(0, os.SEEK_END)
    source.seek(0)
    if size > limit:
        raise upload_too_large(limit)
    return size


class FileStore(Protocol):
    """Where file contents live, shared by every server process of a deployment."""

    endpoint: str | None  # the S3 endpoint `uri`s are read through (None: AWS or a local path)

    def uri(self, file_id: str) -> str: ...
    def save(self, file_id: str, source: BinaryIO, limit: int) -> int: ...
    def write_lines(self, file_id: str, lines: Iterable[bytes]) -> int: ...
    def chunks(self, file_id: str) -> Iterator[bytes]: ...
    def delete(self, file_id: str) -> None: ...


def open_store(location: str, endpoint: str | None = None) -> FileStore:
    """`s3://bucket/prefix` -> `S3Store`, anything else a directory."""
    if location.startswith("s3://"):
        return S3Store(location, endpoint)
    return DirectoryStore(location)


class DirectoryStore:
    """Files by id in one directory."""

    endpoint = None

    def __init__(self, directory: str) -> None:
        self.directory = Path(directory).expanduser().resolve()
        self.directory.mkdir(parents=True, exist_ok=True)

    def uri(self, file_id: str) -> str:
        return str(self.directory / checked(file_id))

    def save(self, file_id: str, source: BinaryIO, limit: int) -> int:
        size = upload_size(source, limit)
        with _Writing(Path(self.uri(file_id))) as target:
            while chunk := source.read(_CHUNK):
                target.write(chunk)
        return size

    def write_lines(self, file_id: str, lines: Iterable[bytes]) -> int:
        size = 0
        with _Writing(Path(self.uri(file_id))) as target:
            for line in lines:
                size += target.write(line)
        return size

    def chunks(self, file_id: str) -> Iterator[bytes]:
        try:
            handle = open(self.uri(file_id), "rb")
        except FileNotFoundError:
            raise not_found("file", file_id) from None
        with handle:
            while chunk := handle.read(_CHUNK):
                yield chunk

    def delete(self, file_id: str) -> None:
        Path(self.uri(file_id)).unlink(missing_ok=True)


class S3Store:
    """Files by id as objects under `s3://bucket/prefix/` (boto3; credentials from the usual AWS variables)."""

    def __init__(self, location: str, endpoint: str | None = None) -> None:
        import boto3
        from botocore.config import Config

        where = S3Location.parse(location)
        self.bucket, self.prefix = where.bucket, where.prefix + "/" if where.prefix else ""
        self.endpoint = endpoint
        region = os.environ.get("AWS_DEFAULT_REGION") or os.environ.get("AWS_REGION") or "us-east-1"
        self.s3: Any = boto3.client("s3", endpoint_url=endpoint, region_name=region,
                                    config=Config(retries={"mode": "standard", "max_attempts": 5}))

    def key(self, file_id: str) -> str:
        return self.prefix + checked(file_id)

    def uri(self, file_id: str) -> str:
        return f"s3://{self.bucket}/{self.key(file_id)}"

    def save(self, file_id: str, source: BinaryIO, limit: int) -> int:
        size = upload_size(source, limit)
        self.s3.upload_fileobj(source, self.bucket, self.key(file_id))
        return size

    def write_lines(self, file_id: str, lines: Iterable[bytes]) -> int:
        """Spooled to a temporary file past 8 MiB, then uploaded (in parts when large): a 50,000-line output is
        never held whole in memory."""
        size = 0
        with tempfile.SpooledTemporaryFile(max_size=8 << 20) as spool:
            for line in lines:
                size += spool.write(line)
            spool.seek(0)
            self.s3.upload_fileobj(spool, self.bucket, self.key(file_id))
        return size

    def chunks(self, file_id: str) -> Iterator[bytes]:
        try:
            body = self.s3.get_object(Bucket=self.bucket, Key=self.key(file_id))["Body"]
        except self.s3.exceptions.NoSuchKey:
            raise not_found("file", file_id) from None
        yield from body.iter_chunks(_CHUNK)

    def delete(self, file_id: str) -> None:
        self.s3.delete_object(Bucket=self.bucket, Key=self.key(file_id))


class _Writing:
    """A local file written under a temporary name, renamed into place only if the block ends without an error."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.temporary = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.partial")

    def __enter__(self) -> BinaryIO:
        self.handle = open(self.temporary, "wb")
        return self.handle

    def __exit__(self, kind: object, *rest: object) -> None:
        self.handle.close()
        if kind is None:
            os.replace(self.temporary, self.path)
        else:
            self.temporary.unlink(missing_ok=True)
