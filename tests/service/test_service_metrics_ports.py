"""Several workers on one host (one per GPU): with the same --metrics-port each finds a free port, logs it,
and serves its own metrics there."""

from __future__ import annotations

import socket

import pytest
import urllib.request

from service_fixtures import RedisServer, free_port, logged_metrics_port

from tokenmill.client import Client


def _succeeded(port: int) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return next(float(line.split()[-1]) for line in text.splitlines() if line.startswith("tokenmill_jobs_succeeded_total"))


def test_two_workers_with_the_same_metrics_port_both_start(redis_server: RedisServer, start_worker) -> None:
    base = free_port()
    with socket.socket() as squatter:  # something else on this host already holds the base port
        squatter.bind(("0.0.0.0", base))
        squatter.listen()
        first = start_worker(redis_server.url, "gpu0", metrics_port=base).wait_ready()
        second = start_worker(redis_server.url, "gpu1", metrics_port=base).wait_ready()
        ports = [logged_metrics_port(first), logged_metrics_port(second)]
    assert len(set(ports)) == 2 and all(base < port < base + 16 for port in ports), ports
    client = Client(redis_server.url)
    handles = client.submit_many([{"prompt": f"port {i}", "max_tokens": 4} for i in range(40)])
    assert all(r.ok for r in client.results(handles, timeout=120))
    assert sum(_succeeded(port) for port in ports) == 40  # two endpoints, each counting its own worker's jobs
    assert first.process.poll() is None and second.process.poll() is None


def test_metrics_port_zero_is_off_and_taken_ports_fail_clearly(redis_server: RedisServer, start_worker) -> None:
    off = start_worker(redis_server.url, "quiet", metrics_port=0).wait_ready()
    assert "metrics endpoint off" in off.log_text()
    base = free_port()
    with socket.socket() as squatter:
        squatter.bind(("0.0.0.0", base))
        squatter.listen()
        stuck = start_worker(redis_server.url, "stuck", metrics_port=base, metrics_port_tries=1)
        assert stuck.process.wait(timeout=120) != 0
    assert f"metrics ports {base}-{base} are all in use" in stuck.log_text()


def test_metrics_listen_on_loopback_by_default(redis_server: RedisServer, start_worker) -> None:
    """Unauthenticated metrics are not reachable from other hosts unless --metrics-addr says so."""
    worker = start_worker(redis_server.url, "local").wait_ready()
    port = logged_metrics_port(worker)
    assert f"metrics endpoint on http://127.0.0.1:{port}/metrics" in worker.log_text()
    assert _succeeded(port) == 0  # answers on loopback
    outside = _outward_address()
    with socket.socket() as probe, pytest.raises(ConnectionRefusedError):  # nothing listens on the host's own address
        probe.settimeout(5)
        probe.connect((outside, port))


def _outward_address() -> str:
    """This host's address on its default route (a UDP connect sends nothing); skips where there is none."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as udp:
        try:
            udp.connect(("192.0.2.254", 9))
        except OSError:
            pytest.skip("no non-loopback IPv4 address on this host")
        address = udp.getsockname()[0]
    if address.startswith("127."):
        pytest.skip("no non-loopback IPv4 address on this host")
    return address
