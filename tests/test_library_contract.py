"""The parts of kombu and Celery that tokenmill overrides, calls or copies beyond their documented API.

celery and kombu are bounded in pyproject.toml to the minor version the suite ran with. A new release may rename
what tokenmill reads: an override of a renamed method is silently never called, and a renamed attribute fails only
on the path that reads it. This module checks each of those names where tokenmill expects it, so that an upgrade fails
here, by name, each failure naming the tokenmill file that relies on it. A new override, or a new attribute written on
a library object, fails here too until it is listed (the contract is extended knowingly).
"""

from __future__ import annotations

import inspect
import re
import tomllib
import weakref
from importlib.metadata import version
from pathlib import Path
from typing import Any
from unittest import mock

import kombu.message
import kombu.transport.redis as kombu_redis
import kombu.transport.virtual.base as virtual
import pytest
from celery import Celery, bootsteps
from celery.app import backends as celery_backends
from celery.app.amqp import AMQP
from celery.app.task import Task
from celery.backends.base import Backend
from celery.backends.redis import RedisBackend
from celery.events.dispatcher import EventDispatcher
from celery.utils.imports import symbol_by_name
from celery.worker import state as worker_state
from celery.worker import strategy as worker_strategy
from celery.worker.consumer import Consumer
from celery.worker.consumer.events import Events
from celery.worker.consumer.tasks import Tasks
from celery.worker.control import Panel
from celery.worker.request import Request
from kombu.asynchronous import Hub
from packaging.requirements import Requirement

from tokenmill.queue import transport
from tokenmill.queue.cancels import result_meta
from tokenmill.worker import celery_adapter, control
from tokenmill.worker.celery_adapter import CoalescingRedisBackend, GuardedConsumer, IntakeDrain, LeaseRenewal

ROOT = Path(__file__).resolve().parent.parent


def _name(owner: Any) -> str:
    return f"{getattr(owner, '__module__', '')}.{getattr(owner, '__qualname__', owner)}".strip(".")


def _id(value: Any) -> str:
    if isinstance(value, str):
        return value if len(value) < 40 else value[:37] + "..."
    return getattr(value, "__qualname__", None) or getattr(value, "__name__", None) or repr(value)


def _resolve(owner: Any, name: str, why: str) -> Any:
    assert hasattr(owner, name), f"{_name(owner)} no longer has {name!r}: {why}"
    return getattr(owner, name)


def _library_base(ours: type) -> type:
    return next(base for base in ours.__mro__[1:] if not base.__module__.startswith("tokenmill"))


# -- overrides ---------------------------------------------------------------------------------------------------------

