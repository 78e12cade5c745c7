"""tokenmill's Redis transport: kombu's, except that taking a message and recording it as in flight is atomic.

kombu's Redis transport pops a message with BRPOP and only then records it as unacked (HSET `unacked`,
ZADD `unacked_index`). A worker killed, or a Redis restarted, between those two steps loses the message:
it is on no list and in no hash. This transport uses the reliable-queue pattern instead:

1. `BLMOVE <queue> <processing list> RIGHT LEFT`: the message moves, in one Redis command, from the
   queue into a processing list owned by this consumer (one per channel and source list; registered in
   the hash `tokenmill:consumers` with a heartbeat key `tokenmill:consumer:<id>` that expires unless
   the consumer keeps renewing it).
2. One Lua script (atomic in Redis, and one entry in the append-only file) removes it from the
   processing list and writes kombu's unacked records (same format, so kombu's visibility-timeout
   sweep and `reject(requeue=True)` work unchanged). It finds the items at the head of the processing
   list, where the take put them, so they do not cross the socket again. Only then is the message
   handed to Celery.

A message is therefore always on a queue, in a processing list or in `unacked`, whatever moment a
worker or Redis dies. A consumer that died between the two steps leaves a message in its processing
list; every consumer's periodic sweep (`QoS.restore_visible`, also run at start) moves the lists of
consumers whose heartbeat expired back onto their queues, each list in one Lua script, so two sweeps
never both requeue it. What kombu already does with `unacked` is kept: a message unacked for longer
than the visibility timeout (its worker stopped renewing its lease, see `tokenmill.worker.leases`)
goes back to its queue. Delivery is at-least-once; job ids are idempotency keys (see `WorkerService`),
so a second delivery of a finished job is acknowledged without running it.

Other changes to kombu's channel, each for a fault seen in practice:

* A raw item on the queue that is not a well-formed kombu envelope (not JSON, not an object,
  `properties` or `headers` of the wrong type, no `delivery_tag`, a body its `body_encoding` cannot
  decode, ...) would raise inside kombu and stop the consumer. It is moved to the bounded list
  `tokenmill:malformed` instead (logged with its reason and size, never its content).
* `restore_at_shutdown` is off: on a broker reconnect Celery keeps running its jobs and acks them
  later through the old channel, so kombu's requeue of the old channel's messages only made them run
  twice. A job held by a worker that really stops is requeued by the visibility timeout instead.
* The old channel can still ack after its transport was closed: its Redis connection parameters are
  kept (kombu recomputes them from the closed transport and fails with `'NoneType' object has no
  attribute 'hostname'`, which stopped workers on a Redis restart).
* A take whose reply is lost with its connection (kombu drops a connection whose reply is overdue, or one
  the server closed, and takes again on a new one without reading the old) leaves what Redis moved for it
  in this live consumer's processing lists, where no sweep looks while its heartbeat lives: the next take
  first puts them back on their queues (`Channel._return_unread`). Every take tells kombu when it was
  sent, as BLMOVE did, so that kombu's check of an overdue reply measures the take's own wait.
* Fair shares (`tokenmill.queue.names.SHARE_HEADER`): a message published with a share waits on its share's list
  of the queue; a take serves the queue's own lists and each share's in turn, one message at a time, so one run's
  or tenant's backlog does not hold the others' messages behind it. A share's messages are taken into one processing
  list per queue and consumer, and requeued to the queue's own list if never recorded.

Producers need nothing of this: messages are published exactly as kombu's Redis transport does, so
plain `redis://` URLs and plain Celery apps keep working, and their jobs get the same guarantee
because the guarantee is on the consuming side. Torch-free.
"""

from __future__ import annotations

import json
import logging
import threading
import uuid
import weakref
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from time import monotonic, sleep, time
from typing import Any

from kombu.exceptions import DecodeError
from kombu.transport import redis as kombu_redis
from kombu.transport import virtual
from kombu.utils.objects import cached_property

from tokenmill.queue import fastjson
from tokenmill.queue.batching import Coalescer, HeldScript
from tokenmill.queue.names import (JOBS_HEADER, SHARE_BELL, SHARE_HEADER, SHARE_LIST, SHARE_TURN_KEY, SHARES_KEY,
                                   valid_share)
from tokenmill.queue.packing import PACKER_OPTIONS

log = logging.getLogger(__name__)

#: Hash: processing list key -> JSON {"consumer": id, "source": queue list key}.
CONSUMERS_KEY = "tokenmill:consumers"
#: A consumer's heartbeat; it exists while the consumer lives.
HEARTBEAT_KEY = "tokenmill:consumer:{consumer}"
#: A consumer's processing list for one source list.
PROCESSING_KEY = "tokenmill:processing:{consumer}:{source}"
#: The last `MALFORMED_KEEP` raw items that were not kombu messages (newest first, each cut to
#: `MALFORMED_BYTES`), kept for inspection only.
MALFORMED_KEY = "tokenmill:malformed"
MALFORMED_KEEP = 100
MALFORMED_BYTES = 64 * 1024

