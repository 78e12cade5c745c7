"""Lease renewal: keep kombu from redelivering a job that a live worker still holds.

kombu redelivers an unacked message once its `unacked_index` score is older than `visibility_timeout`. `renew`,
called by `tokenmill.worker.celery_adapter.LeaseRenewal` every `visibility_timeout / 8` seconds, re-stamps every
message this worker holds with `ZADD XX`, so a message acked in between is never put back. Torch-free.
See docs/internals/worker.md, section "Cancels, leases and control".
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