#: (our subclass, name it defines over the library base's, who relies on it). A method: the base must still define
#: it, or ours is never called. A class attribute: the base must still read it under that name.
OVERRIDES: list[tuple[type, str, str]] = [
    (transport.QoS, "__init__", "tokenmill/queue/transport.py: QoS registers itself in _live_qos"),
    (transport.QoS, "restore_at_shutdown", "tokenmill/queue/transport.py: False, so a reconnect requeues nothing"),
    (transport.QoS, "can_consume_max_estimate", "tokenmill/queue/transport.py: a group's jobs count as prefetch"),
    (transport.QoS, "can_consume", "tokenmill/queue/transport.py: take_at_least, hand_back_held"),
    (transport.QoS, "append", "tokenmill/queue/transport.py: messages the claim script recorded"),
    (transport.QoS, "ack", "tokenmill/queue/transport.py: coalesced acks, acks_together"),
    (transport.QoS, "reject", "tokenmill/queue/transport.py: the local record goes even if Redis is down"),
    (transport.QoS, "restore_visible", "tokenmill/queue/transport.py: the sweep recovers dead consumers' lists"),
    (transport.Message, "_decode", "tokenmill/queue/transport.py: a JSON body decoded by fastjson"),
    (transport.Channel, "QoS", "tokenmill/queue/transport.py: the channel's QoS class"),
    (transport.Channel, "Message", "tokenmill/queue/transport.py: the channel's message class"),
    (transport.Channel, "from_transport_options", "tokenmill/queue/transport.py: consumer_ttl, take_at_least"),
    (transport.Channel, "__init__", "tokenmill/queue/transport.py: consumer id, kept connection parameters"),
    (transport.Channel, "_connparams", "tokenmill/queue/transport.py: parameters kept after the transport closed"),
    (transport.Channel, "conn_or_acquire", "tokenmill/queue/transport.py: one client per pool"),
    (transport.Channel, "_put", "tokenmill/queue/transport.py: fair shares' lists and the bell"),
    (transport.Channel, "basic_consume", "tokenmill/queue/transport.py: no-ack (reply) queues remembered"),
    (transport.Channel, "_basic_cancel", "tokenmill/queue/transport.py: no-ack queues forgotten"),
    (transport.Channel, "_brpop_start", "tokenmill/queue/transport.py: the take script or BLMOVE instead of BRPOP"),
    (transport.Channel, "_brpop_read", "tokenmill/queue/transport.py: reads the take's reply, records, delivers"),
    (transport.Channel, "decode_body", "tokenmill/queue/transport.py: a body decoded once per take"),
    (transport.Channel, "close", "tokenmill/queue/transport.py: a pending take put back, the consumer unregistered"),
    (transport.Transport, "Channel", "tokenmill/queue/transport.py: the transport's channel class"),
    (transport.Transport, "__init__", "tokenmill/queue/transport.py: claimed_tags, event_loop"),
    (transport.Transport, "register_with_event_loop", "tokenmill/queue/transport.py: the consumers' heartbeat timer"),
    (CoalescingRedisBackend, "__init__", "tokenmill/worker/celery_adapter.py: thread_safe, packer options, coalescer"),
    (CoalescingRedisBackend, "get_key_for_task", "tokenmill/worker/celery_adapter.py: the key prefix encoded once"),
    (CoalescingRedisBackend, "_get_result_meta", "tokenmill/worker/celery_adapter.py: result_meta without a request"),
    (CoalescingRedisBackend, "_store_result", "tokenmill/worker/celery_adapter.py: stores coalesced in one script"),
    (GuardedConsumer, "__init__", "tokenmill/worker/celery_adapter.py: snapshot_request_sets before Celery's consumer"),
    (GuardedConsumer, "create_task_handler", "tokenmill/worker/celery_adapter.py: protocol_problem, ALLOWED_TASKS"),
    (GuardedConsumer, "on_invalid_task", "tokenmill/worker/celery_adapter.py: refusal answered, no body logged"),
    (GuardedConsumer, "on_decode_error", "tokenmill/worker/celery_adapter.py: refusal answered, no body logged"),
    (GuardedConsumer, "on_unknown_message", "tokenmill/worker/celery_adapter.py: refusal answered, no body logged"),
    (GuardedConsumer, "on_unknown_task", "tokenmill/worker/celery_adapter.py: refusal answered, no body logged"),
    (LeaseRenewal, "__init__", "tokenmill/worker/celery_adapter.py: the consumer bootstep's timer entry"),
    (LeaseRenewal, "requires", "tokenmill/worker/celery_adapter.py: runs after Celery's Tasks step"),
    (LeaseRenewal, "start", "tokenmill/worker/celery_adapter.py: lease renewal starts with the consumer"),
    (LeaseRenewal, "stop", "tokenmill/worker/celery_adapter.py: lease renewal stops with the consumer"),
    (IntakeDrain, "requires", "tokenmill/worker/celery_adapter.py: runs after Celery's Tasks step"),
    (IntakeDrain, "stop", "tokenmill/worker/celery_adapter.py: the intake drains before the connection closes"),
    (celery_adapter._SnapshotWeakSet, "__iter__", "tokenmill/worker/celery_adapter.py: Celery's request sets iterated "
                                                  "over a copy taken in one step"),
]

#: Names of a subclass's namespace that are no override of the library's.
_NOT_OVERRIDES = {"__module__", "__doc__", "__qualname__", "__dict__", "__weakref__", "__annotations__",
                  "__firstlineno__", "__static_attributes__", "__parameters__", "__orig_bases__",
                  "name",  # Celery's StepType metaclass names every bootstep
                  "shutdown"}  # bootsteps' `shutdown = stop`: an alias Celery's Consumer sends ('shutdown' below)
#: The modules that hold every override of kombu's and Celery's (issue 56: one place to read before an upgrade).
ADAPTERS = (transport, celery_adapter)
#: Every class they define over a library's class (a proxy, such as `celery_adapter._Routed`, subclasses none).
SUBCLASSES = sorted((value for module in ADAPTERS for value in vars(module).values() if isinstance(value, type)
                     and value.__module__ == module.__name__ and _library_base(value) is not object),
                    key=lambda c: c.__qualname__)


def test_every_override_is_in_an_adapter_module() -> None:
    outside = sorted({_name(ours) for ours, _, _ in OVERRIDES} - {_name(ours) for ours in SUBCLASSES})
    assert not outside, f"{outside} override kombu or Celery outside {[m.__name__ for m in ADAPTERS]}: move them there"


@pytest.mark.parametrize(("ours", "name", "why"), OVERRIDES, ids=[f"{o.__name__}.{n}" for o, n, _ in OVERRIDES])
def test_the_overridden_name_is_still_the_librarys(ours: type, name: str, why: str) -> None:
    library = _library_base(ours)
    assert name in vars(ours), f"{ours.__qualname__} no longer defines {name}: drop it from OVERRIDES"
    assert hasattr(library, name), (
        f"{_name(library)} no longer has {name!r}, which {why}; the override would never be reached")
    if inspect.isfunction(vars(ours)[name]):
        assert callable(getattr(library, name)), f"{_name(library)}.{name} is no longer a method ({why})"


@pytest.mark.parametrize("ours", SUBCLASSES, ids=lambda c: c.__qualname__)
def test_every_override_is_listed(ours: type) -> None:
    library = _library_base(ours)
    overriding = {name for name in vars(ours) if name not in _NOT_OVERRIDES and hasattr(library, name)}
    listed = {name for owner, name, _ in OVERRIDES if owner is ours}
    assert overriding == listed, (
        f"{ours.__qualname__} overrides {sorted(overriding - listed)} of {_name(library)} unlisted in OVERRIDES "
        f"(listed but not overriding: {sorted(listed - overriding)})")


