"""Real components for the service tests: redis-server processes, a moto S3 server, worker processes.

Nothing is mocked on the queue or storage path. Each Redis runs on a free port with its own data
directory (AOF on where asked), so a test can kill and restart it; S3 is moto's HTTP server reached by
boto3 through `endpoint_url`; workers are `python -m tokenmill.cli worker` subprocesses on the built-in
tiny model; `Server` is a `python -m tokenmill.cli serve` subprocess. Waits poll with deadlines instead of
sleeping fixed times.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import redis

REPO = Path(__file__).resolve().parents[2]
REDIS_SERVER = shutil.which("redis-server")
#: Short enough that recovery tests run in seconds; long enough that lease renewal (every 1/4 of it)
#: keeps live workers' jobs from being redelivered on a loaded 2-core machine.
TEST_VISIBILITY_TIMEOUT = 3.0
S3_BUCKET = "results"
AWS_ENV = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def child_pids(pid: int) -> list[int]:
    """Processes whose parent is `pid` (Linux /proc; no procps needed)."""
    children = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # exited meanwhile
            continue
        if int(fields[1]) == pid:
            children.append(int(stat.parent.name))
    return children


def engine_pid(worker_pid: int) -> int:
    """The worker's engine process (a multiprocessing "spawn" child, beside multiprocessing's resource tracker)."""
    pids = [pid for pid in child_pids(worker_pid) if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes()]
    assert len(pids) == 1, f"expected one engine process under {worker_pid}, found {pids}"
    return pids[0]


@contextlib.contextmanager
def stopped(pid: int) -> Iterator[None]:
    """SIGSTOP `pid` for the block (an engine process: no job it holds can finish, however slow the machine),
    SIGCONT after it, whatever happens."""
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


def socket_ports(pid: int) -> set[int]:
    """The local TCP ports of process `pid`'s sockets (from /proc: its descriptors, then /proc/<pid>/net/tcp*)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    rows = [line.split() for table in ("tcp", "tcp6")
            for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]]
    return {int(fields[1].rsplit(":", 1)[1], 16) for fields in rows if fields[9] in inodes}


def queued_messages(broker: redis.Redis, queue: str = "tokenmill") -> list[bytes]:
    """The messages waiting on `queue`: on its own list and its fair shares' (`annotate --broker` runs and `serve`
    tenants queue in shares of their own; `tokenmill.queue.names.SHARE_LIST`), wake-up bells left out."""
    from tokenmill.queue.names import SHARE_BELL, SHARE_LIST, SHARES_KEY

    lists = [queue, *(SHARE_LIST.format(queue=queue, share=share.decode())
                      for share in broker.smembers(SHARES_KEY.format(queue=queue)))]
    return [item for name in lists for item in broker.lrange(name, 0, -1) if item != SHARE_BELL.encode()]


def queued(broker: redis.Redis, queue: str = "tokenmill") -> int:
    """How many messages wait on `queue`, its shares' included."""
    return len(queued_messages(broker, queue))


