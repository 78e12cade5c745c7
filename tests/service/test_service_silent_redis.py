"""A Redis connection whose peer goes silent (no reply, no reset: a paused server, a dropped route) holds no worker
thread for good: the worker's own calls time out after --redis-socket-timeout and are retried on a new connection.

The worker reaches Redis through a TCP relay on loopback that can black-hole every connection open at a moment: it
keeps reading from them and forwards nothing, while new connections are relayed as usual. A real redis-server and
worker process.
"""

from __future__ import annotations

import socket
import threading
from typing import Any

from service_fixtures import RedisServer

from tokenmill.client import Client


class Relay:
    """Loopback TCP relay to `port`; `silence()` black-holes the connections open now."""

    def __init__(self, port: int) -> None:
        self.target = port
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.generation = 0
        self.silenced: set[int] = set()
        threading.Thread(target=self._accept, daemon=True).start()

    def silence(self) -> None:
        self.silenced.add(self.generation)
        self.generation += 1

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            server = socket.create_connection(("127.0.0.1", self.target))
            generation = self.generation
            for source, sink in ((client, server), (server, client)):
                threading.Thread(target=self._pump, args=(source, sink, generation), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket, generation: int) -> None:
        try:
            while data := source.recv(65536):
                if generation not in self.silenced:
                    sink.sendall(data)
        except OSError:
            pass

    def close(self) -> None:
        self.listener.close()


def test_a_silent_redis_connection_does_not_hold_the_worker(redis_server: RedisServer, start_worker: Any) -> None:
    relay = Relay(int(redis_server.url.rsplit(":", 1)[1].split("/")[0]))
    try:
        url = f"redis://127.0.0.1:{relay.port}/0"
        worker = start_worker(url, redis_socket_timeout=2).wait_ready()
        with Client(redis_server.url) as client:
            assert client.submit(prompt="warm", max_tokens=2).result(timeout=60).ok  # every connection in use now
            relay.silence()
            handles = client.submit_many([{"prompt": f"after {i}", "max_tokens": 4} for i in range(5)])
            results = client.results(handles, timeout=120)
        assert all(r.ok for r in results), [r.error for r in results if not r.ok]
        assert worker.process.poll() is None
    finally:
        relay.close()
