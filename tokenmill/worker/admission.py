"""Admission: what becomes of a job once its check-in counted a delivery; one decision for the pool, groups and the
intake. In order: a final result under the id settles it without running (`Stored`, or `Conflict` when it is another
content's); else a cancel mark gives `Cancelled`; else a delivery past `max_deliveries` is dead-lettered
(`DeadLetter`); else `Run`.
See docs/internals/worker.md, section "The pipeline".
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tokenmill.queue.cancels import is_final

if TYPE_CHECKING:
    from tokenmill.queue.schemas import Job

# KEYS: n result keys, the n jobs' delivery-count keys, then their cancel marks; ARGV[1]: the counts' expiry
# in seconds. Returns three values per job (`CheckIn.from_replies`). Atomic, as `tokenmill.queue.cancels.cancel`'s
# script is: a cancel either finds the delivery counted (and is announced to this worker) or is seen here.
CHECK_IN = """
local n = #KEYS / 3
local replies = {}
for i = 1, n do
  replies[3 * i - 2] = redis.call('GET', KEYS[i])
  replies[3 * i - 1] = redis.call('INCR', KEYS[n + i])
  redis.call('EXPIRE', KEYS[n + i], ARGV[1])
  replies[3 * i] = redis.call('EXISTS', KEYS[2 * n + i])
end
return replies
"""


@dataclass
class Attempt:
    """One delivery of a job on this worker, from its admission to its result."""

    job: Job
    started_at: float
    attempt: int  # its delivery number, from its check-in
    time_limit: float | None = None  # Celery's time_limit / soft_time_limit of the message, if any
    job_hash: str = ""  # the hash its sender sent (`JOB_HASH_HEADER`), else `Job.content_hash()`
    share: str | None = None  # the fair share its message came from (`SHARE_HEADER`), passed to the engine

    def __post_init__(self) -> None:
        self.job_hash = self.job_hash or self.job.content_hash()

    @property
    def deadline(self) -> float | None:
        """When (time.time()) the job must end, from `Job.deadline_s` or else the message's time limit."""
        limit = self.job.deadline_s or self.time_limit
        return None if limit is None else self.started_at + limit


@dataclass
class CheckIn:
    """What a job's check-in found: its stored result, this delivery's number, whether it was cancelled."""

    stored: bytes | None
    attempt: int
    cancelled: bool

    @classmethod
    def from_replies(cls, replies: list[Any]) -> list[CheckIn]:
        """The script's flat reply (GET, INCR and EXISTS per job) as one `CheckIn` per job, in the keys' order."""
        return [cls(replies[i], int(replies[i + 1]), bool(replies[i + 2])) for i in range(0, len(replies), 3)]


@dataclass(frozen=True)
class Stored:
    stored_hash: str | None  # None: a result without a hash (an older worker's), taken as the job's own


@dataclass(frozen=True)
class Conflict:
    stored_hash: str


@dataclass(frozen=True)
class Cancelled:
    pass


@dataclass(frozen=True)
class DeadLetter:
    deliveries: int


@dataclass(frozen=True)
class Run:
    pass


Decision = Stored | Conflict | Cancelled | DeadLetter | Run


def admission(check: CheckIn, job_hash: str | None, max_deliveries: int) -> Decision:
    """The decision for a job hashed `job_hash` (`Job.content_hash`, or the hash its sender sent) from its check-in."""
    if is_final(check.stored):
        return settled_by(stored_job_hash(check.stored), job_hash)
    if check.cancelled:
        return Cancelled()
    if check.attempt > max_deliveries:
        return DeadLetter(check.attempt)
    return Run()


def settled_by(stored_hash: str | None, job_hash: str | None) -> Stored | Conflict:
    """Whose a final result carrying `stored_hash`, found under the id of the job hashed `job_hash`, is: the job's own
    unless the result's hash is known and differs."""
    if stored_hash is not None and stored_hash != job_hash:
        return Conflict(stored_hash)
    return Stored(stored_hash)


def stored_job_hash(stored: bytes) -> str | None:
    """The content hash in a stored Celery result's `JobResult`; None for a result without one."""
    result = json.loads(stored).get("result")
    value = result.get("job_hash") if isinstance(result, dict) else None
    return value if isinstance(value, str) else None
