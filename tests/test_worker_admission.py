"""The one admission decision (`tokenmill.worker.admission`): every check-in the script can return has one outcome."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tokenmill.worker.admission import (Cancelled, CheckIn, Conflict, DeadLetter, Run, Stored, admission, settled_by,
                                        stored_job_hash)

MAX = 5
MINE = "a" * 64
OTHER = "b" * 64


def stored(status: str, job_hash: Any = MINE, result: Any = None) -> bytes:
    """A Celery meta as the result backend stores it, with a `JobResult` (or `result`) inside."""
    return json.dumps({"status": status, "result": {"id": "j", "job_hash": job_hash} if result is None else result}).encode()


@pytest.mark.parametrize(("check", "expected"), [
    # nothing stored, no cancel: the delivery count alone decides
    (CheckIn(None, 1, False), Run()),
    (CheckIn(None, MAX, False), Run()),  # the last delivery allowed
    (CheckIn(None, MAX + 1, False), DeadLetter(MAX + 1)),
    (CheckIn(None, 1000, False), DeadLetter(1000)),
    # a cancel mark wins over the delivery count
    (CheckIn(None, 1, True), Cancelled()),
    (CheckIn(None, MAX + 1, True), Cancelled()),
    # a final result stored: the job's own, or another content's
    (CheckIn(stored("SUCCESS"), 1, False), Stored(MINE)),
    (CheckIn(stored("FAILURE"), 2, False), Stored(MINE)),
    (CheckIn(stored("REVOKED"), 2, False), Stored(MINE)),  # a cancelled job's result
    (CheckIn(stored("SUCCESS", OTHER), 1, False), Conflict(OTHER)),
    (CheckIn(stored("SUCCESS", None), 2, False), Stored(None)),  # no hash (an older worker's): taken as the job's
    (CheckIn(stored("SUCCESS", 7), 2, False), Stored(None)),  # a hash that is no string: as none
    (CheckIn(stored("FAILURE", result={"exc_type": "KeyError"}), 1, False), Stored(None)),  # Celery's own failure
    (CheckIn(stored("SUCCESS", result="text"), 1, False), Stored(None)),  # a result that is no object
    (CheckIn(stored("SUCCESS", ""), 1, False), Conflict("")),  # a hash, though empty: not this job's
    # a stored result wins over a cancel mark and over the delivery count
    (CheckIn(stored("REVOKED"), 1, True), Stored(MINE)),
    (CheckIn(stored("SUCCESS"), MAX + 1, False), Stored(MINE)),
    (CheckIn(stored("FAILURE", OTHER), MAX + 4, True), Conflict(OTHER)),
    # a result that is not final settles nothing
    (CheckIn(stored("PENDING"), 1, False), Run()),
    (CheckIn(stored("STARTED", OTHER), MAX, False), Run()),
    (CheckIn(stored("RETRY"), 1, True), Cancelled()),
    (CheckIn(stored("STARTED"), MAX + 2, False), DeadLetter(MAX + 2)),
])
def test_every_check_in_has_one_outcome(check: CheckIn, expected: Any) -> None:
    assert admission(check, MINE, max_deliveries=MAX) == expected


def test_a_job_without_a_known_hash_conflicts_with_any_hashed_result() -> None:
    assert admission(CheckIn(stored("SUCCESS"), 1, False), None, MAX) == Conflict(MINE)
    assert admission(CheckIn(stored("SUCCESS", None), 1, False), None, MAX) == Stored(None)


def test_the_script_reply_is_read_three_values_a_job() -> None:
    """GET (nil or bytes), INCR (an int) and EXISTS (0/1) per job, in the order of the keys."""
    meta = stored("SUCCESS")
    assert CheckIn.from_replies([None, 1, 0, meta, 3, 1]) == [CheckIn(None, 1, False), CheckIn(meta, 3, True)]
    assert CheckIn.from_replies([]) == []


def test_a_conflict_needs_two_different_hashes() -> None:
    assert settled_by("a", "b") == Conflict("a")
    assert settled_by("a", "a") == Stored("a") and settled_by(None, "a") == Stored(None)
    assert stored_job_hash(stored("SUCCESS", OTHER)) == OTHER