# -- attributes tokenmill writes on the library's objects --------------------------------------------------------------

#: (our subclass, attribute of the library's that our code assigns on purpose, who relies on it). Any other attribute
#: our methods assign must be one the library does not use (else the two would clobber each other).
WRITTEN: list[tuple[type, str, str]] = [
    (transport.Channel, "_in_poll", "tokenmill/queue/transport.py: the connection a take was sent on (kombu's)"),
    (transport.Channel, "_brpop_sent_at", "tokenmill/queue/transport.py: when a take was sent, read by kombu's "
                                          "MultiChannelPoller.maybe_check_brpop_health"),
    (CoalescingRedisBackend, "thread_safe", "tokenmill/worker/celery_adapter.py: one backend for all pool threads"),
]

_ASSIGNED = re.compile(r"\bself\.(\w+)\s*(?::[^=\n]+)?=(?!=)")


def _assigned_by(cls: type) -> set[str]:
    """The attributes `self.X = ...` that the functions in `cls`'s own namespace assign."""
    names: set[str] = set()
    for value in vars(cls).values():
        function = getattr(value, "fget", value)
        if inspect.isfunction(function):
            names.update(_ASSIGNED.findall(inspect.getsource(function)))
    return names


def _library_uses(cls: type, name: str) -> bool:
    """Whether a library class of `cls`'s bases has `name` or assigns it on its instances."""
    for base in cls.__mro__:
        if base is object or base.__module__.startswith("tokenmill"):
            continue
        if name in vars(base):
            return True
        try:
            source = inspect.getsource(base)
        except (OSError, TypeError):
            continue
        if re.search(rf"\bself\.{re.escape(name)}\s*(?::[^=\n]+)?=(?!=)", source):
            return True
    return False


@pytest.mark.parametrize("ours", SUBCLASSES, ids=lambda c: c.__qualname__)
def test_the_library_attributes_written_are_listed_and_still_used(ours: type) -> None:
    written = {name for name in _assigned_by(ours) if _library_uses(ours, name)}
    listed = {name for owner, name, _ in WRITTEN if owner is ours}
    assert written == listed, (
        f"{ours.__qualname__} assigns {sorted(written - listed)}, which {_name(_library_base(ours))} uses too, "
        f"unlisted in WRITTEN; listed but no longer used by the library: {sorted(listed - written)}")


# -- names tokenmill reads or calls on the library's classes and modules -----------------------------------------------

