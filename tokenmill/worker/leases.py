"""Lease renewal: keep kombu from redelivering jobs that a live worker is still working on.

kombu's Redis transport records each delivered, not yet acked message in the sorted set
`unacked_index` with the delivery time as score, and any consumer's periodic sweep
(`restore_visible`) puts a message back on its queue once `now - score > visibility_timeout`. It does
not know whether the worker that holds the message is alive, so a job that runs longer than the
visibility timeout would be delivered to a second worker and run twice.

A consumer step (`tokenmill.worker.celery_adapter.LeaseRenewal`) calls `renew`, which re-stamps the score of
every message this worker holds (received, running or writing its result, on the current channel or on one from
before a broker reconnect, whose jobs keep running and ack through it) every `visibility_timeout / 8` seconds, with
`ZADD XX` so a message acked in between is never put back. A worker killed with `kill -9` stops renewing and its
messages are redelivered `visibility_timeout` (plus at most one sweep interval) after its last renewal.

tokenmill's transport (`tokenmill.queue.transport`) does not put an old channel's messages back on
the queue at a reconnect (kombu's `restore_at_shutdown`), so a reconnect neither reruns nor charges a
delivery to the jobs running here. Torch-free.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from tokenmill.queue.transport import held_deliveries

if TYPE_CHECKING:
    from celery.worker.consumer import Consumer
    from kombu.transport.redis import Channel

log = logging.getLogger(__name__)


def renew(parent: Consumer) -> int:
    """Re-stamp every message held by this worker; returns how many were renewed."""
    channel = getattr(getattr(parent, "task_consumer", None), "channel", None)
    if channel is None or not hasattr(channel, "conn_or_acquire"):  # not connected yet, or not Redis
        return 0
    try:
        return _restamp(channel, held_deliveries())
    except Exception as exc:  # broker down: kombu reconnects; renew again next tick
        log.debug("lease renewal failed: %r", exc)
        return 0


def _restamp(channel: Channel, held: dict[str, list[str]]) -> int:
    if not held:
        return 0
    now = time.time()
    with channel.conn_or_acquire() as client:
        pipe = client.pipeline(transaction=False)
        for index_key, tags in held.items():
            pipe.zadd(index_key, {tag: now for tag in tags}, xx=True)
        pipe.execute()
    return sum(len(tags) for tags in held.values())
