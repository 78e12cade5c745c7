"""Helpers of the annotate/batch tests: datasets in tmp dirs, CLI subprocesses, reading outputs."""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
#: Small KV pool: the tests' prompts are short, and a small pool loads fast.
ENGINE = {"num_kv_blocks": 512}


def write_jsonl(path: Path, rows: list[Any]) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def cli(*args: str, wait: bool = True, **popen: Any) -> subprocess.Popen | subprocess.CompletedProcess:
    """`python -m tokenmill.cli ...` with this worktree's code and one torch thread."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "tokenmill.cli", *args]
    if wait:
        return subprocess.run(command, env=env, capture_output=True, text=True, timeout=600, **popen)
    return subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, **popen)


def checkpointed(state_dir: Path) -> int:
    """Results committed to a run's checkpoint so far (what a reader in another process sees)."""
    path = state_dir / "checkpoint.sqlite"
    if not path.exists():
        return 0
    try:
        with sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=1) as db:
            return db.execute("SELECT count(*) FROM results").fetchone()[0]
    except sqlite3.OperationalError:  # not created yet
        return 0


def wait_until(check: Any, timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while not (value := check()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.05)
    return value
