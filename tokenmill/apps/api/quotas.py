"""Each tenant's share of what a deployment holds for it: the jobs and prompt bytes of its batches not final yet, and
the files it stores (issue 57). Every bound is a `ServeSettings` field.

A batch input file's jobs and prompt bytes are counted once, at upload (`input_usage`, from the spooled upload), and
kept on its record; `POST /v1/batches` copies them onto the batch's record and refuses a batch that would take its
tenant's batches not final yet past `max_queued_jobs` or `max_queued_prompt_bytes`: a 429 with `Retry-After` (room
comes back as they end), or a 400 for a file past a bound on its own (waiting cannot help). A tenant's stored files
and bytes (its uploads and its batches' output files) are totalled as their records are added and deleted
(`Records.add_file`, `delete_file`, expiry included); an upload past `max_stored_files` or `max_stored_bytes` is a
400, as OpenAI answers past its storage quota, before the file is stored, and so is a batch created while its tenant is
at either (its outputs, added when it ends, may take the tenant past them). The bounds are checked, not reserved:
requests of one tenant at the same moment may each pass the check and together go past a bound by their own sizes.
"""

from __future__ import annotations

import json
from typing import Any, BinaryIO

from tokenmill.apps.api.errors import APIError
from tokenmill.apps.api.settings import ServeSettings
from tokenmill.apps.batch import EMBEDDINGS, embedding_inputs
from tokenmill.apps.datasets import MAX_ROW_BYTES, TooLong, bounded_lines
from tokenmill.errors import InvalidRequestError

#: Seconds a batch refused for its tenant's queued work is told to wait (`Retry-After`): room comes back as batches end.
RETRY_AFTER = 60
#: What each queued bound counts, its setting and its error code.
QUEUED = {"jobs": ("jobs (requests × n)", "max_queued_jobs", "too_many_queued_jobs"),
          "prompt_bytes": ("prompt bytes", "max_queued_prompt_bytes", "too_many_queued_prompt_bytes")}


def input_usage(source: BinaryIO) -> dict[str, int]:
    """A batch input file's `jobs` and `prompt_bytes`, read from a seekable upload (left at its start).

    A line's jobs: its `n`, or an embeddings request's inputs; 1 for a line the batch would fail or refuse (an
    overcount only). Its prompt bytes, serve having no tokenizer: the whole line's size, more than its prompt's text,
    once per choice (each job carries and prefills the prompt); once for all of an embeddings line's inputs."""
    jobs = prompt_bytes = 0
    source.seek(0)
    for raw in bounded_lines(source, MAX_ROW_BYTES):
        if isinstance(raw, TooLong):
            jobs, prompt_bytes = jobs + 1, prompt_bytes + raw.size
        elif raw.strip():
            units, embeddings = _units(raw)
            jobs += units
            prompt_bytes += len(raw) * (1 if embeddings else units)
    source.seek(0)
    return {"jobs": jobs, "prompt_bytes": prompt_bytes}


def _units(raw: bytes) -> tuple[int, bool]:
    """The jobs one line makes, and whether it is an embeddings request."""
    try:
        line = json.loads(raw)
        body: Any = line["body"]
        if line["url"] == EMBEDDINGS:
            return len(embedding_inputs(body.get("input"))), True
        n = body.get("n", 1)
        return (n if isinstance(n, int) and not isinstance(n, bool) and 1 <= n <= 128 else 1), False
    except (ValueError, TypeError, KeyError, AttributeError, RecursionError, InvalidRequestError):
        return 1, False


def check_queued(queued: dict[str, int], adding: dict[str, int], settings: ServeSettings) -> None:
    """Refuse a batch of `adding` jobs and prompt bytes on top of the tenant's `queued` ones: a 400 if it alone is past
    a bound, else a 429 with `Retry-After` if both together are."""
    for name, (what, setting, code) in QUEUED.items():
        limit, variable = getattr(settings, setting), f"TOKENMILL_{setting.upper()}"
        if adding[name] > limit:
            raise APIError(400, f"input_file_id: the file asks for {adding[name]} {what}, more than the {limit} one "
                                f"key's batches may have queued ({variable}); split it.", "input_file_id", code)
        if queued[name] + adding[name] > limit:
            raise APIError(429, f"This key's batches not finished yet hold {queued[name]} {what} and this file asks "
                                f"for {adding[name]}, past the {limit} allowed ({variable}); try again once some "
                                "batches have ended.", None, code, {"Retry-After": str(RETRY_AFTER)})


def check_stored(stored: dict[str, int], settings: ServeSettings, upload: int | None = None) -> None:
    """Refuse an upload of `upload` bytes that would take the tenant's stored files past `max_stored_files` or
    `max_stored_bytes`, or (no `upload`) a batch while the tenant is at either: its output and error files are stored
    files of its tenant too. A 400, as OpenAI answers past its storage quota (waiting helps only as files expire)."""
    files, used = stored["files"], stored["bytes"]
    size = 1 if upload is None else upload  # a batch's outputs: at least one file of at least one byte
    if files + 1 > settings.max_stored_files or used + size > settings.max_stored_bytes:
        adding = "a batch's output files are stored files too" if upload is None else f"this file has {upload}"
        raise APIError(400, f"You have exceeded your file storage quota: this key stores {files} files of {used} "
                            f"bytes, at most {settings.max_stored_files} files (TOKENMILL_MAX_STORED_FILES) and "
                            f"{settings.max_stored_bytes} bytes (TOKENMILL_MAX_STORED_BYTES), and {adding}. Delete "
                            "old files to make room.", "file" if upload is not None else None,
                       "file_storage_limit_exceeded")
