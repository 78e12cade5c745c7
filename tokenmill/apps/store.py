"""The checkpoint: every finished completion, keyed by what determines it, in SQLite on local disk.

Why SQLite: it is in the standard library, keeps the key -> result index on disk (so memory does not grow
with the dataset), and its write-ahead log survives `kill -9`: a transaction is either in the file or not.
Results are committed at least every `flush_interval` seconds, so a killed run loses at most that much work.

The key is a hash of the rendered prompt (or messages), the model and every sampling and structured-output
option: two rows with the same key would get the same completion, so it is computed once and shared, and a
rerun recomputes exactly the rows whose key is not stored yet (new rows, rows whose prompt changed).
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
import sqlite3
import time
import uuid
from dataclasses import dataclass, fields
from typing import Any

from tokenmill.apps.datasets import DatasetError


@dataclass
class Outcome:
    """One completion (or why there is none). `parsed` is the structured-output value as JSON text."""

    text: str | None = None
    parsed: str | None = None
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    error: str | None = None
    logprobs: str | None = None  # JSON text of the engine's per-position logprobs, when asked for
    created: int = 0  # unix time it finished: part of OpenAI batch output, so stored, not recomputed
    choice_probabilities: str | None = None  # JSON text {choice: probability}, when asked for
    embedding: str | None = None  # JSON text of an embedding's vector (a list of floats)
    scores: str | None = None  # JSON text of a score's [{"logprob", "is_greedy", "num_tokens"}], one per continuation

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def cancelled(self) -> bool:
        """Ended by a cancel (`tokenmill cancel`): `--retry-cancelled` runs it again."""
        return self.error is not None and self.error.startswith("cancelled:")

    @property
    def interrupted(self) -> bool:
        """In flight when its run was interrupted (Ctrl-C): the next run computes it again, whatever its flags."""
        return self.error == INTERRUPTED

    @classmethod
    def failed(cls, message: str) -> Outcome:
        return cls(error=message, created=int(time.time()))


#: The checkpoint's mark of a unit in flight when its run was interrupted (`Outcome.interrupted`).
INTERRUPTED = "interrupted: in flight when the run was interrupted; the same command computes it again"

_COLUMNS = [f.name for f in fields(Outcome)]


def _canonical(parts: dict[str, Any]) -> bytes:
    return json.dumps(parts, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str).encode()


def content_key(**parts: Any) -> str:
    """A stable hash of everything that determines a completion (JSON with sorted keys, SHA-256)."""
    return hashlib.sha256(_canonical(parts)).hexdigest()[:32]


class KeyHasher:
    """`content_key` for many rows that share most parts (model, sampling): those are hashed once."""

    def __init__(self, **shared: Any) -> None:
        self._state = hashlib.sha256(_canonical(shared))

    def __call__(self, prompt: str | None = None, **parts: Any) -> str:
        state = self._state.copy()
        state.update(b"\0prompt\0" + prompt.encode() if prompt is not None else _canonical(parts))
        return state.hexdigest()[:32]


#: Files SQLite keeps next to a database: it creates them with the database file's permissions.
_SIDE_FILES = ("-wal", "-shm", "-journal")
_NO_FOLLOW = os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)


def _private_database(path: str) -> None:
    """Make `path` (created if missing) and any side files left from an earlier run readable by their owner
    only, none of them reached through a symlink: a checkpoint holds every prompt and completion of a
    dataset, and under the usual umask (022) SQLite would create it world-readable. SQLite gives the WAL
    and shared-memory files it creates later the database file's mode, so those are 0600 too."""
    try:
        os.makedirs(os.path.dirname(path) or ".", mode=0o700, exist_ok=True)
        _make_private(path, os.O_RDWR | os.O_CREAT)
        for suffix in _SIDE_FILES:
            try:
                _make_private(path + suffix, os.O_RDONLY)
            except FileNotFoundError:
                pass
    except OSError as exc:
        why = " (symlinks are refused)" if exc.errno == errno.ELOOP else ""
        raise DatasetError(f"checkpoint {exc.filename or path!r} cannot be used: {exc.strerror}{why}") from None