# KEYS: unacked, unacked_index, malformed, then the processing lists a take moved items into, then the lists the take
# took from (for a queue's shares, its share index). ARGV[1]: now, ARGV[2]: bytes of a set-aside copy, ARGV[3]: copies
# kept, ARGV[4]: how many of the KEYS are lists taken from (m, the last m); then per processing list: how many taken items are to be recorded (n), then
# per item, in the order taken: its delivery tag and the end of its unacked record (exchange and routing key as
# JSON: kombu's record `[item, exchange, routing key]` is built here). The take pushed each item at its list's head,
# and nothing else pushes there, so the n items are the list's first n, the last taken first: the items never cross
# the socket again (a job's envelope is kilobytes, and packing it again would cost the worker per job).
# Returns per item 1 when recorded; -1 when its tag is already in flight (a producer reused it: the item is set
# aside in malformed); 2 for every item of a list whose head is not those items (each holds its tag; a sweep
# requeued the list because this consumer's heartbeat lapsed): nothing of that list is touched, and the caller
# records them by content (`_RECORD_ITEMS`), which tells a requeued item apart. Then, last, how many of the lists
# taken from still hold messages (0: the consumer blocks next instead of taking again, `Channel._brpop_read`).
# Every script that sets an item aside does it with this function: its first `bytes` kept, the newest `keep` items.
_SET_ASIDE = """
local function set_aside(malformed, item, bytes, keep)
  redis.call('LPUSH', malformed, string.sub(item, 1, tonumber(bytes)))
  redis.call('LTRIM', malformed, 0, tonumber(keep) - 1)
end
"""
_RECORD = _SET_ASIDE + """
local codes, at = {}, 5
local sources = #KEYS - tonumber(ARGV[4])
for k = 4, sources do
  local n = tonumber(ARGV[at])
  local items = redis.call('LRANGE', KEYS[k], 0, n - 1)
  local whole = #items == n
  for j = 1, n do
    if not whole then break end
    whole = string.find(items[n + 1 - j], ARGV[at - 1 + 2 * j], 1, true) ~= nil
  end
  for j = 1, n do
    local tag = ARGV[at - 1 + 2 * j]
    if not whole then
      codes[#codes + 1] = 2
    elseif redis.call('HEXISTS', KEYS[1], tag) == 1 then
      set_aside(KEYS[3], items[n + 1 - j], ARGV[2], ARGV[3])
      codes[#codes + 1] = -1
    else
      redis.call('HSET', KEYS[1], tag, '[' .. items[n + 1 - j] .. ', ' .. ARGV[at + 2 * j] .. ']')
      redis.call('ZADD', KEYS[2], ARGV[1], tag)
      codes[#codes + 1] = 1
    end
  end
  if whole then redis.call('LTRIM', KEYS[k], n, -1) end
  at = at + 1 + 2 * n
end
codes[#codes + 1] = sources < #KEYS and redis.call('EXISTS', unpack(KEYS, sources + 1)) or 0
return codes
"""
# As `_RECORD`, for items found where `_RECORD` did not expect them, each sent whole and found by its content.
# KEYS: unacked, unacked_index, malformed, then each item's processing list. ARGV[1]: now, ARGV[2]: bytes of a
# set-aside copy, ARGV[3]: copies kept; then per item: item, delivery tag, the end of its unacked record. Returns
# per item `_RECORD`'s codes, but 0 when the item is no longer in its processing list (a sweep requeued it), whether
# or not another consumer has taken and recorded it since (its tag in flight then is no reuse).
_RECORD_ITEMS = _SET_ASIDE + """
local codes = {}
for i = 4, #KEYS do
  local item, tag, tail = ARGV[3 * i - 8], ARGV[3 * i - 7], ARGV[3 * i - 6]
  if redis.call('LREM', KEYS[i], 1, item) == 0 then
    codes[i - 3] = 0
  elseif redis.call('HEXISTS', KEYS[1], tag) == 1 then
    set_aside(KEYS[3], item, ARGV[2], ARGV[3])
    codes[i - 3] = -1
  else
    redis.call('HSET', KEYS[1], tag, '[' .. item .. ', ' .. tail .. ']')
    redis.call('ZADD', KEYS[2], ARGV[1], tag)
    codes[i - 3] = 1
  end
end
return codes
"""
# KEYS: the n source lists in kombu's order, their n processing lists, then for each of the m queues taken from: its
# share index, the processing list of its shares' messages; last, the turn counter. ARGV[1]: the most items to move,
# ARGV[2]: n, ARGV[3]: m, ARGV[4]: the most jobs (an item's jobs: its `JOBS_HEADER` value, else 1; the first item is
# taken whatever its jobs), then the m queues' share list prefixes, then kombu's priority suffixes in order.
# Lanes: the source lists together (kombu's order: the first non-empty list gives the lane's next item), and each
# share of the index (its priority lists in order). Takes one item from each lane in turn, starting one lane further
# each take when there are shares, until the limit or every lane is empty; a share found empty leaves the index. Once
# the jobs reach ARGV[4], the round ends with the lanes whose next item is a single job, so a lone job never waits a
# take behind another lane's group. Each item moves, oldest first, from its list to its lane's processing list (what
# BLMOVE does for one, without blocking).
# A wake-up bell (`SHARE_BELL`) is dropped, never taken. Nothing else runs while the script does, so a list found
# empty stays empty. Returns source index (1..n: the source list; n + j: queue j's shares), item, source index, ...
_TAKE = """
local limit, n, m, room = 2 * tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local lanes = {{at = 1}}
for i = 1, n do lanes[1][i] = {KEYS[i], KEYS[n + i], i} end
for j = 1, m do
  local names = redis.call('SMEMBERS', KEYS[2 * n + j])
  table.sort(names)
  for _, name in ipairs(names) do
    local lane = {at = 1, index = KEYS[2 * n + j], name = name}
    for k = 5 + m, #ARGV do lane[#lane + 1] = {ARGV[4 + j] .. name .. ARGV[k], KEYS[2 * n + m + j], n + j} end
    lanes[#lanes + 1] = lane
  end
end
local function next_item(list, peek)  -- moved to its processing list, or (peek) only looked at; bells dropped
  while true do
    local item
    if peek then item = redis.call('LINDEX', list[1], -1) else item = redis.call('LMOVE', list[1], list[2], 'RIGHT', 'LEFT') end
    if item ~= BELL then return item end
    if peek then redis.call('RPOP', list[1]) else redis.call('LPOP', list[2]) end
  end
end
local turn = #lanes > 1 and redis.call('INCR', KEYS[#KEYS]) or 0
local taken, live, last = {}, 0, false
for _, lane in ipairs(lanes) do if #lane > 0 then live = live + 1 end end
while not last and #taken < limit and live > 0 do
  for k = 1, #lanes do
    local lane = lanes[(turn + k) % #lanes + 1]
    while #taken < limit and lane.at <= #lane do
      local list = lane[lane.at]
      local item = next_item(list, last)
      if item then
        local jobs = tonumber(string.match(item, '"JOBS_HEADER": (%d+)')) or 1
        if last then
          if jobs > 1 then break end
          redis.call('LMOVE', list[1], list[2], 'RIGHT', 'LEFT')
        end
        taken[#taken + 1] = list[3]
        taken[#taken + 1] = item
        room = room - jobs
        last = last or room <= 0
        break
      end
      lane.at = lane.at + 1
      if lane.at > #lane then
        live = live - 1
        if lane.index then redis.call('SREM', lane.index, lane.name) end
      end
    end
  end
end
return taken
""".replace("JOBS_HEADER", JOBS_HEADER).replace("BELL", repr(SHARE_BELL))
#: The most messages one take moves (fewer when fewer prefetch slots are free). Under load one take and one
#: record script serve this many messages instead of a BLMOVE, an LLEN round and a record script each.
TAKE_MAX = 64
# KEYS: processing, malformed. ARGV: item, bytes of the copy kept, how many to keep.
_DISCARD = _SET_ASIDE + """
redis.call('LREM', KEYS[1], 1, ARGV[1])
set_aside(KEYS[2], ARGV[1], ARGV[2], ARGV[3])
return 1
"""
# Moves every item of a processing list back to the end of its queue that takes read (the one taken first comes out
# first again). Every script that requeues a processing list does it with this function.
_REQUEUE = """
local function requeue(processing, source)
  local moved = 0
  while redis.call('LMOVE', processing, source, 'LEFT', 'RIGHT') do moved = moved + 1 end
  return moved
end
"""
# KEYS: consumers, processing, heartbeat, source. ARGV: the processing key (its field in `consumers`).
# Requeues a dead consumer's processing list at the head of its queue; -1 while the consumer lives.
_RECOVER = _REQUEUE + """
if redis.call('EXISTS', KEYS[3]) == 1 then return -1 end
local moved = requeue(KEYS[2], KEYS[4])
redis.call('HDEL', KEYS[1], ARGV[1])
return moved
"""
# KEYS: a live consumer's processing lists, then their queues (as many). Requeues every item of each: what a take
# whose reply never came moved there (`Channel._return_unread`). Returns the items moved.
_RETURN = _REQUEUE + """
local n = #KEYS / 2
local moved = 0
for i = 1, n do moved = moved + requeue(KEYS[i], KEYS[n + i]) end
return moved
"""

