"""Redis commands packed by hiredis alone: on the transport's connections (producers' and workers'), the worker's result
backend and tokenmill's own clients (`tokenmill.queue.tls.redis_client`: the worker service, the HTTP API's records).
A producer reads results through Celery's own Redis backend, as it was: its commands are few per job.

Why: redis-py's hiredis packer runs each argument through its Python `Encoder.encode` (four type checks, then
`str.encode`) and two generator expressions before hiredis packs them in C. The worker's scripts take several
arguments per job (the check-in's three keys, the store's key, result and delivery tag, the record's tag and
tail), so that packing was a visible share of the worker's time (docs/benchmarks/queue.md). hiredis's `pack_command` does the same encoding itself: str as UTF-8, bytes as they are, int and
float as their `repr`, and it refuses anything else (bool and None included) as redis-py's encoder does, so the
bytes on the wire are the same (`tests/service/test_queue_packing.py`).

It is given to redis-py through its `command_packer` connection option; `PACKER_OPTIONS` is what a connection
pool's keyword arguments gain. Torch-free.
"""

from __future__ import annotations

from typing import Any

import hiredis
from redis.connection import Encoder

#: redis-py's own encoder, as its connections make it by default: for the arguments hiredis refuses.
_ENCODER = Encoder(encoding="utf-8", encoding_errors="strict", decode_responses=False)


class HiredisPacker:
    """A redis-py command packer (`Connection(command_packer=...)`) that leaves argument encoding to hiredis."""

    def pack(self, *args: Any) -> list[bytes]:
        if isinstance(args[0], str | bytes):  # redis-py writes some commands as one: "SCRIPT LOAD", "CLIENT SETNAME"
            args = (*args[0].split(), *args[1:])
        try:
            return [hiredis.pack_command(args)]
        except TypeError:  # hiredis takes str, bytes, int and float (and memoryview) only: the rest as redis-py takes it
            return [hiredis.pack_command(tuple(
                bytes(arg) if isinstance(arg, bytearray | memoryview) else _ENCODER.encode(arg) for arg in args))]


PACKER = HiredisPacker()
#: Keyword arguments that give a redis-py connection pool (and so each of its connections) this packer.
PACKER_OPTIONS: dict[str, Any] = {"command_packer": PACKER}