def wait_for(check: Callable[[], Any], timeout: float, what: str, interval: float = 0.05) -> Any:
    """Poll `check` until it returns something truthy; fail the test with `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


@dataclass
class RedisServer:
    """A redis-server process we own: start, stop (SIGTERM: AOF flushed), kill -9, restart."""

    directory: Path
    appendonly: bool = True
    port: int = field(default_factory=free_port)
    process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def client(self) -> redis.Redis:
        return redis.Redis(port=self.port, socket_timeout=5)

    def start(self) -> None:
        if REDIS_SERVER is None:
            pytest.skip("redis-server is not installed (CI installs it: apt-get install redis-server)")
        self.directory.mkdir(parents=True, exist_ok=True)
        args = [
            REDIS_SERVER, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.directory),
            "--save", "", "--appendonly", "yes" if self.appendonly else "no", "--appendfsync", "always",
            "--logfile", str(self.directory / "redis.log"),
        ]
        self.process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_for(self._answers, 10, f"redis-server on port {self.port}")

    def _answers(self) -> bool:
        try:
            return bool(self.client().ping())
        except redis.RedisError:
            return False

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            self.process.wait(timeout=15)
        self.process = None

    def kill(self) -> None:
        if self.process is not None:
            self.process.kill()
            self.process.wait(timeout=10)
        self.process = None

    def restart(self) -> None:
        self.stop()
        self.start()


def make_tls_files(directory: Path, host: str = "127.0.0.1") -> dict[str, Path]:
    """A self-signed CA and a server certificate it signed for `host` (IP SAN) and localhost: PEM files."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    directory.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.timezone.utc)
    valid = {"not_valid_before": now - datetime.timedelta(minutes=5), "not_valid_after": now + datetime.timedelta(days=1)}

    def name(common: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common)])

    ca_key, server_key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca = (x509.CertificateBuilder(subject_name=name("tokenmill test CA"), issuer_name=name("tokenmill test CA"),
                                  public_key=ca_key.public_key(), serial_number=x509.random_serial_number(), **valid)
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
          .sign(ca_key, hashes.SHA256()))
    san = x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address(host)), x509.DNSName("localhost")])
    server = (x509.CertificateBuilder(subject_name=name("localhost"), issuer_name=ca.subject,
                                      public_key=server_key.public_key(), serial_number=x509.random_serial_number(), **valid)
              .add_extension(san, critical=False)
              .sign(ca_key, hashes.SHA256()))
    files = {"ca": directory / "ca.pem", "cert": directory / "server.pem", "key": directory / "server.key"}
    files["ca"].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    files["cert"].write_bytes(server.public_bytes(serialization.Encoding.PEM))
    files["key"].write_bytes(server_key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                      serialization.NoEncryption()))
    return files


@dataclass
class TlsRedisServer(RedisServer):
    """A redis-server that speaks only TLS (`--port 0 --tls-port`) and wants a password; `url` carries both."""

    password: str = "Secret-tls-password"
    tls: dict[str, Path] = field(default_factory=dict)

    @property
    def url(self) -> str:
        from urllib.parse import quote

        return f"rediss://:{self.password}@127.0.0.1:{self.port}/0?ssl_ca_certs={quote(str(self.tls['ca']))}"

    def client(self) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port, password=self.password, ssl=True,
                           ssl_ca_certs=str(self.tls["ca"]), socket_timeout=5)

    def start(self) -> None:
        if REDIS_SERVER is None:
            pytest.skip("redis-server is not installed (CI installs it: apt-get install redis-server)")
        self.tls = self.tls or make_tls_files(self.directory / "tls")
        self.directory.mkdir(parents=True, exist_ok=True)
        args = [
            REDIS_SERVER, "--port", "0", "--tls-port", str(self.port), "--bind", "127.0.0.1",
            "--tls-cert-file", str(self.tls["cert"]), "--tls-key-file", str(self.tls["key"]),
            "--tls-ca-cert-file", str(self.tls["ca"]), "--tls-auth-clients", "no", "--requirepass", self.password,
            "--dir", str(self.directory), "--save", "", "--appendonly", "yes" if self.appendonly else "no",
            "--appendfsync", "always", "--logfile", str(self.directory / "redis.log"),
        ]
        self.process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_for(self._answers, 10, f"TLS redis-server on port {self.port}")


class PlainListener:
    """A TCP listener that is not Redis: it records the first bytes of every connection, then closes it.

    What a client sends to a `rediss://` address that is not TLS shows whether it would have sent its
    password in the clear.
    """

    def __init__(self) -> None:
        import threading

        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.sock.settimeout(0.2)
        self.port = self.sock.getsockname()[1]
        self.received: list[bytes] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except (TimeoutError, OSError):
                continue
            with conn:
                conn.settimeout(2)
                try:
                    self.received.append(conn.recv(65536))
                except OSError:
                    self.received.append(b"")

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.sock.close()