#: Every QoS of this process, old channels' included: their held messages are renewed until acked.
_live_qos: weakref.WeakSet[QoS] = weakref.WeakSet()
#: Per thread: the acks `acks_together` collects, or None outside it.
_together = threading.local()
#: Set by `hand_back_held`: this process takes no more messages.
_handing_back = threading.Event()


@contextmanager
def acks_together() -> Iterator[None]:
    """Acks made in this thread inside the block (kombu's `Message.ack`, Celery's `Request.acknowledge`) go in one
    round trip per channel when it ends, instead of one each: a thread that finishes many jobs at once acks
    them together, as concurrent pool threads' acks are (`QoS.ack`). If Redis fails, each message's local record
    still goes (its lease is no longer renewed, so the visibility timeout redelivers it; its result is stored)."""
    held: list[tuple[QoS, str]] = []
    _together.held = held
    try:
        yield
    finally:
        _together.held = None
        by_qos: dict[QoS, list[str]] = {}
        for qos, tag in held:
            by_qos.setdefault(qos, []).append(tag)
        for qos, tags in by_qos.items():
            try:
                qos._ack_many(tags)
            except Exception as exc:  # noqa: BLE001: the other channels' acks still go
                log.warning("could not ack %d messages: %r", len(tags), exc)
            finally:
                for tag in tags:
                    virtual.QoS.ack(qos, tag)


def ack_records(messages: list[Any]) -> list[tuple[str, str, str] | None]:
    """Per message, (unacked hash, unacked index, delivery tag): what acking it removes from Redis (`QoS._ack_many`),
    for a script that acks it together with other writes; None for a message of another transport or acked already.
    The keys are looked up once per channel, not per message (kombu's cached properties)."""
    keys: dict[int, tuple[str, str] | None] = {}
    records: list[tuple[str, str, str] | None] = []
    for message in messages:
        qos = getattr(getattr(message, "channel", None), "qos", None)
        found = keys.get(id(qos), False)
        if found is False:
            found = keys[id(qos)] = (qos.unacked_key, qos.unacked_index_key) if isinstance(qos, QoS) else None
        records.append(None if found is None or message.acknowledged else (*found, message.delivery_tag))
    return records


def acked_by_script(message: Any) -> None:
    """The rest of an ack whose Redis records a script removed (`ack_records`): the message's prefetch slot frees and
    its lease is no longer renewed. On the consumer's thread, as kombu acks."""
    virtual.QoS.ack(message.channel.qos, message.delivery_tag)
    message._state = "ACK"  # kombu's `Message.ack` marks it so


def _take_turn() -> None:
    """Nothing: called on the consumer's loop, the turn it runs takes when the consumer has room."""


def jobs_ended(task_id: str, count: int) -> None:
    """A group message (`JOBS_HEADER`) held by this process, Celery task `task_id`, has `count` more jobs ended: the
    consumer counts them against its prefetch no more, so it takes more work as a group's short jobs end, not only
    once its longest one has (the message is still acked after all its results are stored). Any thread; the room
    shows at the consumer loop's next turn. Never raises: a failure is logged, and the message's ack frees its room."""
    try:
        for qos in list(_live_qos):
            if qos.jobs_ended(task_id, count):
                return
    except Exception:  # noqa: BLE001: bookkeeping of the prefetch room never fails a group; its ack frees all
        log.exception("could not count %d ended jobs of %r against the prefetch", count, task_id)


def held_deliveries() -> dict[str, list[str]]:
    """Delivery tags held (delivered, not acked) by this process, by `unacked_index` key."""
    held: dict[str, list[str]] = {}
    for qos in list(_live_qos):
        tags = _held_tags(qos)
        if tags:
            held.setdefault(qos.unacked_index_key, []).extend(tags)
    return held


