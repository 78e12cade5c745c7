"""The one admission decision (`tokenmill.worker.service.admission`): every path takes it from a check-in."""

from __future__ import annotations

import json

import pytest

from tokenmill.worker.service import Admission, CheckIn, admission, is_conflict


def stored(status: str, job_hash: str | None) -> bytes:
    """A Celery meta as the result backend stores it, with a `JobResult` inside."""
    return json.dumps({"status": status, "result": {"id": "j", "job_hash": job_hash}}).encode()


@pytest.mark.parametrize(("check", "expected"), [
    (CheckIn(None, 1, False), Admission.RUN),
    (CheckIn(None, 5, False), Admission.RUN),  # the last delivery allowed
    (CheckIn(None, 6, False), Admission.DEAD_LETTER),
    (CheckIn(None, 1, True), Admission.CANCELLED),
    (CheckIn(None, 9, True), Admission.CANCELLED),  # a cancel wins over the delivery count
    (CheckIn(stored("SUCCESS", "mine"), 1, False), Admission.STORED),
    (CheckIn(stored("SUCCESS", None), 2, False), Admission.STORED),  # a result without a hash: taken as the job's
    (CheckIn(stored("SUCCESS", "other"), 1, False), Admission.CONFLICT),
    (CheckIn(stored("REVOKED", "mine"), 1, True), Admission.STORED),  # a stored result wins over the cancel mark
    (CheckIn(stored("FAILURE", "other"), 9, True), Admission.CONFLICT),
    (CheckIn(stored("PENDING", "mine"), 1, False), Admission.RUN),  # not final: nothing settles it
    (CheckIn(stored("STARTED", "mine"), 7, False), Admission.DEAD_LETTER),
])
def test_every_check_in_has_one_outcome(check: CheckIn, expected: Admission) -> None:
    assert admission(check, "mine", max_deliveries=5) is expected


def test_a_conflict_needs_two_different_hashes() -> None:
    assert is_conflict("a", "b") and not is_conflict("a", "a") and not is_conflict(None, "a")