class S3Server:
    """moto's S3-compatible HTTP server in a thread; stop/start keep its data (moto's state is per process)."""

    def __init__(self) -> None:
        from moto.server import ThreadedMotoServer

        self.port = free_port()
        self._server_class = ThreadedMotoServer
        self._server: Any = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        self._server = self._server_class(ip_address="127.0.0.1", port=self.port, verbose=False)
        self._server.start()

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop()
            self._server = None

    def client(self) -> Any:
        import boto3

        return boto3.client("s3", endpoint_url=self.endpoint, region_name="us-east-1",
                            aws_access_key_id="testing", aws_secret_access_key="testing")


class Worker:
    """A `tokenmill worker` subprocess on builtin:tiny."""

    def __init__(self, broker_url: str, log_path: Path, name: str, options: dict[str, Any], new_session: bool = False,
                 extra_env: dict[str, str] | None = None) -> None:
        self.name = name
        self.log_path = log_path
        self.metrics_port = free_port()
        args = {
            "broker": broker_url, "model": "builtin:tiny", "hostname": f"{name}@%h",
            "visibility-timeout": TEST_VISIBILITY_TIMEOUT, "metrics-port": self.metrics_port,
            "max-num-seqs": 64, "shutdown-grace": 30,
            **options,
        }
        self.command = [sys.executable, "-m", "tokenmill.cli", "worker"]
        for flag, value in args.items():
            self.command += [f"--{flag}"] if value is True else [f"--{flag}", str(value)]
        env = {k: v for k, v in os.environ.items() if not k.startswith("TOKENMILL_")}
        env.update(AWS_ENV, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        env.update(extra_env or {})
        self._log = open(log_path, "ab")
        self.process = subprocess.Popen(self.command, stdout=self._log, stderr=subprocess.STDOUT, env=env, cwd=REPO,
                                        start_new_session=new_session)

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_ready(self, timeout: float = 90) -> Worker:
        """Until Celery says the worker consumes (its "<name>@host ready." line)."""

        def ready() -> bool:
            if self.process.poll() is not None:
                raise AssertionError(f"worker {self.name} exited with {self.process.returncode}:\n{self.log_text()[-3000:]}")
            return f"{self.name}@" in self.log_text() and " ready." in self.log_text()

        wait_for(ready, timeout, f"worker {self.name} to be ready", interval=0.1)
        return self

    def wait_listening(self, app: Any, timeout: float = 60) -> Worker:
        """Until the worker answers a remote-control ping. Broadcasts travel over Redis pub/sub, which keeps nothing
        for a subscriber that is not listening yet, and "ready" in the log does not prove the mailbox listens: in
        a full-suite run on a loaded machine a revoke and a shutdown sent right after it were never received. A
        test that sends a broadcast waits for this first."""
        wait_for(lambda: any(f"{self.name}@" in node for reply in app.control.ping(timeout=1) for node in reply),
                 timeout, f"worker {self.name} to answer a ping")
        return self

    def metrics(self) -> dict[str, float]:
        """The worker's Prometheus samples, `name{labels}` -> value."""
        text = urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5).read().decode()
        samples = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                key, _, value = line.rpartition(" ")
                samples[key] = float(value)
        return samples

    def kill(self) -> None:
        """kill -9: no cleanup, no acks, no requeue."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
        self.process.wait(timeout=10)

    def terminate(self, timeout: float = 60) -> int:
        """SIGTERM, then wait for the exit code."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        return self.process.wait(timeout=timeout)

    def kill_with_children(self) -> None:
        """kill -9 of the worker and its children (the engine process, even one a test froze with SIGSTOP)."""
        children = child_pids(self.process.pid) if self.process.poll() is None else []
        self.kill()
        for pid in children:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def close(self) -> None:
        """Kill the worker and its children; close its log."""
        self.kill_with_children()
        self._log.close()