def hand_back_held(settle: float = 1.0) -> int:
    """Stop taking messages and put every message this process holds back at the head of its queue, for another
    worker to run now rather than after the visibility timeout: for a worker about to exit because it cannot run them.
    Returns how many went back. A message whose result is stored meanwhile is run by nobody: its next delivery finds
    the result. Any thread; the caller bounds the time it waits (Redis may be down).

    A take already waiting on an empty queue (BLMOVE) is answered by the first message put back, and its reply may
    never be read (no take is made once this is called): each round also returns what the takes moved into this
    process's processing lists unrecorded, and the rounds go on until none has found a message for `settle` seconds."""
    _handing_back.set()
    returned, quiet_since = 0, monotonic()
    while monotonic() - quiet_since < settle:
        for qos in list(_live_qos):
            moved = 0
            for tag in _held_tags(qos):
                kombu_redis.QoS.restore_by_tag(qos, tag)
                virtual.QoS.ack(qos, tag)  # the local record only, as `reject` drops it
                moved += 1
            moved += qos.channel._return_unread()
            if moved:
                returned, quiet_since = returned + moved, monotonic()
        sleep(settle / 4)
    return returned


def _held_tags(qos: QoS) -> list[str]:
    for _ in range(3):  # acks from pool threads may resize the dict while it is copied
        try:
            return [tag for tag in list(qos._delivered) if tag not in qos._dirty]
        except RuntimeError:
            continue
    return []


def envelope_problem(payload: Any, decode_body: Any) -> str | None:
    """Why a decoded queue item is not a kombu message that kombu and Celery can handle, or None."""
    if not isinstance(payload, dict):
        return "not a JSON object"
    properties = payload.get("properties")
    if not isinstance(properties, dict):
        return "'properties' is not an object"
    if not isinstance(properties.get("delivery_tag"), str) or not properties["delivery_tag"]:
        return "no 'delivery_tag' string in 'properties'"
    info = properties.get("delivery_info")
    if not isinstance(info, dict) or not isinstance(info.get("exchange"), str) or not isinstance(info.get("routing_key"), str):
        return "'delivery_info' is not an object with 'exchange' and 'routing_key' strings"
    if not isinstance(payload.get("headers") or {}, dict):
        return "'headers' is not an object"
    for name in ("content-type", "content-encoding"):
        if payload.get(name) is not None and not isinstance(payload[name], str):
            return f"'{name}' is not a string"
    priority = properties.get("priority")
    if priority is not None and (isinstance(priority, bool) or not isinstance(priority, int)):
        return "'priority' is not an integer"
    body, encoding = payload.get("body"), properties.get("body_encoding")
    if body is not None and not isinstance(body, str):
        return "'body' is not a string"
    if encoding is not None and not isinstance(encoding, str):
        return "'body_encoding' is not a string"
    if body:
        try:
            decode_body(body, encoding)
        except Exception:
            return f"the body cannot be decoded as {encoding!r}"
    return None


class QoS(kombu_redis.QoS):
    """kombu's Redis QoS for messages that the channel already recorded as unacked."""

    restore_at_shutdown = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        _live_qos.add(self)
        self._acks: Coalescer[str, None] = Coalescer(self._ack_many, limit=1000)
        self._jobs: dict[str, int] = {}  # delivery tag -> the jobs of a held message carrying more than one
        self._jobs_lock = threading.Lock()  # `jobs_ended` writes `_jobs` from the threads running groups

    def can_consume_max_estimate(self) -> int | None:
        """Free prefetch slots, in jobs: a message counts its `JOBS_HEADER` jobs (a group's) less those ended
        (`jobs_ended`), any other one. Only the consumer's loop thread appends; a tag acked meanwhile is dropped here."""
        room = super().can_consume_max_estimate()
        if room is None or not self._jobs:
            return room
        held, dirty = self._delivered, self._dirty
        with self._jobs_lock:
            for tag, jobs in list(self._jobs.items()):
                if tag in held and tag not in dirty:
                    room -= jobs - 1
                else:
                    del self._jobs[tag]
        return room

    def jobs_ended(self, task_id: str, count: int) -> bool:
        """`count` more jobs of the held message of Celery task `task_id` ended: they hold no prefetch room, the message
        one until acked. The newest delivery of the task if this consumer holds two (a message queued twice: the second
        ends at once, its jobs running in the first). False if no such message is held here."""
        could = self.can_consume()
        with self._jobs_lock:
            found = next((tag for tag in reversed(list(self._jobs)) if (
                getattr(self._delivered.get(tag), "headers", None) or {}).get("id") == task_id), None)
            if found is not None:
                self._jobs[found] = max(1, self._jobs[found] - count)
        if found is not None and not could and self.can_consume():
            self._wake_loop()  # the loop registers no take while the consumer has no room: it would sleep on
        return found is not None

    def _wake_loop(self) -> None:
        """A turn of the consumer's loop now, from another thread: it takes when it has room (`can_consume`)."""
        loop = getattr(self.channel.connection, "event_loop", None)
        if loop is not None:
            loop.call_soon(_take_turn)

    def can_consume(self) -> bool:
        """As kombu, but with `Channel.take_at_least` free prefetch slots (at most a take's `TAKE_MAX`), once the worker
        holds more than the rest: a full worker refills in batches, not a message or two per engine step."""
        if _handing_back.is_set():
            return False
        room = self.can_consume_max_estimate()
        return room is None or room >= min(self.channel.take_at_least, self.prefetch_count, TAKE_MAX)

    def append(self, message: Any, delivery_tag: str) -> None:
        jobs = (message.headers or {}).get(JOBS_HEADER)
        if isinstance(jobs, int) and jobs > 1 and self.prefetch_count:  # no limit: nothing to count against
            with self._jobs_lock:
                self._jobs[delivery_tag] = jobs
        claimed = self.channel.claimed_tags
        if delivery_tag in claimed:  # recorded in Redis by the claim script: only the local record is left
            claimed.discard(delivery_tag)
            virtual.QoS.append(self, message, delivery_tag)
        else:  # basic_get, or a message rejected back by kombu
            super().append(message, delivery_tag)

    def ack(self, delivery_tag: str) -> None:
        """As kombu, but acks from several pool threads at once go in one round trip (`Coalescer`), and the local
        record goes even if Redis is down (else the prefetch slot leaks). Inside `acks_together`, the ack waits
        for the end of that block."""
        held = getattr(_together, "held", None)
        if held is not None:
            held.append((self, delivery_tag))
            return
        try:
            self._acks.call(delivery_tag)
        finally:
            virtual.QoS.ack(self, delivery_tag)

    def reject(self, delivery_tag: str, requeue: bool = False) -> None:
        """As kombu, but the local record goes even if Redis is down, as `ack`'s does: a message whose requeue failed
        stayed held here, its lease renewed for good (`tokenmill.worker.leases`), so that neither this worker nor the
        visibility timeout ran it again. Its unacked record is still in Redis: the visibility timeout requeues it."""
        try:
            super().reject(delivery_tag, requeue)
        finally:
            virtual.QoS.ack(self, delivery_tag)

    def _ack_many(self, tags: list[str]) -> list[None]:
        with self.channel.conn_or_acquire() as client:
            client.pipeline().zrem(self.unacked_index_key, *tags).hdel(self.unacked_key, *tags).execute()
        return [None] * len(tags)

    def restore_visible(self, start: int = 0, num: int = 10, interval: int = 10) -> None:
        self.channel.recover_orphans()
        super().restore_visible(start, num, interval)


