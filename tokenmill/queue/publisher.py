"""Publishing Celery task messages to one queue: built by Celery and kombu, written on kombu channels kept open.

Why not Celery's `send_task_message` through a pooled producer, as a Celery app publishes: for one job, after a
pause (the lone job a client submits now and then), its way from the producer pool through kombu's retry wrapper,
`Producer.publish` and the queue's declaration to the LPUSH costs the client more than this path does, and the
worker waits for that LPUSH (docs/benchmarks/queue.md: `benchmarks/client_publish.py`).

The message is the one Celery sends: `app.amqp.as_task_v2` makes its headers, properties and body, kombu's
serializer its bytes (a job's by orjson, to the same values: `Publisher.send`) and kombu's Redis channel its envelope
(`prepare_message`, `basic_publish`: delivery tag, body encoding, the list named for its priority), so any Celery
worker takes it. Celery's `before_task_publish` and
`after_task_publish` signals are sent as Celery sends them (tracing integrations add headers there). The queue is
declared once per channel, as kombu's producer does at its first publish. Torch-free.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

from celery.signals import after_task_publish, before_task_publish
from kombu import serialization
from kombu.entity import maybe_delivery_mode
from kombu.exceptions import BatchPublishError

from tokenmill.queue import fastjson
from tokenmill.queue.names import SHARE_HEADER, valid_share


#: Channels a publisher keeps open between publishes (more are opened while more threads publish at once, and
#: closed after).
IDLE_CHANNELS = 8


class Publisher:
    """Task messages to `queue` of `app`'s broker; any thread may publish (each publish on a channel of its own).
    With a `share`, every message goes to that fair share of the queue (`tokenmill.queue.names.SHARE_HEADER`)."""

    def __init__(self, app: Any, queue: str, share: str | None = None) -> None:
        if share is not None and not valid_share(share):
            raise ValueError(f"share: 1 to 64 of A-Z a-z 0-9 . _ -, got {share!r}")
        self.app = app
        self.queue = queue
        self.share = share
        self._delivery_mode = maybe_delivery_mode(app.conf.task_default_delivery_mode)
        self._idle: list[Any] = []  # open channels no publish holds, the last used last
        self._closed = False
        self._lock = threading.Lock()
        self._errors: tuple[type[BaseException], ...] = (
            *app.connection_for_write().connection_errors, BatchPublishError)

    def publish(self, name: str, task_id: str, args: list[Any], argsrepr: str, headers: dict[str, Any] | None = None,
                free_form: tuple[Any, ...] | None = None, **options: Any) -> None:
        """Queue one task message (one LPUSH). On a broken connection the message is published once more, on another
        channel: it was not queued, or a worker takes it twice, which a job's id makes harmless (as kombu's retrying
        publish). `free_form`: see `send`."""
        try:
            with self._channel() as channel:
                self.send(channel, channel.basic_publish, name, task_id, args, argsrepr, headers, options, free_form)
        except self._errors:
            with self._channel() as channel:
                self.send(channel, channel.basic_publish, name, task_id, args, argsrepr, headers, options, free_form)

    @contextlib.contextmanager
    def batch(self, max_size: int) -> Iterator[PublishBatch]:
        """Messages published inside are written in pipelined writes of up to `max_size` (and at each `flush`), the
        rest when the block ends; on an error inside, the unwritten ones are dropped. A broken connection raises
        `kombu.exceptions.BatchPublishError` (some messages may have been queued)."""
        with self._channel() as channel:
            batch = PublishBatch(self, channel, max_size)
            try:
                yield batch
                batch.flush()
            except BaseException:
                batch.discard()
                raise
            finally:
                batch.close()

    def close(self) -> None:
        """Close the idle channels' connections; a channel in use is closed when its publish ends."""
        with self._lock:
            self._closed, (idle, self._idle) = True, (self._idle, [])
        for channel in idle:
            _release(channel)

    def send(self, channel: Any, put: Any, name: str, task_id: str, args: list[Any], argsrepr: str,
             headers: dict[str, Any] | None, options: dict[str, Any], free_form: tuple[Any, ...] | None = None) -> None:
        """Make the message as kombu's Redis transport queues it and hand it to `put` (`channel.basic_publish`, or a
        publish batch's `publish`, which completes its envelope), between Celery's two publish signals.

        `free_form`: the parts of `args` that may hold any JSON value, the rest holding only strings, integers and
        finite numbers (`tokenmill.queue.schemas.free_form` of each job). Given, the body is written by orjson where
        it writes the values the stdlib writes (`fastjson.dumps`: compact, UTF-8), faster than kombu's serializer;
        not given (any other task's arguments), kombu's serializer writes it."""
        message_headers, properties, body, _ = self.app.amqp.as_task_v2(
            task_id, name, args=args, kwargs={}, argsrepr=argsrepr, kwargsrepr="{}", **options)
        message_headers.update(headers or {})
        if self.share is not None:
            message_headers[SHARE_HEADER] = self.share
        before_task_publish.send(sender=name, body=body, exchange="", routing_key=self.queue, declare=[self.queue],
                                 headers=message_headers, properties=properties, retry_policy={})
        # a handler of that signal may have put in the body what kombu's encoder writes its own way (a datetime, a
        # UUID): with handlers connected the whole body is checked, and such a body is kombu's to write
        checked = free_form if free_form is None or not before_task_publish.receivers else (body,)
        content_type, content_encoding, data = _serialized(body, checked)
        properties["delivery_mode"] = self._delivery_mode
        put(channel.prepare_message(data, None, content_type, content_encoding, message_headers, properties),
            exchange="", routing_key=self.queue)
        after_task_publish.send(sender=name, body=body, exchange="", routing_key=self.queue)

    @contextlib.contextmanager
    def _channel(self) -> Iterator[Any]:
        """A channel for this block alone (a kombu channel is not thread-safe): the last one used, else a new one.
        After the block it is kept for the next (up to `IDLE_CHANNELS`), or closed, and always when its connection
        broke. Kept, not per thread: a thread started per job would have left a connection behind each."""
        with self._lock:
            channel = self._idle.pop() if self._idle else None
        if channel is None:
            channel = self._open()
        broken = False
        try:
            yield channel
        except self._errors:
            broken = True
            raise
        finally:
            with self._lock:
                keep = not (broken or self._closed) and len(self._idle) < IDLE_CHANNELS
                if keep:
                    self._idle.append(channel)
            if not keep:
                _release(channel)

    def _open(self) -> Any:
        """A new channel, the queue declared on it as kombu's producer declares it at its first publish. Connecting is
        retried as Celery retries a publish (`task_publish_retry_policy`: with Redis down, an error after 0.6 s)."""
        connection = self.app.connection_for_write()
        try:
            connection.ensure_connection(**self.app.conf.task_publish_retry_policy)
            channel = connection.default_channel
            self.app.amqp.queues[self.queue].bind(channel).declare()
        except BaseException:
            connection.release()
            raise
        return channel