#: (library class or module, name, who relies on it).
NAMES: list[tuple[Any, str, str]] = [
    (kombu_redis, "dumps", "tokenmill/queue/transport.py: Channel._put encodes a share's message as kombu does"),
    (kombu_redis, "Empty", "tokenmill/queue/transport.py: Channel._brpop_read raises it when nothing was taken"),
    (kombu_redis, "PublishBatch", "tokenmill/queue/transport.py: Channel._put adds to kombu's publish batch"),
    (kombu_redis.PublishBatch, "add", "tokenmill/queue/transport.py: Channel._put's commands in the batch"),
    (kombu_redis.PublishBatch, "publish", "tokenmill/queue/publisher.py: PublishBatch.publish"),
    (kombu_redis.PublishBatch, "flush", "tokenmill/queue/publisher.py: PublishBatch.flush"),
    (kombu_redis.PublishBatch, "discard", "tokenmill/queue/publisher.py: PublishBatch.discard"),
    (kombu_redis.PublishBatch, "close", "tokenmill/queue/publisher.py: PublishBatch.close"),
    (kombu_redis.Channel, "create_publish_batch", "tokenmill/queue/publisher.py: Publisher.batch"),
    (kombu_redis.Channel, "prepare_message", "tokenmill/queue/publisher.py: Publisher.send builds the envelope"),
    (kombu_redis.Channel, "basic_publish", "tokenmill/queue/publisher.py: Publisher.publish"),
    (kombu_redis.Channel, "_q_for_pri", "tokenmill/queue/transport.py: a queue's priority lists and suffixes"),
    (kombu_redis.Channel, "_get_message_priority", "tokenmill/queue/transport.py: Channel._put of a share"),
    (kombu_redis.Channel, "_create_client", "tokenmill/queue/transport.py: Channel.conn_or_acquire"),
    (kombu_redis.Channel, "_flush_brpop_reauth", "tokenmill/queue/transport.py: Channel._brpop_read, as kombu's"),
    (kombu_redis.Channel, "_in_poll", "tokenmill/queue/transport.py: set while a take is pending"),
    (kombu_redis.Channel, "_brpop_sent_at", "tokenmill/queue/transport.py: set as a take is sent"),
    (kombu_redis.Channel, "sep", "tokenmill/queue/transport.py: a priority list's name is the queue's, sep, pri"),
    (kombu_redis.Channel, "priority_steps", "tokenmill/queue/transport.py: the lists a take reads"),
    (kombu_redis.Channel, "global_keyprefix", "tokenmill/queue/transport.py: refused (the scripts name raw keys)"),
    (kombu_redis.Channel, "unacked_key", "tokenmill/queue/transport.py: the record scripts write kombu's hash"),
    (kombu_redis.Channel, "unacked_index_key", "tokenmill/queue/transport.py: and kombu's index"),
    (kombu_redis.Channel, "pool", "tokenmill/queue/transport.py: conn_or_acquire's client per pool"),
    (kombu_redis.Channel, "client", "tokenmill/queue/transport.py: the take is sent on kombu's BRPOP client"),
    (kombu_redis.Channel, "active_queues", "tokenmill/queue/transport.py: Channel._brpop_start"),
    (kombu_redis.Channel, "qos", "tokenmill/queue/transport.py: room for a take"),
    (kombu_redis.QoS, "restore_by_tag", "tokenmill/queue/transport.py: hand_back_held requeues held messages"),
    (kombu_redis.QoS, "unacked_key", "tokenmill/queue/transport.py: ack_records, QoS._ack_many"),
    (kombu_redis.QoS, "unacked_index_key", "tokenmill/queue/transport.py: held_deliveries, QoS._ack_many"),
    (kombu_redis.QoS, "prefetch_count", "tokenmill/queue/transport.py: QoS.can_consume"),
    (virtual.QoS, "ack", "tokenmill/queue/transport.py: the local record of an ack (virtual.QoS.ack(qos, tag))"),
    (virtual.QoS, "append", "tokenmill/queue/transport.py: the local record of a claimed message"),
    (virtual.Transport, "_deliver", "tokenmill/queue/transport.py: Channel._brpop_read delivers each message"),
    (kombu_redis.Transport, "register_with_event_loop", "tokenmill/queue/transport.py: the heartbeat timer"),
    (kombu.message.Message, "_decode", "tokenmill/queue/transport.py: Message._decode"),
    (kombu.message.Message, "ack_log_error", "tokenmill/worker/intake.py: _acknowledge"),
    (kombu.message.Message, "reject_log_error", "tokenmill/worker/celery_adapter.py: refusals"),
    (kombu.message.Message, "acknowledged", "tokenmill/queue/transport.py: ack_records"),
    (Hub, "call_soon", "tokenmill/worker/intake.py, tokenmill/queue/transport.py: work on the consumer's loop"),
    (Hub, "call_repeatedly", "tokenmill/queue/transport.py: Transport.register_with_event_loop's heartbeat"),
    (Celery, "uses_utc_timezone", "tokenmill/worker/celery_adapter.py: strategy replaces it with a constant"),
    (Celery, "steps", "tokenmill/worker/app.py: the consumer bootsteps LeaseRenewal and IntakeDrain"),
    (Task, "Strategy", "tokenmill/worker/app.py: the task's Strategy is tokenmill.worker.celery_adapter:strategy"),
    (Task, "resultrepr_maxsize", "tokenmill/worker/app.py, tokenmill/worker/intake.py: a result's repr size"),
    (Task, "start_strategy", "tokenmill/worker/app.py: Celery builds the Strategy through it"),
    (AMQP, "as_task_v2", "tokenmill/queue/publisher.py: Publisher.send builds Celery's task message"),
    (Consumer, "update_strategies", "tokenmill/worker/control.py: rebuilt when task events go on or off"),
    (Consumer, "apply_eta_task", "tokenmill/worker/celery_adapter.py: _Routed passes the rest through"),
    (Request, "acknowledged", "tokenmill/worker/intake.py: _release, _acknowledge set it"),
    (Request, "time_start", "tokenmill/worker/intake.py: _accept sets it, as Celery's pool does"),
    (Request, "worker_pid", "tokenmill/worker/intake.py: _accept sets it, as Celery's pool does"),
    (Request, "time_limits", "tokenmill/worker/intake.py: job_fields leaves timed jobs to the pool"),
    (Request, "message", "tokenmill/worker/intake.py: the kombu message of a request"),
    (Request, "eventer", "tokenmill/worker/intake.py: _sends_task_events"),
    (Request, "send_event", "tokenmill/worker/intake.py: task-started, task-succeeded"),
    (Request, "connection_errors", "tokenmill/worker/intake.py: _acknowledge"),
    (Request, "reject", "tokenmill/worker/intake.py: IntakeRun._requeue_rest"),
    (Request, "task", "tokenmill/worker/intake.py: job_fields"),
    (RedisBackend, "_MAX_STR_VALUE_SIZE", "tokenmill/worker/celery_adapter.py: _store_result's check, as Celery's"),
    (RedisBackend, "_get_key_for", "tokenmill/worker/celery_adapter.py: the task key prefix, encoded once"),
    (RedisBackend, "task_keyprefix", "tokenmill/worker/celery_adapter.py: the task key prefix"),
    (RedisBackend, "ensure", "tokenmill/worker/celery_adapter.py: _store_result retried as Celery retries"),
    (RedisBackend, "client", "tokenmill/worker/celery_adapter.py, tokenmill/queue/cancels.py, tokenmill/client.py"),
    (RedisBackend, "encode", "tokenmill/worker/celery_adapter.py, tokenmill/queue/cancels.py: Celery's meta encoded"),
    (RedisBackend, "decode_result", "tokenmill/client.py: _parse_meta"),
    (RedisBackend, "current_task_children", "tokenmill/queue/cancels.py: result_meta"),
    (RedisBackend, "READY_STATES", "tokenmill/queue/cancels.py: result_meta's date_done"),
    (RedisBackend, "mark_as_failure", "tokenmill/worker/guard.py, celery_adapter.py: a refusal stored as a FAILURE"),
    (EventDispatcher, "send", "tokenmill/worker/celery_adapter.py: strategy, its task-received events"),
    (worker_state, "task_accepted", "tokenmill/worker/intake.py: _accept"),
    (worker_state, "task_ready", "tokenmill/worker/intake.py: IntakeRun.settled, _requeue_rest"),
    (worker_state, "total_count", "tokenmill/worker/intake.py: _accept counts a group at once"),
    (bootsteps, "CLOSE", "tokenmill/worker/celery_adapter.py: IntakeDrain tells a shutdown from a reconnect"),
    (bootsteps.Blueprint, "state", "tokenmill/worker/celery_adapter.py: IntakeDrain reads parent.blueprint.state"),
]