#: The API keys of `Server`s, by tenant.
KEYS = {"alice": "sk-alice-0123", "bob": "sk-bob-4567"}


class Server:
    """A `tokenmill serve` subprocess; `kill()` is kill -9."""

    def __init__(self, broker_url: str, files_dir: Path, log_path: Path, port: int | None = None,
                 env: dict[str, str] | None = None, **flags: Any) -> None:
        self.port = port or free_port()
        self.log_path = log_path
        args = {"broker": broker_url, "port": self.port, "files-dir": files_dir, "lease-seconds": 2,
                "api-keys": ",".join(f"{t}={k}" for t, k in KEYS.items()), **flags}
        self.command = [sys.executable, "-m", "tokenmill.cli", "serve"]
        for flag, value in args.items():  # a flag set to None is left out
            if value is not None:
                self.command += [f"--{flag}"] if value is True else [f"--{flag}", str(value)]
        env = {**{k: v for k, v in os.environ.items() if not k.startswith("TOKENMILL_")}, **(env or {})}
        env.update(PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        self._log = open(log_path, "ab")
        self.process = subprocess.Popen(self.command, stdout=self._log, stderr=subprocess.STDOUT, env=env, cwd=REPO)
        wait_for(self._answers, 60, f"tokenmill serve on port {self.port}", interval=0.1)

    def _answers(self) -> bool:
        if self.process.poll() is not None:
            raise AssertionError(f"tokenmill serve exited with {self.process.returncode}:\n{self.log_path.read_text()}")
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{self.port}/v1/models", timeout=2)
        except urllib.error.HTTPError:
            return True  # 401: it is up
        except OSError:
            return False
        return True

    def client(self, tenant: str = "alice", key: str | None = None) -> Any:
        """An SDK client with `tenant`'s key from `KEYS`, or with `key`."""
        from openai import OpenAI  # only the serve tests need the SDK

        return OpenAI(base_url=f"http://127.0.0.1:{self.port}/v1", api_key=key or KEYS[tenant], max_retries=0)

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
        self.process.wait(timeout=10)

    def close(self) -> None:
        self.kill()
        self._log.close()


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path / "redis")
    server.start()
    yield server
    server.kill()


@pytest.fixture
def tls_redis_server(tmp_path: Path) -> Iterator[TlsRedisServer]:
    server = TlsRedisServer(tmp_path / "redis-tls")
    server.start()
    yield server
    server.kill()


@pytest.fixture
def plain_listener() -> Iterator[PlainListener]:
    listener = PlainListener()
    yield listener
    listener.close()


@pytest.fixture
def s3_server() -> Iterator[S3Server]:
    server = S3Server()
    server.start()
    server.client().create_bucket(Bucket=S3_BUCKET)
    yield server
    server.stop()


@pytest.fixture
def start_worker(tmp_path: Path) -> Iterator[Callable[..., Worker]]:
    """`start_worker(broker_url, name="w1", new_session=False, extra_env=None, **flags)` starts a worker; all are
    killed at teardown.

    `new_session=True` gives the worker its own process group, so a test can signal the whole group;
    `extra_env` is set in its environment last (e.g. other AWS credentials than the test ones).
    """
    workers: list[Worker] = []

    def start(broker_url: str, name: str = "w1", new_session: bool = False, extra_env: dict[str, str] | None = None,
              **options: Any) -> Worker:
        options = {key.replace("_", "-"): value for key, value in options.items()}
        worker = Worker(broker_url, tmp_path / f"{name}-{len(workers)}.log", name, options, new_session, extra_env)
        workers.append(worker)
        return worker

    yield start
    for worker in workers:
        worker.close()


