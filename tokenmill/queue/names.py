"""The names both sides of Redis agree on: task names, the default queue, its routes and tokenmill's own keys.

They are the wire contract: a job queued by any client version runs on any worker that knows these names,
so they never change (a message queued before an upgrade must still run after it).
"""

from __future__ import annotations

import re

#: One job per message (`Client.submit`, `generate.delay`, a team's own `send_task`).
TASK_NAME = "tokenmill.generate"
#: Several jobs per message, each with its own id and result (`tokenmill annotate --broker`).
BATCH_TASK_NAME = "tokenmill.generate_batch"
#: The queue tokenmill workers consume and the client sends to unless told otherwise.
DEFAULT_QUEUE = "tokenmill"
#: For a team's own Celery app: `app.conf.task_routes = TASK_ROUTES` (or merge it into theirs) sends
#: `app.send_task("tokenmill.generate", ...)` to the queue tokenmill workers consume. Without it Celery
#: publishes to its default queue `celery`, which no tokenmill worker reads, and the job waits forever.
TASK_ROUTES = {TASK_NAME: {"queue": DEFAULT_QUEUE}}
#: tokenmill's own Redis keys, beside Celery's: the delivery count of each job, and the list of jobs
#: given up on after `max_deliveries` (newest first).
DELIVERIES_KEY = "tokenmill:deliveries:{job_id}"
DEAD_LETTER_KEY = "tokenmill:dead_letter"
#: A job asked to be cancelled (kept as long as results), and the channel each cancel is announced on to the
#: workers (its message: the job id). See `tokenmill.queue.cancels`.
CANCEL_KEY = "tokenmill:cancel:{job_id}"
CANCEL_CHANNEL = "tokenmill:cancels"
#: The ids of the jobs one `annotate --broker` / `batch --broker` run queued (a set), for `tokenmill cancel --run`.
RUN_JOBS_KEY = "tokenmill:run:{run_id}"
#: A message header: the content hash (`Job.content_hash`) of the job a `tokenmill.generate` message carries, as the
#: client that sent it computed it. The worker stores it in the job's result instead of hashing the job again; a
#: message without it (a plain `send_task`), or with a value that is no SHA-256 hex digest, is
#: hashed by the worker. It is the sender's claim, as the job id is: it only tells that sender's own resubmissions
#: of the id apart from other content.
JOB_HASH_HEADER = "tokenmill_job_hash"
#: A message header: how many jobs a `tokenmill.generate_batch` message carries (`annotate --broker`, `serve`), so a
#: worker's prefetch counts jobs, not messages: without it a worker held `max_num_seqs` and a quarter more group
#: messages, 32 jobs each, hidden from other workers and ahead of every job it took after them. A message without
#: it counts as one job.
JOBS_HEADER = "tokenmill_jobs"
#: Fair shares. A message published for a share (a `serve` tenant, an `annotate --broker` run: `Client(share=...)`)
#: carries this header and waits on its share's list of the queue, `SHARE_LIST` (kombu's priority suffix after it),
#: and the share is in the queue's index `SHARES_KEY`. tokenmill's transport takes from the queue's own list and
#: from each share's in turn, one message each (`SHARE_TURN_KEY` rotates who goes first), so a share's backlog
#: delays another's messages by one turn, not by the backlog. A message put back on its queue (a lease lapsed, a
#: worker handing back) goes to the queue's own list, at its head.
SHARE_HEADER = "tokenmill_share"
SHARE_LIST = "{queue}\x06\x16s:{share}"
SHARES_KEY = "tokenmill:shares:{queue}"
SHARE_TURN_KEY = "tokenmill:share-turn"
#: Pushed on the queue's own list after a write of share messages, to wake a worker blocked on that list; tokenmill's
#: transport drops it (it is no message).
SHARE_BELL = "tokenmill:share-bell"

_SHARE_NAME = re.compile(r"[A-Za-z0-9._-]{1,64}")


def message_share(headers: object) -> str | None:
    """The fair share a message's `headers` name (`SHARE_HEADER`), None when they name no valid one."""
    share = headers.get(SHARE_HEADER) if isinstance(headers, dict) else None
    return share if valid_share(share) else None


def valid_share(share: object) -> bool:
    """Whether `share` may name a share: 1 to 64 of `A-Z a-z 0-9 . _ -` (nothing of kombu's list name separators)."""
    return isinstance(share, str) and _SHARE_NAME.fullmatch(share) is not None
