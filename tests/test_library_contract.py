"""The private parts of kombu, Celery and redis-py's callers that tokenmill overrides or reads (issue 56).

celery and kombu are bounded in pyproject.toml to the minor versions the suite ran with; this test is what makes a
new minor version's renames fail loudly, by name: every private method our subclasses override must still exist in the
library's class (an override of a renamed method would silently never be called), every private method our
subclasses define over the library's must be listed here (a new override is added to the contract knowingly), and
every private attribute the code reads on the library's objects must still be assigned by the library's source.
"""

from __future__ import annotations

import inspect

import kombu.message
import kombu.transport.redis as kombu_redis
import kombu.transport.virtual.base as virtual
import pytest
from celery import Celery
from celery.backends.redis import RedisBackend

from tokenmill.queue import transport
from tokenmill.worker.results import CoalescingRedisBackend

#: Our subclass -> the library's private methods it overrides (and calls through `super()`).
OVERRIDES = {
    transport.Channel: {"_basic_cancel", "_brpop_read", "_brpop_start", "_connparams", "_put"},
    transport.Message: {"_decode"},
    transport.QoS: set(),
    transport.Transport: set(),
    CoalescingRedisBackend: {"_get_result_meta", "_store_result"},
}

#: Private methods of the library's classes the code calls (not overriding them).
CALLED = {
    kombu_redis.Channel: {"_create_client", "_q_for_pri", "_get_message_priority"},
    virtual.Transport: {"_deliver"},
    Celery: {"uses_utc_timezone"},  # public, but `worker/intake.py` replaces it on the app: it must stay a method
}

#: Private attributes the code reads or writes on the library's objects, and the library source that assigns them.
ATTRIBUTES = [
    (virtual.QoS, "_delivered"),  # held deliveries (`transport._held_tags`, `QoS.can_consume_max_estimate`)
    (virtual.QoS, "_dirty"),  # acked, not yet flushed
    (kombu_redis.Channel, "_in_poll"),  # the connection a take was sent on (`Channel._brpop_start`)
    (kombu_redis.Channel, "_brpop_sent_at"),  # kombu's check of a reply overdue on a dead connection
    (kombu_redis.Channel, "_expires"),  # queues with an expiry: kombu's own `_put` writes them
    (kombu_redis.MultiChannelPoller, "_channels"),  # the heartbeat's channels (`Transport._beat`)
    (kombu_redis.PublishBatch, "_buffered"),  # a batch write's commands so far (`Channel._put`'s bell)
    (kombu.message.Message, "_state"),  # marked acked by `transport.acked_by_script`
]


@pytest.mark.parametrize("ours", list(OVERRIDES), ids=lambda c: c.__name__)
def test_every_private_override_is_listed_and_still_exists(ours: type) -> None:
    library = next(base for base in ours.__mro__[1:] if not base.__module__.startswith("tokenmill"))
    overriding = {name for name in vars(ours) if name.startswith("_") and not name.startswith("__")
                  and hasattr(library, name)}
    assert overriding == OVERRIDES[ours], (
        f"{ours.__qualname__} overrides {sorted(overriding)} of {library.__module__}.{library.__qualname__}; "
        f"listed: {sorted(OVERRIDES[ours])}")
    missing = sorted(name for name in OVERRIDES[ours] if not callable(getattr(library, name, None)))
    assert not missing, f"{library.__module__}.{library.__qualname__} no longer has {missing}: see the override"


@pytest.mark.parametrize("library", list(CALLED), ids=lambda c: c.__qualname__)
def test_the_private_methods_called_still_exist(library: type) -> None:
    missing = sorted(name for name in CALLED[library] if not callable(getattr(library, name, None)))
    assert not missing, f"{library.__module__}.{library.__qualname__} no longer has {missing}"


@pytest.mark.parametrize(("library", "name"), ATTRIBUTES, ids=lambda x: getattr(x, "__qualname__", x))
def test_the_private_attributes_read_are_still_assigned(library: type, name: str) -> None:
    source = inspect.getsource(library)
    assert f"self.{name} =" in source or f"self.{name}=" in source, (
        f"{library.__module__}.{library.__qualname__} no longer assigns {name}")


def test_the_backend_base_is_celerys_redis_backend() -> None:
    assert issubclass(CoalescingRedisBackend, RedisBackend)
