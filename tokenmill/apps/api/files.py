"""File contents on local disk, under `TOKENMILL_FILES_DIR`: one file per id, written to a temporary name and
renamed, so a killed server never leaves half a file under a real id. Metadata lives in Redis (`records`)."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterable
from pathlib import Path
from typing import BinaryIO

from tokenmill.apps.api.errors import APIError

_CHUNK = 1 << 20


def new_file_id() -> str:
    return f"file-{uuid.uuid4().hex[:24]}"


class FileStore:
    """Files by id in one directory (shared by every server process of a deployment)."""

    def __init__(self, directory: str) -> None:
        self.directory = Path(directory).expanduser().resolve()
        self.directory.mkdir(parents=True, exist_ok=True)

    def path(self, file_id: str) -> Path:
        if not file_id.startswith("file-") or not file_id[5:].replace("-", "").isalnum():
            raise APIError(404, f"No file found with id '{file_id}'.", param="id", code="not_found")
        return self.directory / file_id

    def save(self, file_id: str, source: BinaryIO, limit: int) -> int:
        """Copy an upload to `file_id`; refuses (413) one over `limit` bytes. Returns its size."""
        size = 0
        with self._writing(file_id) as (target, temporary):
            while chunk := source.read(_CHUNK):
                size += len(chunk)
                if size > limit:
                    raise APIError(413, f"file: larger than the {limit}-byte upload limit (TOKENMILL_MAX_UPLOAD_BYTES)",
                                   param="file", code="file_too_large")
                target.write(chunk)
        return size

    def write_lines(self, file_id: str, lines: Iterable[bytes]) -> int:
        """Write an output file (JSONL lines, each ending in a newline); returns its size."""
        size = 0
        with self._writing(file_id) as (target, _):
            for line in lines:
                size += target.write(line)
        return size

    def delete(self, file_id: str) -> None:
        self.path(file_id).unlink(missing_ok=True)

    def _writing(self, file_id: str) -> _Writing:
        return _Writing(self.path(file_id))


class _Writing:
    """A file written under a temporary name, renamed into place only if the block ends without an error."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.temporary = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.partial")

    def __enter__(self) -> tuple[BinaryIO, Path]:
        self.handle = open(self.temporary, "wb")
        return self.handle, self.temporary

    def __exit__(self, kind: object, *rest: object) -> None:
        self.handle.close()
        if kind is None:
            os.replace(self.temporary, self.path)
        else:
            self.temporary.unlink(missing_ok=True)