class Message(kombu_redis.Channel.Message):
    """kombu's message, its JSON body read by `fastjson.loads` directly (the same values as kombu's JSON codec):
    kombu's registry wraps each decode in a generator context manager, which costs as much as the decode itself.
    Other content types, and a consumer without an accept list, are kombu's."""

    def _decode(self) -> Any:
        if self.content_type != "application/json" or not self.body or self.accept is None or (
                "application/json" not in self.accept):
            return super()._decode()
        try:
            return fastjson.loads(self.body)
        except Exception as exc:  # as kombu's registry: any decoding error is a DecodeError
            raise DecodeError(exc) from exc


class Channel(kombu_redis.Channel):
    """kombu's Redis channel with an atomic take-and-record (see the module docstring)."""

    QoS = QoS
    Message = Message
    #: Seconds a consumer's heartbeat lives; renewed every quarter of it.
    consumer_ttl = 60.0
    #: Free prefetch slots a consumer waits for before it takes more (`QoS.can_consume`). A worker whose engine
    #: keeps a queue of its own sets it to half that queue (`WorkerSettings.take_at_least`): jobs ending a few per
    #: engine step are then replaced some dozens at a time, each take, record, check-in and engine message shared
    #: by many jobs, while the engine's queue still covers the wait. 1 takes as soon as one slot frees (kombu).
    take_at_least = 1
    from_transport_options = kombu_redis.Channel.from_transport_options + ("consumer_ttl", "take_at_least")

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.consumer_id = uuid.uuid4().hex
        self._params: dict[bool, dict[str, Any]] = {}
        self._sources: set[str] = set()
        self._blmove_source: str | None = None
        self._take_many = True  # whether the next poll takes without blocking (the last one found messages)
        self._found_empty = False  # whether the last poll was a take that found every list empty
        self._take_keys: list[str] = []  # the lists the last take or BLMOVE took from, in kombu's order
        self._unread = False  # a take or BLMOVE was sent whose items are not recorded yet (see `_return_unread`)
        self._processing_keys: dict[str, str] = {}
        self._share_sources: dict[str, tuple[str, str]] = {}  # a queue's shares' source -> (the queue, its index)
        self._decoded_bodies: dict[int, tuple[str, str, Any]] = {}  # id(body) -> (body, encoding, decoded), one take's
        self._record_tails: dict[tuple[str, str], bytes] = {}  # (exchange, routing key) -> their JSON in a record
        self._beat_at = float("-inf")
        self._no_ack_queues: set[str] = set()
        self._sync_client: Any = None
        super().__init__(*args, **kwargs)
        if self.global_keyprefix:  # BLMOVE and the scripts name raw keys
            raise ValueError("tokenmill's Redis transport does not support the global_keyprefix transport option")
        self._connparams(asynchronous=False)  # keep both parameter sets while the transport is open

    @property
    def claimed_tags(self) -> set[str]:
        return self.connection.claimed_tags if self.connection is not None else set()

    def _connparams(self, asynchronous: bool = False) -> dict[str, Any]:
        transport = self.connection
        if transport is not None and transport.client is not None:
            self._params[asynchronous] = {**super()._connparams(asynchronous=asynchronous), **PACKER_OPTIONS}
        return dict(self._params[asynchronous])

    @contextmanager
    def conn_or_acquire(self, client: Any = None) -> Iterator[Any]:
        """As kombu, but one client per pool instead of a new `redis.Redis` per call (costly with redis-py 8, and
        several per message: take, record, ack). A client only borrows pooled connections per command and is
        thread-safe; a new one is made when kombu replaces the pool (after a connection error)."""
        if client:
            yield client
            return
        pool = self.pool
        if self._sync_client is None or self._sync_client.connection_pool is not pool:
            self._sync_client = self._create_client()
        yield self._sync_client

    @cached_property
    def _scripts(self) -> dict[str, Any]:
        """The record script, run at every take (a lone job's among them), on a connection held for it
        (`HeldScript`); the rarer ones through redis-py's client."""
        client = self.Client(connection_pool=self.pool)
        scripts = (("record items", _RECORD_ITEMS), ("discard", _DISCARD), ("recover", _RECOVER), ("return", _RETURN))
        return {"record": HeldScript(client, _RECORD), **{name: client.register_script(text) for name, text in scripts}}

    def _processing_key(self, source: str) -> str:
        key = self._processing_keys.get(source)
        if key is None:
            key = self._processing_keys[source] = PROCESSING_KEY.format(consumer=self.consumer_id, source=source)
        return key

    @property
    def _heartbeat_key(self) -> str:
        return HEARTBEAT_KEY.format(consumer=self.consumer_id)

    # -- publishing ----------------------------------------------------------------------

    def _put(self, queue: str, message: dict[str, Any], **kwargs: Any) -> None:
        """As kombu, but a message with a share (`SHARE_HEADER`, a valid share name) goes to that share's list of
        the queue, and the share into the queue's index after it: an index never misses a list holding messages.
        Then a bell (`SHARE_BELL`, one a write) on the queue's own list wakes a consumer blocked on it: it takes
        next, and drops the bell."""
        share = (message.get("headers") or {}).get(SHARE_HEADER)
        if not valid_share(share) or (self._expires and queue in self._expires):
            return super()._put(queue, message, **kwargs)
        key = self._q_for_pri(SHARE_LIST.format(queue=queue, share=share), self._get_message_priority(message, False))
        index = SHARES_KEY.format(queue=queue)
        batch = kwargs.get("_publish_batch")
        if batch is not None:
            batch.add("lpush", key, kombu_redis.dumps(message))
            batch.add("sadd", index, share)
            # one bell a write: on its first message, and on one that kombu's batch writes after a flush (it flushes
            # first when this message's 3 commands would pass its size)
            if not batch._buffered or batch._buffered + 3 > batch.max_size:
                batch.add("lpush", queue, SHARE_BELL)
            return None
        with self.conn_or_acquire() as client:
            pipe = client.pipeline(transaction=False)
            pipe.lpush(key, kombu_redis.dumps(message))
            pipe.sadd(index, share)
            pipe.lpush(queue, SHARE_BELL)
            pipe.execute()
        return None

    # -- taking a message ------------------------------------------------------------------

    def basic_consume(self, queue: str, no_ack: bool, *args: Any, **kwargs: Any) -> Any:
        """As kombu; remembers no-ack queues (reply queues), whose messages get no unacked record."""
        if no_ack:
            self._no_ack_queues.add(queue)
        return super().basic_consume(queue, no_ack, *args, **kwargs)

    def _basic_cancel(self, consumer_tag: str) -> Any:
        self._no_ack_queues.discard(self._tag_to_queue.get(consumer_tag))
        return super()._basic_cancel(consumer_tag)

    def _brpop_start(self, timeout: float | None = None) -> None:
        """Take what is waiting, up to the free prefetch slots, in one script, from the queues' own lists and their
        shares' in turn; when the last take found nothing, or the record of the last take found every list empty,
        block in BLMOVE for the first non-empty list in kombu's order (queues fairly cycled, then priority) instead:
        the first list when that take or record was just now (it checked them all), else the first
        `_choose_source` finds non-empty, unless a share holds messages (then a take). Under a trickle of jobs that
        is a BLMOVE and a record per job, not a take, a check and a BLMOVE. A consumer blocked in BLMOVE on the
        queue's own list is woken for a share's message by the bell its write rang there (`_put`)."""
        if timeout is None:
            timeout = self.brpop_timeout
        if self._unread:
            self._return_unread()
        queues = self._queue_cycle.consume(len(self.active_queues))
        if not queues:
            return
        keys = list(dict.fromkeys(self._q_for_pri(queue, pri) for pri in self.priority_steps for queue in queues))
        shared = [self._shares_source(queue) for queue in dict.fromkeys(queues)]
        room = self.qos.can_consume_max_estimate()
        limit = TAKE_MAX if room is None else min(TAKE_MAX, room)
        self._take_keys = keys + shared
        if self._take_many and limit > 1:
            self._send_take(keys, shared, limit, room)
            return
        if self._found_empty:  # the take or record just before found every list empty: that was the check
            self._register_sources(self._take_keys)
            source: str | None = keys[0]
        else:
            source = self._choose_source(keys, shared)
        if source is None:
            self._send_take(keys, shared, max(1, limit), room)
            return
        self._blmove_source = source
        self._in_poll = self.client.connection
        self._brpop_sent_at = monotonic()
        self._unread = True
        self.client.connection.send_command("BLMOVE", source, self._processing_key(source), "RIGHT", "LEFT", timeout or 0)

    def _send_take(self, keys: list[str], shared: list[str], limit: int, room: int | None) -> None:
        """Send the take script (`_TAKE`) for the source lists `keys` and the shares of `shared`'s queues: at most
        `limit` messages and `room` jobs (None: `limit` jobs)."""
        self._register_sources(self._take_keys)
        self._blmove_source = None
        self._in_poll = self.client.connection
        self._brpop_sent_at = monotonic()  # kombu's check of a reply overdue on a dead connection reads it
        self._unread = True
        suffixes = dict.fromkeys(self._q_for_pri("", pri) for pri in self.priority_steps)
        self.client.connection.send_command(
            "EVAL", _TAKE, 2 * len(keys) + 2 * len(shared) + 1, *keys, *map(self._processing_key, keys),
            *(self._share_sources[source][1] for source in shared), *map(self._processing_key, shared),
            SHARE_TURN_KEY, limit, len(keys), len(shared), limit if room is None else max(1, room), *shared, *suffixes)

    def _shares_source(self, queue: str) -> str:
        """The source standing for `queue`'s shares: their lists' common prefix, whose processing list holds what a
        take moved from any of them (put back on the queue's own list if never recorded)."""
        source = SHARE_LIST.format(queue=queue, share="")
        if source not in self._share_sources:
            self._share_sources[source] = (queue, SHARES_KEY.format(queue=queue))
        return source

    def _requeue_to(self, source: str) -> str:
        """The list a source's items go back to: its own, or for a queue's shares the queue's list."""
        shared = self._share_sources.get(source)
        return source if shared is None else shared[0]

    def _return_unread(self) -> int:
        """Requeue what the last take or BLMOVE moved into this consumer's processing lists and never got recorded:
        its reply was lost with its connection (kombu drops a connection whose reply is overdue, or one the server
        closed, and sends the next take on a new one without reading the old). Those items are on no queue and in
        no `unacked`, and this consumer's heartbeat keeps every sweep from them. Between takes its lists are
        otherwise empty: each take's items leave them in the script that records them. Returns how many."""
        keys = list(self._sources)
        if not keys:
            return 0
        with self.conn_or_acquire() as client:
            moved = self._scripts["return"](keys=[*map(self._processing_key, keys), *map(self._requeue_to, keys)],
                                            client=client)
        self._unread = False
        if moved:
            log.warning("requeued %d message(s) taken by a take whose reply was not read", moved)
        return moved

    def _register_sources(self, keys: list[str]) -> None:
        """Register new processing lists (before anything is moved into them) and renew the heartbeat when due."""
        if any(key not in self._sources for key in keys) or monotonic() - self._beat_at > self.consumer_ttl / 4:
            self._sources.update(keys)
            with self.conn_or_acquire() as client:
                pipe = client.pipeline(transaction=False)
                self._beat(pipe)
                pipe.execute()

    def _choose_source(self, keys: list[str], shared: list[str]) -> str | None:
        """One round trip: register new processing lists, renew the heartbeat, find a non-empty list; None when a
        share of the queues holds messages (a take then serves the shares and the lists in turn).

        BLMOVE watches one list; the others are checked here, so a message on any of them waits at
        most one `brpop_timeout` (1 s) when all were empty at this check.
        """
        with self.conn_or_acquire() as client:
            pipe = client.pipeline(transaction=False)
            fresh = [key for key in keys + shared if key not in self._sources]
            self._sources.update(fresh)
            if fresh or monotonic() - self._beat_at > self.consumer_ttl / 4:
                self._beat(pipe)
            for key in keys:
                pipe.llen(key)
            pipe.exists(*(self._share_sources[source][1] for source in shared))
            *lengths, shares = pipe.execute()[-len(keys) - 1:]
        if shares:
            return None
        return next((key for key, length in zip(keys, lengths) if length), keys[0])

    def _beat(self, pipe: Any) -> None:
        """Queue the heartbeat and the (re-)registration of every processing list of this consumer."""
        for source in self._sources:
            owner = json.dumps({"consumer": self.consumer_id, "source": self._requeue_to(source)})
            pipe.hset(CONSUMERS_KEY, self._processing_key(source), owner)
        pipe.set(self._heartbeat_key, 1, px=int(self.consumer_ttl * 1000))
        self._beat_at = monotonic()

    def _brpop_read(self, **options: Any) -> bool:
        try:
            command = "BLMOVE" if self._blmove_source is not None else "EVAL"
            try:
                reply = self.client.parse_response(self.client.connection, command, **options)
            except self.connection_errors:
                self.client.connection.disconnect()
                raise
            if command == "BLMOVE" and reply == SHARE_BELL.encode():
                self._drop_bell(self._blmove_source)
                self._take_many, self._found_empty, self._unread = True, False, False
                raise kombu_redis.Empty()
            if command == "BLMOVE":
                taken = [(self._blmove_source, reply)] if reply else []
            else:
                taken = [(self._take_keys[int(index) - 1], item) for index, item in zip(reply[::2], reply[1::2])]
            self._take_many = bool(taken)  # found some: more are likely waiting; none: block next time
            self._found_empty = command == "EVAL" and not taken
            if not taken:
                self._unread = False
                raise kombu_redis.Empty()
            for source in dict.fromkeys(source for source, _ in taken):
                self._queue_cycle.rotate(source.rsplit(self.sep, 1)[0])
            delivered, waiting = self._claim_many(taken, self._take_keys)
            self._unread = False
            if waiting == 0:  # a lone message: block next, without a take that finds nothing first
                self._take_many, self._found_empty = False, True
            for payload, queue in delivered:
                self.connection._deliver(payload, queue)
            if not delivered:
                raise kombu_redis.Empty()
            return True
        finally:
            self._in_poll = None
            self._blmove_source = None
            self._flush_brpop_reauth()

    def _drop_bell(self, source: str) -> None:
        """Remove a bell BLMOVE moved into `source`'s processing list (at its head, where BLMOVE put it)."""
        with self.conn_or_acquire() as client:
            client.lrem(self._processing_key(source), 1, SHARE_BELL)

    def _claim_many(self, taken: list[tuple[str, bytes]], sources: Sequence[str] = ()
                    ) -> tuple[list[tuple[dict[str, Any], str]], int | None]:
        """Record the taken items as unacked and remove them from their processing lists, in one atomic
        script; discard those that are no kombu messages. Returns (payload, queue) of the messages to deliver, in the
        order taken, and how many of the `sources` (the lists taken from) still hold messages, which the same script
        counts (None when no record ran or no sources were given).

        Items of a no-ack consumer (as kombu: nothing to acknowledge) are only removed.
        """
        self._decoded_bodies.clear()  # a discarded message's body, left from the last take
        by_list: dict[str, list[tuple[str, bytes, Any, str]]] = {}
        delivered: list[tuple[dict[str, Any], str]] = []
        order: dict[int, int] = {}  # id(payload) -> its place in `taken` (recorded per processing list, not in order)
        for source, item in taken:
            queue = source.rsplit(self.sep, 1)[0]
            processing = self._processing_key(source)
            payload, problem = self._decode(item)
            order[id(payload)] = len(order)
            if problem is None and queue in self._no_ack_queues:
                with self.conn_or_acquire() as client:
                    if client.lrem(processing, 1, item):
                        delivered.append((payload, queue))
                continue
            if problem is not None:
                self._discard(source, item, problem)
                continue
            by_list.setdefault(processing, []).append((source, item, payload, queue))
        if not by_list:
            return delivered, None
        args: list[Any] = [time(), MALFORMED_BYTES, MALFORMED_KEEP, len(sources)]
        for recorded in by_list.values():
            args.append(len(recorded))
            for _, _, payload, _ in recorded:
                args += self._record_args(payload)
        # what the record counts as still holding messages: each list taken from; for a queue's shares, their index
        waiting_keys = [self._share_sources.get(source, (None, source))[1] for source in sources]
        *codes, waiting = self._scripts["record"](
            keys=[self.unacked_key, self.unacked_index_key, MALFORMED_KEY, *by_list, *waiting_keys], args=args)
        results = list(zip([entry for entries in by_list.values() for entry in entries], codes))
        moved = [entry for entry, code in results if code == 2]
        if moved:
            log.warning("%d taken messages were not at the head of their processing list; recording them by content",
                        len(moved))
            results = [result for result in results if result[1] != 2] + list(zip(moved, self._record_items(moved)))
        for (source, item, payload, queue), code in results:
            if code == 1:
                self.claimed_tags.add(payload["properties"]["delivery_tag"])
                delivered.append((payload, queue))
            elif code == -1:  # the script set it aside
                self._log_discarded(source, item, "its delivery_tag is already in flight")
            # 0: a sweep already requeued it: whoever takes it next runs it
        if len(by_list) > 1:
            delivered.sort(key=lambda delivery: order[id(delivery[0])])
        return delivered, waiting if sources else None

    def _record_args(self, payload: dict[str, Any]) -> list[Any]:
        """A message's delivery tag and the end of its unacked record, as the record scripts take them."""
        properties = payload["properties"]
        info = properties["delivery_info"]
        return [properties["delivery_tag"], self._record_tail(info["exchange"], info["routing_key"])]

    def _record_items(self, entries: list[tuple[str, bytes, Any, str]]) -> list[int]:
        """`_RECORD_ITEMS`' codes for (source, item, payload, queue) entries."""
        args: list[Any] = [time(), MALFORMED_BYTES, MALFORMED_KEEP]
        for _, item, payload, _ in entries:
            args += [item, *self._record_args(payload)]
        keys = [self.unacked_key, self.unacked_index_key, MALFORMED_KEY,
                *(self._processing_key(source) for source, *_ in entries)]
        return self._scripts["record items"](keys=keys, args=args)

    def _record_tail(self, exchange: str, routing_key: str) -> bytes:
        """The end of kombu's unacked record `[message, exchange, routing key]` (the record script adds the rest),
        kept per destination."""
        tail = self._record_tails.get((exchange, routing_key))
        if tail is None:
            tail = b"%s, %s" % (json.dumps(exchange).encode(), json.dumps(routing_key).encode())
            if len(self._record_tails) < 1024:  # producers choose these: a bounded cache
                self._record_tails[(exchange, routing_key)] = tail
        return tail

    def _decode(self, item: bytes) -> tuple[Any, str | None]:
        """The item's kombu envelope, and why it is not one kombu and Celery can handle (None if it is)."""
        try:
            payload = fastjson.loads(item)
        except Exception:  # not JSON, too deeply nested, or kombu's object hook refused a "__type__" value
            return None, "not JSON kombu can decode"
        try:
            return payload, envelope_problem(payload, self._decode_body_once)
        except Exception as exc:  # whatever the envelope holds, it must not stop the consumer
            return payload, f"unusable envelope ({type(exc).__name__})"

    def _decode_body_once(self, body: str, encoding: str | None) -> Any:
        """`decode_body`, its result kept for kombu's `Message`, which decodes the same body again as it delivers
        it (base64 of the whole body)."""
        decoded = self.decode_body(body, encoding)
        if encoding:
            self._decoded_bodies[id(body)] = (body, encoding, decoded)
        return decoded

    def decode_body(self, body: Any, encoding: str | None = None) -> Any:
        """As kombu, but a body `_decode_body_once` decoded while checking its envelope is not decoded again."""
        kept = self._decoded_bodies.pop(id(body), None)
        if kept is not None and kept[0] is body and kept[1] == encoding:
            return kept[2]
        return super().decode_body(body, encoding)

    def _discard(self, source: str, item: bytes, problem: str) -> None:
        self._scripts["discard"](keys=[self._processing_key(source), MALFORMED_KEY],
                                 args=[item, MALFORMED_BYTES, MALFORMED_KEEP])
        self._log_discarded(source, item, problem)

    @staticmethod
    def _log_discarded(source: str, item: bytes, problem: str) -> None:
        log.error("discarded a malformed message from %r (%d bytes): %s; kept in the Redis list %s",
                  source, len(item), problem, MALFORMED_KEY)

    # -- consumers that died -----------------------------------------------------------------

    def heartbeat(self) -> None:
        """Renew this consumer's heartbeat and registration (only once it owns processing lists)."""
        if self._sources and not self.closed:
            with self.conn_or_acquire() as client:
                pipe = client.pipeline(transaction=False)
                self._beat(pipe)
                pipe.execute()

    def recover_orphans(self, own: bool = False) -> int:
        """Requeue the processing lists of consumers whose heartbeat expired; returns messages requeued.

        `own`: this channel's lists too (when it closes, after deleting its heartbeat).
        """
        moved = 0
        with self.conn_or_acquire() as client:
            for processing, raw in client.hgetall(CONSUMERS_KEY).items():
                owner = json.loads(raw)
                if owner["consumer"] == self.consumer_id and not own:
                    continue
                count = self._scripts["recover"](
                    keys=[CONSUMERS_KEY, processing, HEARTBEAT_KEY.format(consumer=owner["consumer"]), owner["source"]],
                    args=[processing], client=client)
                if count > 0:
                    log.warning("requeued %d message(s) that consumer %s took and died before recording", count, owner["consumer"])
                    moved += count
        return moved

    def close(self) -> None:
        """Put back a message a pending BLMOVE may have taken, and unregister, before kombu's close."""
        if not self.closed:
            try:
                if self._in_poll:
                    self._in_poll = None
                    self.client.parse_response(self.client.connection, "BLMOVE" if self._blmove_source else "EVAL")
            except Exception:
                pass  # its item (if any) stays in the processing list; the recovery below or a sweep requeues it
            try:
                if self._sources:
                    with self.conn_or_acquire() as client:
                        client.delete(self._heartbeat_key)
                    self.recover_orphans(own=True)
            except self.connection_errors:
                pass  # Redis is down: the heartbeat expires and another consumer's sweep requeues
        super().close()


class Transport(kombu_redis.Transport):
    """kombu's Redis transport with `Channel` above and a periodic heartbeat of its consumers."""

    Channel = Channel

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        #: Delivery tags the claim script recorded, between the claim and kombu's `QoS.append`.
        self.claimed_tags: set[str] = set()
        #: The consumer's event loop (kombu's `Hub`), once registered: `QoS.jobs_ended` wakes it from other threads.
        self.event_loop: Any = None

    def register_with_event_loop(self, connection: Any, loop: Any) -> None:
        super().register_with_event_loop(connection, loop)
        self.event_loop = loop
        cycle = self.cycle
        old = getattr(cycle, "_heartbeat_tref", None)
        if old is not None:
            old.cancel()
        ttl = float(connection.client.transport_options.get("consumer_ttl", Channel.consumer_ttl))
        cycle._heartbeat_tref = loop.call_repeatedly(max(0.1, ttl / 4), self._beat)

    def _beat(self) -> None:
        for channel in list(self.cycle._channels):
            try:
                channel.heartbeat()
            except channel.connection_errors:
                return  # broker down: kombu reconnects; a new channel gets a new heartbeat