@pytest.mark.parametrize(("owner", "name", "why"), NAMES, ids=[f"{_id(o)}.{n}" for o, n, _ in NAMES])
def test_the_name_read_still_exists(owner: Any, name: str, why: str) -> None:
    assert hasattr(owner, name), f"{_name(owner)} no longer has {name!r}: {why}"


# -- parameters tokenmill passes by position -----------------------------------------------------------------------------

#: (library function, its first parameters by name, who passes them by position).
SIGNATURES: list[tuple[Any, str, tuple[str, ...], str]] = [
    (kombu_redis.QoS, "append", ("self", "message", "delivery_tag"), "tokenmill/queue/transport.py: QoS.append"),
    (virtual.QoS, "append", ("self", "message", "delivery_tag"), "tokenmill/queue/transport.py: QoS.append"),
    (virtual.QoS, "ack", ("self", "delivery_tag"), "tokenmill/queue/transport.py: virtual.QoS.ack(qos, tag)"),
    (kombu_redis.QoS, "reject", ("self", "delivery_tag", "requeue"), "tokenmill/queue/transport.py: QoS.reject"),
    (kombu_redis.QoS, "restore_visible", ("self", "start", "num", "interval"),
     "tokenmill/queue/transport.py: QoS.restore_visible"),
    (kombu_redis.QoS, "restore_by_tag", ("self", "tag"), "tokenmill/queue/transport.py: hand_back_held"),
    (virtual.Channel, "basic_consume", ("self", "queue", "no_ack"), "tokenmill/queue/transport.py: basic_consume"),
    (kombu_redis.Channel, "_basic_cancel", ("self", "consumer_tag"), "tokenmill/queue/transport.py: _basic_cancel"),
    (kombu_redis.Channel, "_brpop_start", ("self", "timeout"), "tokenmill/queue/transport.py: _brpop_start"),
    (kombu_redis.Channel, "_put", ("self", "queue", "message"), "tokenmill/queue/transport.py: Channel._put"),
    (kombu_redis.Channel, "_connparams", ("self", "asynchronous"), "tokenmill/queue/transport.py: _connparams"),
    (kombu_redis.Channel, "conn_or_acquire", ("self", "client"), "tokenmill/queue/transport.py: conn_or_acquire"),
    (kombu_redis.Channel, "decode_body", ("self", "body", "encoding"), "tokenmill/queue/transport.py: decode_body"),
    (kombu_redis.Channel, "_q_for_pri", ("self", "queue", "pri"), "tokenmill/queue/transport.py: the lists taken"),
    (kombu_redis.Channel, "_get_message_priority", ("self", "message", "reverse"),
     "tokenmill/queue/transport.py: Channel._put of a share"),
    (kombu_redis.Channel, "prepare_message",
     ("self", "body", "priority", "content_type", "content_encoding", "headers", "properties"),
     "tokenmill/queue/publisher.py: Publisher.send"),
    (virtual.Transport, "_deliver", ("self", "message", "queue"), "tokenmill/queue/transport.py: Channel._brpop_read"),
    (kombu_redis.Transport, "register_with_event_loop", ("self", "connection", "loop"),
     "tokenmill/queue/transport.py: Transport.register_with_event_loop"),
    (Backend, "_get_result_meta", ("self", "result", "state", "traceback", "request", "format_date", "encode"),
     "tokenmill/worker/celery_adapter.py: CoalescingRedisBackend._get_result_meta"),
    (RedisBackend, "_store_result", ("self", "task_id", "result", "state", "traceback", "request"),
     "tokenmill/worker/celery_adapter.py: CoalescingRedisBackend._store_result"),
    (RedisBackend, "get_key_for_task", ("self", "task_id", "key"),
     "tokenmill/worker/celery_adapter.py: get_key_for_task"),
    (RedisBackend, "_get_key_for", ("self", "prefix", "id", "key"), "tokenmill/worker/celery_adapter.py: __init__"),
    (RedisBackend, "ensure", ("self", "fun", "args"), "tokenmill/worker/celery_adapter.py: _store_result"),
    (Consumer, "on_invalid_task", ("self", "body", "message", "exc"),
     "tokenmill/worker/celery_adapter.py: on_invalid_task"),
    (Consumer, "on_decode_error", ("self", "message", "exc"), "tokenmill/worker/celery_adapter.py: on_decode_error"),
    (Consumer, "on_unknown_message", ("self", "body", "message"),
     "tokenmill/worker/celery_adapter.py: on_unknown_message"),
    (Consumer, "on_unknown_task", ("self", "body", "message", "exc"),
     "tokenmill/worker/celery_adapter.py: on_unknown_task"),
    (bootsteps.StartStopStep, "__init__", ("self", "parent"), "tokenmill/worker/celery_adapter.py: LeaseRenewal"),
    (worker_strategy, "default", ("task", "app", "consumer"), "tokenmill/worker/celery_adapter.py: strategy"),
    (Task, "start_strategy", ("self", "app", "consumer"),
     "tokenmill/worker/celery_adapter.py: strategy(task, app, consumer)"),
    (worker_state, "task_ready", ("request",), "tokenmill/worker/intake.py: task_ready(request)"),
]