@pytest.fixture(autouse=True)
def _aws_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """boto3 in the test process must never find real credentials."""
    for key, value in AWS_ENV.items():
        monkeypatch.setenv(key, value)
    for key in list(os.environ):
        if key.startswith("TOKENMILL_"):
            monkeypatch.delenv(key)


class ResultLog:
    """Counts every result Celery writes to this Redis (it PUBLISHes each on `celery-task-meta-<id>`).

    A job written twice (run twice, or its result rewritten) shows a count of 2, which a plain
    GET of the single result key could never reveal.
    """

    def __init__(self, server: RedisServer) -> None:
        self.counts: dict[str, int] = {}
        self._pubsub = server.client().pubsub()
        self._pubsub.psubscribe(**{"celery-task-meta-*": self._record})
        self._thread = self._pubsub.run_in_thread(sleep_time=0.01, daemon=True)

    def _record(self, message: dict[str, Any]) -> None:
        job_id = message["channel"].decode().removeprefix("celery-task-meta-")
        self.counts[job_id] = self.counts.get(job_id, 0) + 1

    def close(self) -> None:
        self._thread.stop()
        self._thread.join(timeout=5)
        self._pubsub.close()


@pytest.fixture
def result_log(redis_server: RedisServer) -> Iterator[ResultLog]:
    log = ResultLog(redis_server)
    yield log
    log.close()


def logged_metrics_port(worker: Worker) -> int:
    """The port a worker's metrics endpoint got, from its log ("metrics endpoint on http://ADDR:PORT/metrics")."""
    import re

    found = re.findall(r"metrics endpoint on http://[^:]+:(\d+)/metrics", worker.log_text())
    assert len(found) == 1, f"expected one metrics endpoint line in the log of {worker.name}: {found}"
    return int(found[0])


# -- fault injection (queue delivery guarantees) ---------------------------------------------------


def drop_client_connections(server: RedisServer) -> int:
    """Close every normal client connection of `server` (not pub/sub, not ours): each worker's
    consumer sees its broker connection drop and reconnects, as after a network blip."""
    return int(server.client().execute_command("CLIENT", "KILL", "TYPE", "normal", "SKIPME", "yes"))


def broker_connects(worker: Worker) -> int:
    """How many times the worker's Celery consumer connected to the broker (its "Connected to" lines)."""
    return worker.log_text().count("Connected to ")


@dataclass
class FaultRun:
    """What `run_with_faults` saw: every submitted job ends in exactly one of `succeeded`, `failed`, `lost`."""

    jobs: int
    kills: int
    restarts: int
    succeeded: int
    failed: list[str]
    lost: list[str]
    reruns: int  # starts beyond the first, summed over jobs (a killed worker's jobs start again elsewhere)
    seconds: float
    workers_died: list[str]  # workers that exited without being killed by us
    cancels: int = 0  # bursts of cancels
    cancelled: int = 0  # jobs that ended cancelled (each was in a burst; not counted in `failed`)
    cancelled_unasked: list[str] = field(default_factory=list)  # ended cancelled though no burst named it

    @property
    def jobs_per_second(self) -> float:
        return self.jobs / self.seconds


