"""Webhooks: `batch.completed` / `batch.failed` / `batch.cancelled` / `batch.expired`, POSTed to
`TOKENMILL_WEBHOOK_URL` and signed as the Standard Webhooks spec says (as OpenAI's are): headers `webhook-id`,
`webhook-timestamp` and `webhook-signature` = `v1,<base64 HMAC-SHA256 of "id.timestamp.body">` with the
`whsec_` secret (`standardwebhooks.Webhook.sign`, so receivers verify with any Standard Webhooks library).

Delivered at least once, whatever server process dies: the event is written to Redis in the same transaction
that makes the batch final (`Records.update`), as a member of the outbox `tokenmill:api:webhooks` (a sorted
set scored by when it is due). Every server's `Deliverer` claims due events one at a time by pushing their score
past the delivery timeout (a claim a killed server leaves behind is due again then), POSTs, and removes the
event on a 2xx answer; otherwise it is due again after 1, 2, 4 ... seconds (at most an hour), until
`TOKENMILL_WEBHOOK_MAX_ATTEMPTS` deliveries failed. A receiver may get an event twice (same `webhook-id`).
"""

from __future__ import annotations

import logging
import threading
import time
import urllib.error
import urllib.request
from datetime import datetime, timezone
from standardwebhooks.webhooks import Webhook

from tokenmill.apps.api.records import ATTEMPTS, EVENTS, OUTBOX, Records


class _RefuseRedirects(urllib.request.HTTPRedirectHandler):
    """A 3xx answer is a failed delivery (`HTTPError` with its code), never followed: a redirect would carry the
    signed event, and the server's own request, wherever the receiver points it."""

    def redirect_request(self, *args: object, **kwargs: object) -> None:
        return None


_NO_REDIRECTS = urllib.request.build_opener(_RefuseRedirects)

_MAX_DELAY = 3600.0

log = logging.getLogger(__name__)

# KEYS[1]: the outbox; ARGV[1]: now, ARGV[2]: the claim's end. The due event with the lowest score, claimed.
_CLAIM = """
local due = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', ARGV[1], 'LIMIT', 0, 1)
if #due == 0 then return false end
redis.call('ZADD', KEYS[1], ARGV[2], due[1])
return due[1]
"""


class Deliverer(threading.Thread):
    """Delivers the outbox's due events, one at a time, until `stopping` is set."""

    def __init__(self, records: Records, url: str, secret: str, timeout: float, max_attempts: int,
                 stopping: threading.Event) -> None:
        super().__init__(name="webhook-deliverer", daemon=True)
        self.redis = records.redis
        self.url = url
        self.signer = Webhook(secret)
        self.timeout = timeout
        self.max_attempts = max_attempts
        self.stopping = stopping
        self._claim = self.redis.register_script(_CLAIM)

    def run(self) -> None:
        while not self.stopping.is_set():
            try:
                delivered = self.deliver_one()
            except Exception:
                log.exception("webhook delivery failed; trying again")
                delivered = False
            if not delivered:
                self.stopping.wait(0.5)

    def deliver_one(self) -> bool:
        """Claim and deliver one due event; False when none is due."""
        now = time.time()
        claimed = self._claim(keys=[OUTBOX], args=[now, now + 2 * self.timeout + 5])
        if claimed is None:
            return False
        event_id = claimed.decode()
        body = self.redis.hget(EVENTS, event_id)
        if body is None:  # delivered by another server meanwhile (a late failure there may have counted an attempt)
            self._forget(event_id)
            return True
        problem = self.post(event_id, body)
        if problem is None:
            self._forget(event_id)
            log.info("webhook %s delivered", event_id)
            return True
        attempts = self.redis.hincrby(ATTEMPTS, event_id, 1)
        if attempts >= self.max_attempts:
            log.error("webhook %s: giving up after %d failed deliveries (last: %s)", event_id, attempts, problem)
            self._forget(event_id)
        else:
            delay = min(_MAX_DELAY, 2.0 ** (attempts - 1))
            log.warning("webhook %s: delivery %d failed (%s); again in %.0fs", event_id, attempts, problem, delay)
            self.redis.zadd(OUTBOX, {event_id: time.time() + delay})
        return True

    def _forget(self, event_id: str) -> None:
        """The event is done with (delivered, or given up): out of the outbox, its body and attempt count gone."""
        self.redis.pipeline().zrem(OUTBOX, event_id).hdel(EVENTS, event_id).hdel(ATTEMPTS, event_id).execute()

    def post(self, event_id: str, body: bytes) -> str | None:
        """POST the signed event; None on a 2xx answer, else what went wrong."""
        stamp = datetime.now(tz=timezone.utc)
        headers = {"Content-Type": "application/json", "webhook-id": event_id,
                   "webhook-timestamp": str(int(stamp.timestamp())),
                   "webhook-signature": self.signer.sign(event_id, stamp, body.decode())}
        request = urllib.request.Request(self.url, data=body, headers=headers, method="POST")
        try:
            with _NO_REDIRECTS.open(request, timeout=self.timeout) as response:
                return None if 200 <= response.status < 300 else f"HTTP {response.status}"
        except urllib.error.HTTPError as exc:
            return f"HTTP {exc.code}"
        except (OSError, ValueError) as exc:
            return f"{type(exc).__name__}: {exc}"