@pytest.mark.parametrize(("owner", "name", "expected", "why"), SIGNATURES,
                         ids=[f"{_id(o)}.{n}" for o, n, _, _ in SIGNATURES])
def test_the_parameters_passed_by_position_still_match(owner: Any, name: str, expected: tuple[str, ...],
                                                       why: str) -> None:
    function = _resolve(owner, name, why)
    names = tuple(inspect.signature(function).parameters)[:len(expected)]
    assert names == expected, f"{_name(owner)}.{name}'s parameters are now {names}, not {expected}: {why}"


def test_task_accepted_still_takes_the_total_count_adder() -> None:
    assert "add_to_total_count" in inspect.signature(worker_state.task_accepted).parameters, (
        "celery.worker.state.task_accepted lost add_to_total_count: tokenmill/worker/intake.py _accept counts a "
        "group's jobs at once through it")


# -- library code that must still call, read or write what tokenmill relies on ------------------------------------------

#: (library function, text its source must hold, who relies on it). Each is how the library reaches one of our
#: overrides, or a format or a name our scripts copy.
SOURCES: list[tuple[Any, str, str, str]] = [
    (kombu_redis.MultiChannelPoller, "_register_BRPOP", "_brpop_start(",
     "tokenmill/queue/transport.py: Channel._brpop_start is how kombu sends a take"),
    (kombu_redis.Channel, "__init__", "self._brpop_read", "tokenmill/queue/transport.py: the BRPOP handler"),
    (kombu_redis.MultiChannelPoller, "maybe_check_brpop_health", "_brpop_sent_at",
     "tokenmill/queue/transport.py: a take overdue on a dead connection is dropped"),
    (kombu_redis.MultiChannelPoller, "maybe_restore_messages", "restore_visible(",
     "tokenmill/queue/transport.py: QoS.restore_visible's sweep of dead consumers"),
    (kombu_redis.Channel, "basic_cancel", "_basic_cancel", "tokenmill/queue/transport.py: Channel._basic_cancel"),
    (virtual.Channel, "basic_publish", "_put(", "tokenmill/queue/transport.py: Channel._put"),
    (kombu_redis.PublishBatch, "publish", "_publish_batch=self",
     "tokenmill/queue/transport.py: Channel._put finds the batch in its kwargs"),
    (kombu_redis.PublishBatch, "publish", "self._buffered", "tokenmill/queue/transport.py: Channel._put's bell"),
    (kombu_redis.Channel, "_get_pool", "_connparams(", "tokenmill/queue/transport.py: Channel._connparams"),
    (kombu.message.Message, "decode", "_decode()", "tokenmill/queue/transport.py: Message._decode"),
    (kombu_redis.QoS, "append", "dumps([message._raw, EX, RK])",
     "tokenmill/queue/transport.py: _RECORD writes kombu's unacked record [message, exchange, routing key]"),
    (kombu_redis.QoS, "restore_by_tag", "M, EX, RK = loads(",
     "tokenmill/queue/transport.py: kombu reads back the records _RECORD wrote"),
    (kombu_redis.QoS, "append", "zadd(self.unacked_index_key",
     "tokenmill/queue/transport.py: _RECORD scores unacked_index as kombu does"),
    (kombu_redis.QoS, "_remove_from_indices", "zrem(self.unacked_index_key",
     "tokenmill/queue/transport.py QoS._ack_many, tokenmill/worker/service.py _STORE: an ack is ZREM and HDEL"),
    (kombu_redis.QoS, "_remove_from_indices", "hdel(self.unacked_key", "the same"),
    (kombu_redis.Channel, "_brpop_read", "rsplit(self.sep, 1)[0]",
     "tokenmill/queue/transport.py: a list's queue is its name up to the last sep"),
    (kombu_redis.Transport, "__init__", "self.cycle = MultiChannelPoller()",
     "tokenmill/queue/transport.py: Transport._beat walks cycle._channels"),
    (kombu_redis.MultiChannelPoller, "__init__", "self._channels = set()",
     "tokenmill/queue/transport.py: Transport._beat walks cycle._channels"),
    (kombu_redis.Channel, "__init__", "self._expires =", "tokenmill/queue/transport.py: Channel._put"),
    (kombu_redis.Channel, "__init__", "self._queue_cycle =",
     "tokenmill/queue/transport.py: _brpop_start consumes and _brpop_read rotates kombu's queue cycle"),
    (virtual.Channel, "__init__", "self._tag_to_queue =", "tokenmill/queue/transport.py: Channel._basic_cancel"),
    (virtual.Channel, "close", "self.closed = True", "tokenmill/queue/transport.py: Channel.heartbeat, Channel.close"),
    (RedisBackend, "_set", "publish(key, value)",
     "tokenmill/worker/celery_adapter.py and service.py _STORE publish a stored result as Celery does"),
    (RedisBackend, "__init__", "self.failure_expires =", "tokenmill/worker/celery_adapter.py: _store_result"),
    (RedisBackend, "__init__", "self.connparams =", "tokenmill/worker/celery_adapter.py: packer options added"),
    (Backend, "__init__", "self.thread_safe =", "tokenmill/worker/celery_adapter.py: set True after Celery's __init__"),
    (Backend, "store_result", "self._store_result",
     "tokenmill/worker/celery_adapter.py: CoalescingRedisBackend._store_result"),
    (worker_strategy, "default", "consumer.on_task_request",
     "tokenmill/worker/celery_adapter.py: _Routed hands requests to the intake through it"),
    (worker_strategy, "default", "consumer.event_dispatcher",
     "tokenmill/worker/celery_adapter.py: _Routed gives no dispatcher while task events are off"),
    (worker_strategy, "default", "app.uses_utc_timezone()", "tokenmill/worker/celery_adapter.py: strategy's constant"),
    (Task, "start_strategy", "self.Strategy",
     "tokenmill/worker/app.py: Strategy='tokenmill.worker.celery_adapter:strategy'"),
    (celery_backends, "by_name", "loader.override_backends",
     "tokenmill/worker/app.py: the worker's backend is CoalescingRedisBackend"),
    (Consumer, "__init__", "self.on_task_request =", "tokenmill/worker/celery_adapter.py: strategy"),
    (Consumer, "__init__", "self.hub =", "tokenmill/worker/celery_adapter.py: strategy attaches the intake"),
    (Consumer, "__init__", "self.blueprint =", "tokenmill/worker/celery_adapter.py: IntakeDrain"),
    (Consumer, "__init__", "self.connection_errors =", "tokenmill/worker/celery_adapter.py: refusals"),
    (Events, "start", "c.event_dispatcher =", "tokenmill/worker/celery_adapter.py, tokenmill/worker/control.py"),
    (Tasks, "start", "c.task_consumer =", "tokenmill/worker/leases.py: the channel whose leases are renewed"),
    (Consumer, "Blueprint", "'shutdown'", "tokenmill/worker/celery_adapter.py: `shutdown = stop` on the steps"),
    (bootsteps.Blueprint, "stop", "self.state = CLOSE", "tokenmill/worker/celery_adapter.py: IntakeDrain.stop"),
    (EventDispatcher, "__init__", "self.enabled =", "tokenmill/worker/control.py: sends_task_events"),
    (EventDispatcher, "__init__", "self.groups =", "tokenmill/worker/control.py: sends_task_events"),
]


