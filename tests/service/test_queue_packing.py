"""`tokenmill.queue.packing`: hiredis's packing writes the bytes redis-py's own packer writes, refuses what it refuses,
and the transport, the worker's result backend and tokenmill's own clients use it."""

from __future__ import annotations

import enum
from typing import Any

import pytest
from hypothesis import example, given
from hypothesis import strategies as st
from redis.connection import Connection
from redis.exceptions import DataError
from service_fixtures import RedisServer

from tokenmill.queue.packing import PACKER
from tokenmill.queue.settings import QueueSettings
from tokenmill.queue.tls import redis_client


class _Level(enum.IntEnum):  # an int subclass: hiredis refuses it, redis-py writes its repr
    HIGH = 2


class _Name(str):
    pass


#: redis-py's own packer, as a connection builds it (no connection is opened).
STOCK = Connection()
_arguments = (st.text() | st.binary() | st.integers(min_value=-(2**80), max_value=2**80)
              | st.floats(allow_nan=True, allow_infinity=True) | st.binary().map(bytearray) | st.binary().map(memoryview)
              | st.sampled_from([_Level.HIGH, _Name("sub")]))
_commands = st.sampled_from(["EVALSHA", "SET", "SCRIPT LOAD", "CLIENT SETNAME", b"LPUSH", b"SCRIPT  FLUSH"])


def packed(pack: Any, *args: Any) -> bytes:
    return b"".join(bytes(chunk) for chunk in pack(*args))


@given(_commands, st.lists(_arguments, max_size=12))
@example("EVALSHA", ["é", 1e16, -0.0, 2**64, 5e-324, bytearray(b"x"), memoryview(b"y"), _Level.HIGH, _Name("s")])
def test_the_bytes_are_redis_pys(command: Any, args: list[Any]) -> None:
    assert packed(PACKER.pack, command, *args) == packed(STOCK.pack_command, command, *args)


@pytest.mark.parametrize("bad", [True, False, None, object(), [1], {"a": 1}])
def test_what_redis_py_refuses_is_refused_with_its_error(bad: Any) -> None:
    with pytest.raises(DataError):
        STOCK.pack_command("SET", "key", bad)
    with pytest.raises(DataError):
        PACKER.pack("SET", "key", bad)


def test_unencodable_text_is_refused_as_redis_py_refuses_it() -> None:
    with pytest.raises(UnicodeEncodeError):
        STOCK.pack_command("SET", "key", "\ud800")
    with pytest.raises(UnicodeEncodeError):
        PACKER.pack("SET", "key", "\ud800")


def test_the_transport_the_workers_backend_and_tokenmills_clients_pack_with_it(redis_server: RedisServer) -> None:
    """The service's own client, the transport's connections (worker and client) and the worker's result backend."""
    from tokenmill.worker.app import create_app

    url = redis_server.url
    assert redis_client(url).connection_pool.connection_kwargs["command_packer"] is PACKER
    app = create_app(QueueSettings(broker_url=url, result_backend=url))
    assert app.backend.client.connection_pool.connection_kwargs["command_packer"] is PACKER
    with app.connection_for_write() as connection:
        channel = connection.default_channel
        assert channel.client.connection_pool.connection_kwargs["command_packer"] is PACKER
        channel.client.set("packed", "é")  # through hiredis's packing, to a real server and back
        assert channel.client.get("packed") == "é".encode()
