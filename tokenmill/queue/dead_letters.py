"""The dead-letter list: jobs the workers gave up on, bounded, and what it takes to list, requeue or drop them.

A dead letter keeps only what a requeue needs: the job as it travelled (its wire dict) and why it was
given up on (`reason`, `deliveries`, `dead_lettered_at`). A message the worker refused and could not answer
under its id (no usable task id) is kept too, as `{"refused_message": {task, id, content_type, bytes}}` in
place of the job: it is listed and purged like any entry, but it is no job and cannot be requeued. The list is the Redis list
`tokenmill:dead_letter`, newest first; each push trims it to `dead_letter_max_len` entries and, unless
`dead_letter_expires` is 0, sets it to expire that many seconds after the newest entry. Torch-free: the
worker pushes, the client and `tokenmill dead-letters` read.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

import redis

from tokenmill.queue.names import DEAD_LETTER_KEY

#: The key of a dead letter's `job` when the entry is a refused message rather than a job.
REFUSED_FIELD = "refused_message"


@dataclass
class DeadLetter:
    """One entry; `raw` is its exact stored bytes (what removing it by value needs)."""

    job: dict[str, Any]
    reason: str
    deliveries: int | None
    dead_lettered_at: float | None
    raw: bytes

    @property
    def id(self) -> str:
        return str(self.job.get("id", ""))

    @property
    def requeueable(self) -> bool:
        """Whether the entry is a job (not a refused message, which has no usable id to run under)."""
        return REFUSED_FIELD not in self.job

    def summary(self) -> dict[str, Any]:
        return {"id": self.id, "deliveries": self.deliveries, "dead_lettered_at": self.dead_lettered_at, "reason": self.reason}


def push(client: redis.Redis, job: dict[str, Any], reason: str, deliveries: int, max_len: int, expires: int) -> None:
    """Add a dead letter (newest first), trim the list to `max_len`, renew its expiry: one round trip."""
    entry = json.dumps({"job": job, "reason": reason, "deliveries": deliveries, "dead_lettered_at": time.time()})
    with client.pipeline(transaction=True) as pipe:
        pipe.lpush(DEAD_LETTER_KEY, entry).ltrim(DEAD_LETTER_KEY, 0, max_len - 1)
        if expires:
            pipe.expire(DEAD_LETTER_KEY, expires)
        pipe.execute()


def read(client: redis.Redis) -> list[DeadLetter]:
    """Every dead letter, newest first. An entry that is not ours (not a JSON object with a job) is skipped."""
    letters = []
    for raw in client.lrange(DEAD_LETTER_KEY, 0, -1):
        try:
            entry = json.loads(raw)
        except ValueError:
            continue
        if not isinstance(entry, dict) or not isinstance(entry.get("job"), dict):
            continue
        letters.append(DeadLetter(entry["job"], str(entry.get("reason", "")), entry.get("deliveries"),
                                  entry.get("dead_lettered_at"), raw))
    return letters


def remove(client: redis.Redis, letter: DeadLetter) -> None:
    client.lrem(DEAD_LETTER_KEY, 1, letter.raw)


def select(letters: list[DeadLetter], ids: list[str] | None) -> tuple[list[DeadLetter], list[str]]:
    """The letters with these job ids (all of them for None), and the ids that have none."""
    if ids is None:
        return letters, []
    wanted = set(ids)
    chosen = [letter for letter in letters if letter.id in wanted]
    found = {letter.id for letter in chosen}
    return chosen, [i for i in ids if i not in found]
