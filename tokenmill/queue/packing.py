"""Redis commands packed by hiredis alone: on the transport's connections (producers' and workers'), the worker's result
backend and tokenmill's own clients (`tokenmill.queue.tls.redis_client`: the worker service, the HTTP API's records).
A producer reads results through Celery's own Redis backend, as it was: its commands are few per job.

Why: redis-py's hiredis packer runs each argument through its Python `Encoder.encode` (four type checks, then
`str.encode`) and two generator expressions before hiredis packs them in C. The worker's scripts take several
arguments per job (the check-in's three keys, the store's key, result and delivery tag, the record's tag and
tail), and a profile of `benchmarks/job_queue.py --intake` put ~9% of the worker's time in `pack` (yappi, 9,600
one-token jobs). hiredis's `pack_command` does the same encoding itself: str as UTF-8, bytes as they are, int and
float as their `repr`, and it refuses anything else (bool and None included) as redis-py's encoder does, so the
bytes on the wire are the same (`tests/service/test_queue_packing.py`). A 200-argument script call: 167 -> 33 µs;
the worker's instructions per one-token job (`job_queue.py --instructions --against`): 0.914 M -> 0.853 M.

It is given to redis-py through its `command_packer` connection option; `PACKER_OPTIONS` is what a connection
pool's keyword arguments gain. Torch-free.
"""

from __future__ import annotations

from typing import Any

import hiredis
from redis.exceptions import DataError


class HiredisPacker:
    """A redis-py command packer (`Connection(command_packer=...)`) that leaves argument encoding to hiredis."""

    def pack(self, *args: Any) -> list[bytes]:
        command = args[0]
        if isinstance(command, str):  # redis-py writes some commands as one string: "SCRIPT LOAD", "CLIENT SETNAME"
            args = (*command.split(), *args[1:])
        elif isinstance(command, bytes) and b" " in command:
            args = (*command.split(), *args[1:])
        try:
            return [hiredis.pack_command(args)]
        except TypeError:  # hiredis takes str, bytes, int and float (and memoryview) only: the rest as redis-py takes it
            return [hiredis.pack_command(tuple(_encoded(arg) for arg in args))]


def _encoded(arg: Any) -> bytes:
    """`arg` as redis-py's `Encoder.encode` writes it (UTF-8, its default): for what hiredis refused, such as a
    bytearray, or an int or str subclass; a bool, None or any other object raises redis-py's `DataError`."""
    if isinstance(arg, bytes | bytearray | memoryview):
        return bytes(arg)
    if isinstance(arg, bool) or not isinstance(arg, str | int | float):
        raise DataError(f"Invalid input of type: '{type(arg).__name__}'. Convert to a bytes, string, int or float first.")
    return (arg if isinstance(arg, str) else repr(arg)).encode()


PACKER = HiredisPacker()
#: Keyword arguments that give a redis-py connection pool (and so each of its connections) this packer.
PACKER_OPTIONS: dict[str, Any] = {"command_packer": PACKER}