def run_with_faults(server: RedisServer, start_worker: Callable[..., Worker], jobs: list[dict[str, Any]], *,
                    workers: int, kills: int, restarts: int, seed: int, timeout: float,
                    worker_options: dict[str, Any] | None = None, cancels: int = 0, cancel_burst: int = 200,
                    shares: int = 0) -> FaultRun:
    """Run `jobs` through `workers` workers while `kills` kill -9s (each with a replacement worker),
    `restarts` redis-server restarts (half SIGTERM, half kill -9; AOF with `appendfsync always`) and `cancels`
    bursts of cancels (up to `cancel_burst` unfinished jobs each, at once, as a Ctrl-C of a run sends) happen
    at random points of the run (random fractions of the jobs finished). With `shares`, the jobs are queued in that
    many fair shares of the queue (job i in share i mod `shares`), as runs and tenants queue them.
    """
    import random

    from tokenmill.client import Client, JobHandle, JobTimeoutError
    from tokenmill.queue.names import DELIVERIES_KEY

    rng = random.Random(seed)
    options = worker_options or {}
    pool = [start_worker(server.url, f"w{i}", **options) for i in range(workers)]
    for worker in pool:
        worker.wait_ready()
    client = Client(server.url)
    started = time.monotonic()
    if shares:
        for share in range(shares):
            with Client(server.url, share=f"soak-{share}") as publisher:
                publisher.submit_many([{"id": f"job-{i}", **job} for i, job in enumerate(jobs) if i % shares == share])
        handles = [JobHandle(f"job-{i}", client) for i in range(len(jobs))]
    else:
        handles = client.submit_many(jobs)
    keys = [client.app.backend.get_key_for_task(h.id) for h in handles]
    events = sorted((rng.uniform(0.05, 0.85), kind) for kind in ["kill"] * kills + ["restart"] * restarts
                    + ["cancel"] * cancels)
    killed: set[int] = set()
    asked: set[str] = set()
    for fraction, kind in events:
        wait_for(lambda: _finished(server, keys) >= fraction * len(keys), timeout, f"{fraction:.0%} of the jobs done",
                 interval=0.02)
        if kind == "cancel":
            burst = rng.sample([h.id for h in handles], min(cancel_burst, len(handles)))
            client.cancel(burst)
            asked.update(burst)
        elif kind == "kill":
            victim = rng.choice([w for w in pool if w.process.poll() is None])
            victim.kill()
            killed.add(id(victim))
            pool.append(start_worker(server.url, f"w{len(pool)}", **options))
        elif rng.random() < 0.5:
            server.restart()
        else:
            server.kill()
            server.start()
    try:
        results = client.results(handles, timeout=timeout)
        lost: list[str] = []
    except JobTimeoutError as exc:
        lost = list(exc.job_ids)
        results = [r for r in (client.get(h.id) for h in handles) if r is not None]
    seconds = time.monotonic() - started
    counts = server.client().mget([DELIVERIES_KEY.format(job_id=h.id) for h in handles])
    client.close()
    cancelled = [r.id for r in results if r.status == "cancelled"]
    return FaultRun(
        jobs=len(jobs), kills=kills, restarts=restarts,
        succeeded=sum(r.ok for r in results), failed=[r.id for r in results if r.status == "failed"], lost=lost,
        reruns=sum(max(0, int(c or 0) - 1) for c in counts), seconds=seconds,
        workers_died=[w.name for w in pool if id(w) not in killed and w.process.poll() is not None],
        cancels=cancels, cancelled=len(cancelled), cancelled_unasked=[i for i in cancelled if i not in asked],
    )


def _finished(server: RedisServer, keys: list[str]) -> int:
    try:
        return int(server.client().exists(*keys))
    except redis.RedisError:  # restarting right now
        return 0


@pytest.fixture
def start_server(redis_server: RedisServer, tmp_path: Path) -> Iterator[Callable[..., Server]]:
    """`start_server(env=None, **flags)`: a `tokenmill serve` on the test's Redis, closed after the test."""
    servers: list[Server] = []

    def started(env: dict[str, str] | None = None, **flags: object) -> Server:
        servers.append(Server(redis_server.url, tmp_path / "files", tmp_path / "serve.log", env=env, **flags))
        return servers[-1]

    yield started
    for server in servers:
        server.close()


def upload_batch_file(client: Any, path: Path, lines: list[dict]) -> str:
    """Write `lines` as a JSONL file at `path` and upload it with the `openai` client; its file id."""
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return client.files.create(file=path.open("rb"), purpose="batch").id


def create_batch(client: Any, file_id: str) -> str:
    """A chat completions batch of `file_id`, 24h window; its id."""
    return client.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h").id