def _make_private(path: str, flags: int) -> None:
    fd = os.open(path, flags | _NO_FOLLOW, 0o600)
    try:
        os.fchmod(fd, 0o600)
    finally:
        os.close(fd)


class Checkpoint:
    """Results by key. `run` marks which results this process wrote (the rest were reused)."""

    def __init__(self, path: str, flush_interval: float = 2.0) -> None:
        self.path = path
        self.flush_interval = flush_interval
        self.run = uuid.uuid4().hex
        _private_database(path)
        self._lock = _hold(path + ".lock", self.run)
        try:
            self.db = sqlite3.connect(path, isolation_level=None)
        except BaseException:
            os.close(self._lock)
            raise
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=NORMAL")
        columns = ", ".join(f"{name} {'INTEGER' if name in ('prompt_tokens', 'completion_tokens', 'created') else 'TEXT'}"
                            for name in _COLUMNS)
        self.db.execute(f"CREATE TABLE IF NOT EXISTS results (key TEXT PRIMARY KEY, run TEXT, {columns})")
        present = {row[1] for row in self.db.execute("PRAGMA table_info(results)")}
        for name in _COLUMNS:  # a checkpoint written before a field was added: the column, empty for its rows
            if name not in present:
                self.db.execute(f"ALTER TABLE results ADD COLUMN {name} TEXT")
        self._last_flush = time.monotonic()
        self.db.execute("BEGIN")

    def get(self, key: str) -> tuple[Outcome, bool] | None:
        """The stored outcome and whether it was written by an earlier run."""
        row = self.db.execute(f"SELECT run, {', '.join(_COLUMNS)} FROM results WHERE key = ?", (key,)).fetchone()
        if row is None:
            return None
        return Outcome(*row[1:]), row[0] != self.run

    def put(self, key: str, outcome: Outcome) -> None:
        placeholders = ", ".join("?" * (len(_COLUMNS) + 2))
        self.db.execute(f"INSERT OR REPLACE INTO results (key, run, {', '.join(_COLUMNS)}) VALUES ({placeholders})",
                        (key, self.run, *(getattr(outcome, name) for name in _COLUMNS)))
        if time.monotonic() - self._last_flush >= self.flush_interval:
            self.flush()

    def flush(self) -> None:
        self.db.execute("COMMIT")
        self.db.execute("BEGIN")
        self._last_flush = time.monotonic()

    def close(self) -> None:
        try:
            self.db.execute("COMMIT")
            self.db.close()
        finally:
            os.close(self._lock)  # the lock goes with its descriptor


def _hold(path: str, run: str) -> int:
    """One run per checkpoint (so per output): an exclusive `flock` on `path`, held until the descriptor is closed (or
    the process ends, however it ends). The holder writes its pid and run id there for the one it refuses."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | _NO_FOLLOW, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 200, 0).decode(errors="replace").split()
        os.close(fd)
        who = f"pid {holder[0]}, run {holder[1][:12]}" if len(holder) == 2 else "another process"
        raise DatasetError(f"another run ({who}) is writing this output's checkpoint {os.path.dirname(path)}: let it "
                           "finish or stop it first (one run per output)") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()} {run}\n".encode(), 0)
    return fd


class SeenSet:
    """Membership on disk (a temporary SQLite table): duplicate custom_ids among millions of lines."""

    def __init__(self) -> None:
        self.db = sqlite3.connect("", isolation_level=None)  # "" = a private temporary database on disk
        self.db.execute("CREATE TABLE seen (name TEXT PRIMARY KEY, line INTEGER)")
        self.db.execute("BEGIN")

    def add(self, name: str, line: int) -> int | None:
        """Record `name` at `line`; if it was seen before, the line where it was first seen."""
        try:
            self.db.execute("INSERT INTO seen VALUES (?, ?)", (name, line))
            return None
        except sqlite3.IntegrityError:
            return self.db.execute("SELECT line FROM seen WHERE name = ?", (name,)).fetchone()[0]

    def close(self) -> None:
        self.db.close()