@pytest.mark.parametrize(("owner", "name", "text", "why"), SOURCES,
                         ids=[f"{_id(o)}.{n}:{t}" for o, n, t, _ in SOURCES])
def test_the_library_source_still_holds(owner: Any, name: str, text: str, why: str) -> None:
    function = _resolve(owner, name, why)
    assert text in inspect.getsource(function), f"{_name(owner)}.{name} no longer holds {text!r}: {why}"


# -- instance attributes, on objects built for the check -----------------------------------------------------------------

def test_a_qos_still_keeps_its_deliveries_and_acks_in_delivered_and_dirty() -> None:
    for qos_class in (virtual.QoS, kombu_redis.QoS):
        qos = qos_class(mock.Mock(), prefetch_count=1)  # the channel is only kept, not used, while it is built
        assert isinstance(getattr(qos, "_delivered", None), dict), (
            f"{_name(qos_class)} no longer keeps _delivered: tokenmill/queue/transport.py _held_tags, "
            "QoS.can_consume_max_estimate and QoS.jobs_ended read the held messages there")
        assert isinstance(getattr(qos, "_dirty", None), set), (
            f"{_name(qos_class)} no longer keeps _dirty: tokenmill/queue/transport.py _held_tags and "
            "QoS.can_consume_max_estimate skip the acked ones")
    qos = virtual.QoS(mock.Mock(), prefetch_count=1)
    qos.append(mock.Mock(), "tag")
    assert "tag" in qos._delivered and qos.can_consume_max_estimate() == 0, (
        "virtual.QoS.append no longer records in _delivered: tokenmill/queue/transport.py QoS.append relies on it")
    qos.ack("tag")
    assert qos.can_consume_max_estimate() == 1, (
        "virtual.QoS.ack no longer frees the prefetch slot: tokenmill/queue/transport.py acks through it")