def _serialized(body: Any, free_form: tuple[Any, ...] | None) -> tuple[str, str, Any]:
    """(content type, content encoding, data) of a task message's body (`Publisher.send`)."""
    if free_form is not None:
        try:  # `fastjson.dumps` takes the stdlib's way where a free-form part holds what orjson writes otherwise; a
            return "application/json", "utf-8", fastjson.dumps(body, *free_form)  # value only kombu's encoder writes
        except TypeError:  # (a datetime, a UUID) stops the stdlib: kombu's serializer writes the body
            pass
    return serialization.dumps(body, serializer="json")


def _release(channel: Any) -> None:
    with contextlib.suppress(Exception):
        channel.connection.client.release()


class PublishBatch:
    """Task messages written together (kombu's Redis publish batch: one pipeline)."""

    def __init__(self, publisher: Publisher, channel: Any, max_size: int) -> None:
        self._publisher = publisher
        self._channel = channel
        self._batch = channel.create_publish_batch(max_size)

    def publish(self, name: str, task_id: str, args: list[Any], argsrepr: str, headers: dict[str, Any] | None = None,
                free_form: tuple[Any, ...] | None = None, **options: Any) -> None:
        self._publisher.send(self._channel, self._batch.publish, name, task_id, args, argsrepr, headers, options,
                             free_form)

    def flush(self) -> None:
        self._batch.flush()

    def discard(self) -> None:
        self._batch.discard()

    def close(self) -> None:
        self._batch.close()