def test_the_poller_still_keeps_its_channels() -> None:
    poller = kombu_redis.MultiChannelPoller()
    try:
        assert isinstance(getattr(poller, "_channels", None), set), (
            "kombu's MultiChannelPoller no longer keeps _channels: tokenmill/queue/transport.py Transport._beat "
            "renews the heartbeat of each of them")
        assert not hasattr(poller, "_heartbeat_tref"), (
            "kombu's MultiChannelPoller now has _heartbeat_tref, which tokenmill/queue/transport.py "
            "Transport.register_with_event_loop sets for its own timer")
    finally:
        poller.poller.close()


def test_a_publish_batch_still_counts_its_commands() -> None:
    batch = kombu_redis.PublishBatch(mock.MagicMock(), 10)
    assert batch._buffered == 0 and batch.max_size == 10, (
        "kombu's PublishBatch no longer keeps _buffered and max_size: tokenmill/queue/transport.py Channel._put "
        "rings its bell once a write from them")


def test_a_priority_list_is_still_the_queue_name_and_a_suffix() -> None:
    channel = kombu_redis.Channel.__new__(kombu_redis.Channel)  # no connection: class defaults only
    pri = next(step for step in channel.priority_steps if step)
    assert channel._q_for_pri("q", 0) == "q" and channel._q_for_pri("q", pri) == "q" + channel._q_for_pri("", pri), (
        "kombu's _q_for_pri is no longer the queue's name and a suffix: tokenmill/queue/transport.py _TAKE builds "
        "a share's priority lists as prefix .. share .. suffix")


def test_a_message_marked_ack_is_acknowledged() -> None:
    message = kombu.message.Message(body=b"{}", content_type="application/json")
    assert hasattr(message, "_state") and "ACK" in kombu.message.ACK_STATES, (
        "kombu's Message no longer keeps _state 'ACK': tokenmill/queue/transport.py acked_by_script marks it so")
    message._state = "ACK"
    assert message.acknowledged


def test_the_hub_still_runs_callbacks_each_tick() -> None:
    hub = Hub()
    try:
        assert isinstance(getattr(hub, "on_tick", None), set), (
            "kombu's Hub no longer has the on_tick set: tokenmill/worker/intake.py Intake.attach adds its turn")
    finally:
        hub.close()


def test_the_transport_does_not_use_our_attribute_names() -> None:
    for name in ("event_loop", "claimed_tags"):
        assert not _library_uses(kombu_redis.Transport, name), (
            f"kombu's Redis Transport now uses {name!r}, which tokenmill/queue/transport.py Transport sets for its own")


def test_the_result_meta_is_still_celerys() -> None:
    backend = RedisBackend(app=Celery(set_as_current=False), url="redis://localhost:6379/0")
    celerys = backend._get_result_meta(None, "SUCCESS", None, None)
    ours = result_meta(backend, "SUCCESS")
    assert set(celerys) == set(ours), (
        f"Celery's result meta is now {sorted(celerys)}: tokenmill/queue/cancels.py result_meta builds {sorted(ours)}")
    assert backend._get_key_for(backend.task_keyprefix, "x") == backend.get_key_for_task("x"), (
        "Celery's task key is no longer _get_key_for(task_keyprefix, id): tokenmill/worker/celery_adapter.py caches it")


def test_the_request_sets_are_still_weak_sets() -> None:
    for name in ("reserved_requests", "active_requests", "scheduled_requests"):
        requests = getattr(worker_state, name, None)
        assert isinstance(requests, weakref.WeakSet) and hasattr(requests, "data"), (
            f"celery.worker.state.{name} is no longer a WeakSet: tokenmill/worker/celery_adapter.py "
            "snapshot_request_sets swaps its class")


def test_the_remote_control_commands_replaced_still_exist() -> None:
    for name in (*control.EVENT_SWITCHES, *control.STATE_CHANGING):
        assert name in Panel.data, (
            f"Celery's remote-control command {name!r} is gone from Panel.data: tokenmill/worker/control.py "
            "replaces it there")


def test_the_bootsteps_required_still_exist() -> None:
    for step in (LeaseRenewal, IntakeDrain):
        for required in step.requires:
            assert symbol_by_name(required) is not None, (
                f"{required} is gone: {step.__module__}.{step.__qualname__} requires it")


# -- versions ------------------------------------------------------------------------------------------------------------

def test_the_installed_versions_are_within_the_bounds_declared() -> None:
    dependencies = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    for package in ("celery", "kombu"):
        requirement = next(Requirement(text) for text in dependencies if Requirement(text).name == package)
        assert any(spec.operator in ("<", "<=", "==", "~=") for spec in requirement.specifier), (
            f"pyproject.toml gives {package} no upper bound ({requirement}): this contract holds for one minor version")
        installed = version(package)
        assert requirement.specifier.contains(installed, prereleases=True), (
            f"{package} {installed} is installed, outside pyproject.toml's {requirement.specifier}: check this "
            "module's contract against it, then move the bound")
