"""Queue benchmark: the same short jobs through Redis + one worker and through the in-process engine.

    python benchmarks/job_queue.py [--jobs 1000] [--rounds 3] [--max-num-seqs 256]
    python benchmarks/job_queue.py --intake          # the queue path's ceiling (see below)
    python benchmarks/job_queue.py --intake --against /path/to/other/checkout   # before/after in one run
    python benchmarks/job_queue.py --instructions [--against PATH]   # the worker's instructions per job (callgrind)
    python benchmarks/job_queue.py --against-flags='--engine-cpus auto'   # a worker setting's effect, side by side

Starts its own redis-server (AOF on, `appendfsync everysec`, as in docker-compose) on a free port and
one `tokenmill worker` on builtin:tiny, loads the same model in this process, and measures, in one run:

* throughput: all jobs submitted at once until the last result is back (jobs/s, generated tokens/s),
  against `LLM.generate` of the same prompts and parameters here; their ratio. The two paths alternate
  for `--rounds` rounds and medians are reported, because a shared machine's load drifts;
* CPU seconds spent per path (worker process, engine process, redis-server, client; this process for
  in-process), which does not depend on what else the machine runs;
* client submit rate: `Client.submit_many` of all jobs (validation, Celery messages, pipelined LPUSH);
* added latency: one job at a time on an idle system, submit -> result through the queue minus
  add -> finish of the same job in the in-process engine beside it (p50/p99): what the queue costs one job. Which
  of the two runs first alternates every two jobs, and the figures are also printed for each order: on the H200
  (2026-12-04) the queue's job always ran first, and its decode steps came out 24 ms slower there.
  The same again outside the decode steps (first -> last token, stamped by the engine in both paths): those are
  the same engine code in both processes, and on a shared machine their speed drifts by more than the queue's
  whole cost. The probe's own spread is printed beside: the same job run in-process twice in a row; and the
  machine's floor under it: Redis round trips from this process (PING) after each probe, the first finding
  Redis idle since the queue's probe where the in-process runs came after it (as each of a lone job's hops finds the
  process it wakes), the rest back to back, whose median is the warm figure. A lone job waits on four of those in a row (the push that wakes the worker's BLMOVE,
  the record script, the check-in script, the store that publishes the result) and on three more wake-ups (the
  engine process, its reader, the finisher). Last, how much slower code runs after a pause on the machine:
  `Client.prepare` of one job after 20 ms asleep, and again at once. Then the same probe with the same prompts at
  `max_tokens=1`, alternating with the first: one engine step, a few ms, so the machine's drift (the same 40-token
  job in-process twice: 15-43 ms apart at p1 and p99 on the shared 2-core VMs) no longer hides what the queue adds;
* under load: submit -> result p50/p99 of the batch, for both paths;
* the engine steps each path took, and how full they could be: the sequences running or waiting before each step
  (at most `--max-num-seqs`), averaged over each tenth of the run's steps. The worker runs under
  `benchmarks/step_log.py`, which logs its engine process's steps. The in-process engine has all jobs at its first
  step, the worker's gets them as it takes them; on a GPU a step costs its kernel launches more than its tokens, so
  part-full steps are what a slower intake costs there. The first steps of the median round are listed too, each
  with its start (ms since the first submit) and its sequences: when a burst's jobs reached the engine;

`--step-floor MS` makes every engine step of both paths last at least MS milliseconds, sleeping what it did not take:
a GPU's step, whose host cost is its kernel launches whatever its sequences (the H200's builtin:tiny steps: ~6.6 ms of
the engine's CPU each at 256 sequences), imitated on a CPU, where a step costs about its tokens and so a part-full step
costs little. Its sleep also leaves the CPUs to the client, worker and Redis, as a GPU machine's other cores would.
No lone-job probes then: the in-process engine stamps a job's end inside its last step, before that step's sleep.

`--intake` isolates the queue path: the same worker, Redis and result path, with as little engine work per job
as the engine allows (builtin:tiny, `max_tokens=1`, `--max-num-seqs 1024`, 3000 jobs, no latency probe). Its
figures to read are jobs/s (first submit -> last stored result) against the in-process engine on the same
prompts, and CPU milliseconds per job of the worker process, the engine process and redis-server (from /proc,
so independent of the machine's load) against the in-process engine's.

Both paths get the same torch thread count (`--threads`, default 1): more threads than free cores
makes torch's workers spin against each other.

`--against PATH` adds a second queue path whose worker runs the checkout at PATH (its own redis-server), and
the rounds alternate between the two queue paths and the in-process engine, so a before/after comparison shares
one run's machine and its drift: on the shared 2-core machine the same code's CPU per job moves by 20% from one
run to the next, more than most changes, while the ratio of two paths measured side by side moves much less.
The client and the in-process engine are this checkout's in both.
`--against-flags FLAGS` gives that second path's worker more flags (`--against-flags='--engine-cpus auto'`); without
`--against` the second path runs this checkout too: a setting's effect, measured side by side.

`--instructions` counts what no load moves: the instructions the worker process executes per one-token job,
under valgrind's callgrind (the engine process runs natively: callgrind does not follow it). The worker runs
twice, on `--jobs` and on 200 jobs, and the difference of the two totals over the difference of the job
counts is the figure: start-up and shutdown cancel out. Under callgrind the worker is ~50x slower, so the
queue is always full and every take and group is as large as it gets: this is the intake ceiling's path.
Needs valgrind; minutes per checkout.
"""

from __future__ import annotations

import os
import sys

# This file is named like the stdlib's `queue`, and Python puts the script's folder first on sys.path:
# drop it before anything imports `queue` (redis-py does).
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != os.path.dirname(os.path.abspath(__file__))]

import argparse  # noqa: E402
import gc  # noqa: E402
import random  # noqa: E402
import re  # noqa: E402
import resource  # noqa: E402
import shlex  # noqa: E402
import shutil  # noqa: E402
import signal  # noqa: E402
import socket  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402
from pathlib import Path  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import redis  # noqa: E402

from benchmarks.step_log import THREADS_SIGNAL, logging_step  # noqa: E402
from tokenmill.client import Client  # noqa: E402
from tokenmill.sampling_params import SamplingParams  # noqa: E402

#: Seconds asleep before `QueuePath.cold_start` times code as a lone job's hops find it: longer than the 5 ms after
#: which, on the shared 2-core VMs, the first call of a fixed piece of code had slowed ~10x (2026-12-04).
COLD_PAUSE = 0.02
WARMUP_JOBS = 600  # enough for the worker to start all its pool threads, as a long-running worker has


@dataclass
class Workload:
    prompts: list[str]
    max_tokens: list[int]

    def params(self, index: int) -> SamplingParams:
        return SamplingParams(max_tokens=self.max_tokens[index], temperature=0.0, ignore_eos=True)

    def job(self, index: int) -> dict:
        return {"prompt": self.prompts[index], "max_tokens": self.max_tokens[index], "temperature": 0.0, "ignore_eos": True}

    @property
    def tokens(self) -> int:
        return sum(self.max_tokens)


@dataclass
class Probe:
    """One job alone: submit (or add) -> result, and the part of it in decode steps (first -> last token)."""

    total: float
    decode: float


@dataclass
class Paired:
    """One job through the queue and alone in-process twice, the queue's first or the in-process ones first
    (`queue_first`): the second in-process run measures the probe's own spread (the same job, the same engine, moments
    apart)."""

    queue: Probe
    local: Probe
    again: Probe
    round_trip: float = 0.0  # a Redis PING from the client right after the queue's probe, back to back
    idle_round_trip: float = 0.0  # the first of those PINGs: Redis idle since the queue's probe, as a lone job finds it
    cold_prepare: float = 0.0  # `Client.prepare` of one job after `COLD_PAUSE` asleep (`QueuePath.cold_start`)
    warm_prepare: float = 0.0  # the same call again at once
    queue_first: bool = True

    @property
    def added(self) -> float:
        return self.queue.total - self.local.total

    @property
    def added_outside_decode(self) -> float:
        """Everything but the decode steps, which are the same engine code in both processes and carry most of the
        spread of a 16-64-token job: the queue's hops, the engine process's first step, the pipe back."""
        return (self.queue.total - self.queue.decode) - (self.local.total - self.local.decode)

    @property
    def decode_added(self) -> float:
        return self.queue.decode - self.local.decode

    @property
    def null(self) -> float:
        return self.again.total - self.local.total


@dataclass
class Run:
    """One pass of the workload through one path."""

    elapsed: float
    latencies: list[float]
    cpu: dict[str, float] = field(default_factory=dict)
    submit_elapsed: float = 0.0
    # (seconds since the run began, running, waiting) at each engine step's start; None where not logged
    steps: list[tuple[float, int, int]] | None = None
    # the worker's CPU seconds by thread name (threads of one name summed), and how many threads had each name
    threads: dict[str, tuple[float, int]] = field(default_factory=dict)


def make_workload(count: int, seed: int, min_tokens: int, max_tokens: int) -> Workload:
    rng = random.Random(seed)
    words = "the quick brown fox jumps over a lazy dog while tokens mill in the engine".split()
    prompts = [" ".join(rng.choices(words, k=rng.randint(4, 24))) for _ in range(count)]
    return Workload(prompts, [rng.randint(min_tokens, max_tokens) for _ in range(count)])


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_until(check, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {what}")
        time.sleep(0.1)


def process_cpu(pid: int) -> float:
    """User + system CPU seconds of a process so far (Linux /proc)."""
    return stat_cpu(Path(f"/proc/{pid}/stat"))


def stat_cpu(stat: Path) -> float:
    """User + system CPU seconds in a /proc `stat` file (a process's, or one of its threads')."""
    fields = stat.read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def engine_pid(worker_pid: int) -> int | None:
    """The worker's engine process: its multiprocessing "spawn" child (Linux /proc)."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parent = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            command = (stat.parent / "cmdline").read_bytes()
        except OSError:
            continue
        if parent == worker_pid and b"spawn_main" in command:
            return int(stat.parent.name)
    return None


def thread_cpu(pid: int) -> dict[int, float]:
    """User + system CPU seconds of each of a process's threads so far, by native thread id (Linux /proc)."""
    seconds = {}
    for stat in Path(f"/proc/{pid}/task").glob("*/stat"):
        try:
            seconds[int(stat.parent.name)] = stat_cpu(stat)
        except OSError:  # the thread ended meanwhile
            continue
    return seconds


def own_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def shared_device_kv_blocks() -> int | None:
    """On a GPU the engines of both paths share one device, and each would size its KV cache to 0.9 of the
    device's memory: each gets a fixed pool instead, ample for these jobs. None without one (the engine's own
    sizing, as before)."""
    import torch

    return 16384 if torch.cuda.is_available() else None


class QueuePath:
    """redis-server + one worker subprocess + a Client in this process."""

    def __init__(self, directory: Path, max_num_seqs: int, threads: int, concurrency: int | None, repo: Path = REPO,
                 wrapper: tuple[str, ...] = (), entry: tuple[str, ...] = ("-m", "tokenmill.cli"),
                 flags: tuple[str, ...] = (), step_log: bool = False, step_floor: float = 0.0) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.repo = repo
        self.wrapper = wrapper  # a command the worker runs under (valgrind)
        self.entry = entry  # what Python runs: the `tokenmill` command, or a script that wraps it (hop_stamps.py)
        self.flags = flags  # more `tokenmill worker` flags (`--against-flags`)
        # `step_log`: the worker runs under `step_log.py`, its engine's steps logged in `<directory>/steps` (`Run.steps`),
        # each lasting at least `step_floor` seconds (`--step-floor`)
        self.step_floor = step_floor
        self.redis = self._start_redis(directory)
        self.step_log = directory / "steps" if step_log else None
        if self.step_log:
            self.step_log.mkdir()
            self.entry = (str(Path(__file__).with_name("step_log.py")),)
        self.worker = self._start_worker(directory / "worker.log", max_num_seqs, threads, concurrency)
        self.engine_pid = engine_pid(self.worker.pid)
        self.client = Client(self.broker)
        self.pinged = redis.Redis.from_url(self.broker)  # its own connection: the client's stay as the probes use them

    def _start_redis(self, directory: Path) -> subprocess.Popen:
        server = shutil.which("redis-server") or sys.exit("redis-server not found")
        port = free_port()
        process = subprocess.Popen(
            [server, "--port", str(port), "--bind", "127.0.0.1", "--dir", str(directory), "--save", "",
             "--appendonly", "yes", "--appendfsync", "everysec"],
            stdout=subprocess.DEVNULL,
        )

        def answers() -> bool:
            try:
                return bool(redis.Redis(port=port).ping())
            except redis.RedisError:
                return False

        wait_until(answers, 10, "redis-server")
        self.broker = f"redis://127.0.0.1:{port}/0"
        return process

    def _start_worker(self, log_path: Path, max_num_seqs: int, threads: int, concurrency: int | None) -> subprocess.Popen:
        command = [*self.wrapper, sys.executable, *self.entry, "worker", "--broker", self.broker, "--model", "builtin:tiny",
                   "--max-num-seqs", str(max_num_seqs), "--metrics-port", "0", "--hostname", "bench@%h"]
        if concurrency:
            command += ["--concurrency", str(concurrency)]
        command += self.flags
        # The checkout first; what PYTHONPATH held stays after it (packages carried to a machine without them).
        path = os.pathsep.join(filter(None, [str(self.repo), os.environ.get("PYTHONPATH")]))
        env = {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": str(threads)}
        if self.step_log:
            env["STEP_LOG"] = str(self.step_log)
            env["STEP_FLOOR_MS"] = str(self.step_floor * 1000)
        if (blocks := shared_device_kv_blocks()) is not None:
            env["TOKENMILL_NUM_KV_BLOCKS"] = str(blocks)
        self.log_path = log_path
        process = subprocess.Popen(command, stdout=open(log_path, "wb"), stderr=subprocess.STDOUT, env=env, cwd=self.repo)

        def ready() -> bool:
            text = log_path.read_text(errors="replace")
            return process.poll() is not None or ("bench@" in text and " ready." in text)

        wait_until(ready, 900 if self.wrapper else 180, "the worker")
        if process.poll() is not None:
            sys.exit(f"worker exited:\n{log_path.read_text()}")
        return process

    def warm_up(self, workload: Workload) -> None:
        jobs = (workload.job(i % len(workload.prompts)) for i in range(WARMUP_JOBS))
        self.client.results(self.client.submit_many(jobs), timeout=600)

    def run(self, workload: Workload) -> Run:
        pids = {"worker": self.worker.pid, "engine": self.engine_pid, "redis": self.redis.pid}
        before = {name: process_cpu(pid) for name, pid in pids.items() if pid}
        threads_before = thread_cpu(self.worker.pid)
        client_before = own_cpu()
        jobs = [workload.job(i) for i in range(len(workload.prompts))]
        since = time.time()
        started = time.perf_counter()
        handles = self.client.submit_many(jobs)
        submit_elapsed = time.perf_counter() - started
        latencies, tokens = [], 0
        for result in self.client.as_completed(handles, timeout=600):
            assert result.ok, result.error
            latencies.append(time.time() - result.queued_at)
            tokens += result.usage.completion_tokens
        elapsed = time.perf_counter() - started
        assert tokens == workload.tokens
        cpu = {name: process_cpu(pids[name]) - value for name, value in before.items()}
        cpu["client"] = own_cpu() - client_before
        threads = self.by_thread_name(threads_before, thread_cpu(self.worker.pid))
        return Run(elapsed, latencies, cpu, submit_elapsed, (self.logged_steps(since) or None) if self.step_log else None,
                   threads)

    def by_thread_name(self, before: dict[int, float], after: dict[int, float]) -> dict[str, tuple[float, int]]:
        """The worker's CPU seconds between `before` and `after` (`thread_cpu`), by the name the worker gives each
        thread (`step_log.log_threads`; threads of one name summed, with their count); empty where not logged."""
        if not self.step_log:
            return {}
        path = self.step_log / f"{self.worker.pid}.threads"
        path.unlink(missing_ok=True)
        os.kill(self.worker.pid, THREADS_SIGNAL)
        deadline = time.monotonic() + 2
        while not path.exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(0.05)  # written in one call, but the file exists before that call
        if not path.exists():
            return {}
        names = {int(native_id): name for native_id, name in (line.split(" ", 1) for line in path.read_text().splitlines())}
        totals: dict[str, tuple[float, int]] = {}
        for tid, seconds in after.items():
            name = names.get(tid, "(ended before the names were taken)")
            spent, count = totals.get(name, (0.0, 0))
            totals[name] = (spent + seconds - before.get(tid, 0.0), count + 1)
        return totals

    def logged_steps(self, since: float) -> list[tuple[float, int, int]]:
        """(seconds since `since`, running, waiting) of each step the engine process began from `since` (a `time.time()`)
        on, in order:
        `step_log.py`'s lines "<time> <running> <waiting>", which the engine process writes out on SIGUSR1."""
        if self.engine_pid:
            os.kill(self.engine_pid, signal.SIGUSR1)
            time.sleep(0.1)  # the handler runs between two of its bytecodes, and an idle wait on its pipe is woken
        steps = []
        for path in self.step_log.glob("*.steps"):
            steps += [(float(at), int(running), int(waiting)) for at, running, waiting in map(str.split, path.open())]
        return [(at - since, running, waiting) for at, running, waiting in sorted(steps) if at >= since]

    def probe(self, workload: Workload, index: int) -> Probe:
        """Submit -> result of one job alone, and its decode steps (the engine process's first -> last token)."""
        sent = time.time()
        result = self.client.submit(**workload.job(index)).result(timeout=60)
        return Probe(time.time() - sent, result.finished_at - result.first_token_at)

    def round_trips(self, pings: int = 9) -> tuple[float, float]:
        """`pings` PINGs from this process: the first, which finds Redis idle since the last probe (as each of a lone
        job's hops finds the process it wakes), and the median of all, back to back: the machine's cost of one wake-up
        each way, cold and warm."""
        times = []
        for _ in range(pings):
            started = time.perf_counter()
            self.pinged.ping()
            times.append(time.perf_counter() - started)
        return times[0], statistics.median(times)

    def cold_start(self, job: dict) -> tuple[float, float]:
        """`Client.prepare(job)` after `COLD_PAUSE` seconds asleep, then again at once: what the machine does to code
        that runs after a pause (as each process a lone job wakes runs its part after one). On these shared VMs the
        first call was ~10x slower, whether the pause slept or spun: other tenants had evicted the code's caches."""
        time.sleep(COLD_PAUSE)
        started = time.perf_counter()
        self.client.prepare(job)
        first = time.perf_counter()
        self.client.prepare(job)
        return first - started, time.perf_counter() - first

    def log_tail(self) -> None:
        """The worker's warnings and errors, if any (a benchmark over a worker that logged errors is suspect)."""
        lines = [line for line in self.log_path.read_text(errors="replace").splitlines() if " ERROR " in line or " CRITICAL " in line]
        for line in lines[-5:]:
            print("worker log:", line[:300], file=sys.stderr)

    def close(self) -> None:
        try:
            self.worker.terminate()
            self.worker.wait(timeout=600 if self.wrapper else 90)
        except subprocess.TimeoutExpired:
            self.worker.kill()
            self.worker.wait()
        finally:
            self.redis.terminate()
            self.redis.wait(timeout=30)


class LocalPath:
    """`LLM.generate` in this process."""

    def __init__(self, max_num_seqs: int, threads: int, step_floor: float = 0.0) -> None:
        """`step_floor`: seconds each engine step lasts at least (`--step-floor`)."""
        import torch

        from tokenmill import LLM

        torch.set_num_threads(threads)
        self.llm = LLM("builtin:tiny", max_num_seqs=max_num_seqs, num_kv_blocks=shared_device_kv_blocks())
        self.steps: list[tuple[float, int, int]] = []  # (time, running, waiting) before each step, as the worker's
        self.llm.engine.step = logging_step(self.llm.engine, self.steps, step_floor)

    def warm_up(self, workload: Workload) -> None:
        count = min(20, len(workload.prompts))  # `lone_job_hops.py --jobs` may ask for fewer
        self.llm.generate(workload.prompts[:count], [workload.params(i) for i in range(count)], use_tqdm=False)

    def run(self, workload: Workload) -> Run:
        params = [workload.params(i) for i in range(len(workload.prompts))]
        del self.steps[:]
        since = time.time()
        cpu_before, started = own_cpu(), time.perf_counter()
        outputs = self.llm.generate(workload.prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - started
        assert sum(len(o.token_ids) for o in outputs) == workload.tokens
        return Run(elapsed, [o.finished_time - o.arrival_time for o in outputs], {"in-process": own_cpu() - cpu_before},
                   steps=[(at - since, running, waiting) for at, running, waiting in self.steps])

    def probe(self, workload: Workload, index: int) -> Probe:
        one = self.llm.generate([workload.prompts[index]], [workload.params(index)], use_tqdm=False)[0]
        return Probe(one.finished_time - one.arrival_time, one.finished_time - one.first_token_time)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", type=int, default=1000)
    parser.add_argument("--min-tokens", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--concurrency", type=int, default=None, help="worker --concurrency (default: the worker's)")
    parser.add_argument("--rounds", type=int, default=3, help="alternating runs of each path; medians are reported")
    parser.add_argument("--probe-jobs", type=int, default=100, help="one-at-a-time jobs for the added-latency probe")
    parser.add_argument("--threads", type=int, default=1, help="torch threads, the same for both paths")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--against", default=None, metavar="PATH",
                        help="another checkout whose worker runs beside this one's, rounds alternating (see above)")
    parser.add_argument("--against-flags", default=None, metavar="FLAGS",
                        help="worker flags of a second queue path (of --against PATH, or of this checkout), rounds "
                             "alternating, e.g. --against-flags='--engine-cpus auto'")
    parser.add_argument("--instructions", action="store_true",
                        help="the worker's instructions per one-token job under callgrind (see above); implies --intake")
    parser.add_argument("--step-floor", type=float, default=0.0, metavar="MS",
                        help="each engine step of both paths lasts at least MS milliseconds (see above)")
    parser.add_argument("--intake", action="store_true",
                        help="the queue path's ceiling: max_tokens=1, 3000 jobs, --max-num-seqs 1024, no latency probe "
                             "(explicit flags still win)")
    args = parser.parse_args(intake_defaults(sys.argv[1:]))
    if args.step_floor:  # the in-process engine stamps a job's end inside its last step, before that step's floor
        args.probe_jobs = 0
    workload = make_workload(args.jobs, args.seed, args.min_tokens, args.max_tokens)

    repos = {"this checkout": (REPO, ())}
    if args.against or args.against_flags:
        flags = tuple(shlex.split(args.against_flags or ""))
        repos[f"against {args.against or 'this checkout'}{' ' + ' '.join(flags) if flags else ''}"] = (
            Path(args.against or REPO).resolve(), flags)
    if args.instructions:
        count_instructions(args, workload, repos)
        return
    with tempfile.TemporaryDirectory() as tmp:
        queues: dict[str, QueuePath] = {}
        try:
            for number, (name, (repo, flags)) in enumerate(repos.items()):
                queues[name] = QueuePath(Path(tmp) / str(number), args.max_num_seqs, args.threads, args.concurrency, repo,
                                         flags=flags, step_log=True, step_floor=args.step_floor / 1000)
            local = LocalPath(args.max_num_seqs, args.threads, args.step_floor / 1000)
            for queue in queues.values():
                queue.warm_up(workload)
            local.warm_up(workload)
            # This process holds the in-process engine's model and tokenizer (~450,000 objects tracked) as no client
            # does; a full collection walks them all, and fell at random into either path's rounds (226 ms, in one of
            # four in-process rounds timed with `gc.callbacks`, 2026-12-04). The engine process freezes its heap too.
            gc.collect()
            gc.freeze()
            queue_runs: dict[str, list[Run]] = {name: [] for name in queues}
            local_runs: dict[str, list[Run]] = {name: [] for name in queues}
            for _ in range(args.rounds):
                for name, queue in queues.items():  # each queue round next to an in-process round of its own
                    queue_runs[name].append(queue.run(workload))
                    local_runs[name].append(local.run(workload))
            added: dict[str, list[Paired]] = {name: [] for name in queues}
            added_one: dict[str, list[Paired]] = {name: [] for name in queues}  # the same prompts, one token each
            one_token = Workload(workload.prompts, [1] * len(workload.prompts))
            paths = list(queues.items())
            for index in range(args.probe_jobs):
                # each queue path in turn, job by job: the same drift for both; which goes first alternates too (of one
                # pair of lone jobs, the first came out 0.16 ms slower, paired, on 2026-12-03 whatever its code)
                for name, queue in paths if index % 2 == 0 else paths[::-1]:
                    # the job through the queue and alone in-process: the pair shares the machine's speed of the moment.
                    # Which goes first alternates every two jobs: a device that slows down while idle (a GPU lowering
                    # its clocks) would otherwise always slow the same one
                    queue_first = index // 2 % 2 == 0
                    probe = queue.probe(workload, index) if queue_first else None
                    local_probes = local.probe(workload, index), local.probe(workload, index)
                    probe = probe or queue.probe(workload, index)
                    idle, warm = queue.round_trips()
                    cold_prepare, warm_prepare = queue.cold_start(workload.job(index))
                    added[name].append(Paired(probe, *local_probes, round_trip=warm, idle_round_trip=idle,
                                              cold_prepare=cold_prepare, warm_prepare=warm_prepare, queue_first=queue_first))
                    probe = queue.probe(one_token, index) if queue_first else None
                    local_probes = local.probe(one_token, index), local.probe(one_token, index)
                    added_one[name].append(Paired(probe or queue.probe(one_token, index), *local_probes,
                                                  queue_first=queue_first))
            for queue in queues.values():
                queue.log_tail()
        finally:
            gc.unfreeze()  # collectable again at exit (frozen, nanobind's objects were reported as leaked)
            for queue in queues.values():
                queue.close()
    for name in queues:
        if len(queues) > 1:
            print(f"\n### {name}")
        report(args, workload, local_runs[name], queue_runs[name], added[name], added_one[name])
    if len(queues) > 1:
        compare(workload, local_runs, queue_runs, added, added_one)


#: Engine steps whose start and sequences the report lists, per path (`first_steps`).
FIRST_STEPS = 16
#: What `--intake` changes; a flag given on the command line wins.
INTAKE_DEFAULTS = {"--jobs": "3000", "--min-tokens": "1", "--max-tokens": "1", "--max-num-seqs": "1024", "--probe-jobs": "0"}


def intake_defaults(argv: list[str]) -> list[str]:
    if "--instructions" in argv and "--intake" not in argv:
        argv = [*argv, "--intake"]
    if "--intake" not in argv:
        return argv
    given = {arg.split("=", 1)[0] for arg in argv}
    return [*(item for flag, value in INTAKE_DEFAULTS.items() if flag not in given for item in (flag, value)), *argv]


def filled_by_tenths(steps: list[tuple[float, int, int]] | None, max_num_seqs: int) -> str:
    """How full the engine's steps could be: the sequences running or waiting before each step, at most `max_num_seqs`,
    averaged over each tenth of the run's steps in turn."""
    if not steps:
        return "?"
    tenths = [steps[len(steps) * i // 10:len(steps) * (i + 1) // 10] for i in range(10)]
    return " ".join(f"{sum(min(max_num_seqs, running + waiting) for _, running, waiting in part) / len(part):.0f}"
                    for part in tenths if part)


def first_steps(steps: list[tuple[float, int, int]] | None, count: int = FIRST_STEPS) -> str:
    """The run's first `count` engine steps as "<ms since the run began>:<sequences running or waiting>": when a
    burst's jobs reached the engine."""
    if not steps:
        return "?"
    return " ".join(f"{1000 * at:.0f}:{running + waiting}" for at, running, waiting in steps[:count])


def _median_run(runs: list[Run]) -> Run:
    return sorted(runs, key=lambda run: run.elapsed)[len(runs) // 2]


def report(args: argparse.Namespace, workload: Workload, local_runs: list[Run], queue_runs: list[Run], added: list[Paired],
           added_one: list[Paired]) -> None:
    n = len(workload.prompts)
    local, queue = _median_run(local_runs), _median_run(queue_runs)
    queue_cpu = sum(queue.cpu.values())
    rows = [
        ("jobs / s", f"{n / local.elapsed:.0f}", f"{n / queue.elapsed:.0f}"),
        ("generated tokens / s", f"{workload.tokens / local.elapsed:.0f}", f"{workload.tokens / queue.elapsed:.0f}"),
        ("wall time, all jobs (s)", f"{local.elapsed:.2f}", f"{queue.elapsed:.2f}"),
        ("CPU time, all jobs (s)", f"{local.cpu['in-process']:.2f}",
         f"{queue_cpu:.2f} = " + " + ".join(f"{v:.2f} {k}" for k, v in queue.cpu.items())),
        ("submit -> result p50 under load (s)", f"{percentile(local.latencies, 50):.2f}", f"{percentile(queue.latencies, 50):.2f}"),
        ("submit -> result p99 under load (s)", f"{percentile(local.latencies, 99):.2f}", f"{percentile(queue.latencies, 99):.2f}"),
        # a step on a GPU costs its kernel launches more than its tokens: more steps for the same jobs is slower there
        ("engine steps (forward passes), each round", ", ".join(str(len(run.steps)) for run in local_runs),
         ", ".join("?" if run.steps is None else str(len(run.steps)) for run in queue_runs)),
        (f"sequences a step had, running or waiting (at most {args.max_num_seqs}), by tenths of the steps",
         filled_by_tenths(local.steps, args.max_num_seqs), filled_by_tenths(queue.steps, args.max_num_seqs)),
    ]
    mode = "intake mode (the queue path's ceiling), " if args.intake else ""
    mode += f"every engine step at least {args.step_floor:g} ms (`--step-floor`), " if args.step_floor else ""
    print(f"\n{mode}{n} jobs, prompts of 4-24 words, max_tokens {args.min_tokens}-{args.max_tokens} (ignore_eos, greedy), builtin:tiny, "
          f"max_num_seqs {args.max_num_seqs}, {args.threads} torch thread(s), {os.cpu_count()} CPUs, "
          f"median of {args.rounds} alternating rounds\n")
    print("| | in-process engine | Redis + 1 worker |")
    print("|---|---:|---:|")
    for name, a, b in rows:
        print(f"| {name} | {a} | {b} |")
    ratios = [lo.elapsed / q.elapsed for lo, q in zip(local_runs, queue_runs)]
    submit_rates = [n / run.submit_elapsed for run in queue_runs]
    print(f"\n- throughput ratio (queue / in-process): **{statistics.median(ratios):.2f}** "
          f"(goal >= {0.5 if args.intake else 0.9}); "
          f"per round: {', '.join(f'{r:.2f}' for r in ratios)}")
    per_job = {name: 1000 * value / n for name, value in {**local.cpu, **queue.cpu}.items()}
    print("- CPU per job (ms, from /proc; median-time round): " + ", ".join(f"{k} {v:.3f}" for k, v in per_job.items())
          + f"; engine process minus in-process: {per_job.get('engine', 0) - per_job['in-process']:+.3f}"
          + " (goals: worker <= 0.2, engine <= in-process + 0.1, redis <= 0.1)")
    if queue.threads:
        print("- worker CPU per job by thread (ms, median-time round): " + ", ".join(
            f"{name}{f' x{count}' if count > 1 else ''} {1000 * spent / n:.3f}"
            for name, (spent, count) in sorted(queue.threads.items(), key=lambda item: -item[1][0]) if spent > 0))
    print(f"- client submit rate (`submit_many`, {n} jobs): **{statistics.median(submit_rates):.0f} jobs/s** (goal >= 2000)")
    print(f"- the first {FIRST_STEPS} engine steps of the median-time round, \"ms since the run began:sequences running or "
          f"waiting\": in-process {first_steps(local.steps)}; through the queue {first_steps(queue.steps)}")
    if added:
        def ms(values: list[float], *qs: int) -> str:
            return ", ".join(f"p{q} {1000 * percentile(values, q):.1f}" for q in qs)

        print(f"- added latency of the queue, one job at a time ({len(added)} jobs, ms; goal p50 <= 5, p99 <= 15): "
              f"**{ms([p.added for p in added], 50, 99)}**; outside the decode steps: "
              f"**{ms([p.added_outside_decode for p in added], 50, 99)}**; the decode steps themselves, engine "
              f"process minus in-process: {ms([p.decode_added for p in added], 50)}; the probe's own spread (the same job "
              f"in-process twice, moments apart): {ms([p.null for p in added], 1, 50, 99)}; a Redis round trip "
              f"(PING from this process after each probe): back to back (median of 9) p50 "
              f"{1000 * percentile([p.round_trip for p in added], 50):.2f}, the first, Redis idle since the probe, p50 "
              f"{1000 * percentile([p.idle_round_trip for p in added if p.queue_first], 50):.2f}; this process's `Client.prepare` of "
              f"one job after {1000 * COLD_PAUSE:.0f} ms asleep p50 {1e6 * percentile([p.cold_prepare for p in added], 50):.0f}"
              f" µs, again at once p50 {1e6 * percentile([p.warm_prepare for p in added], 50):.0f} µs (how much slower "
              f"code runs after a pause on this machine, as a lone job's every hop does)")
        print(f"- the same, lone one-token jobs (the same prompts, `max_tokens=1`; one engine step, too short for the "
              f"machine's drift to hide the queue's own cost): **{ms([p.added for p in added_one], 50, 99)}**; the probe's "
              f"own spread: {ms([p.null for p in added_one], 1, 50, 99)}")
        for label, probes, figure in (("added latency", added, lambda p: p.added),
                                      ("a lone job's decode steps, engine process minus in-process", added, lambda p: p.decode_added),
                                      ("one-token jobs' added latency", added_one, lambda p: p.added)):
            orders = [(order, [figure(p) for p in probes if p.queue_first == first])
                      for order, first in (("the queue's job first", True), ("the in-process job first", False))]
            print(f"- {label}, by which path ran first: " + "; ".join(
                f"{order} {ms(values, 50)} ({len(values)} jobs)" for order, values in orders if values))
    print(f"- machine load average when done: {os.getloadavg()[0]:.2f}")


#: Jobs of the shorter run of `--instructions`, whose total is subtracted.
BASELINE_JOBS = 200


def count_instructions(args: argparse.Namespace, workload: Workload, repos: dict[str, tuple[Path, tuple[str, ...]]]) -> None:
    """Per checkout, the worker's instructions per job: (total on all jobs - total on BASELINE_JOBS) / the difference."""
    if shutil.which("valgrind") is None:
        sys.exit("--instructions needs valgrind (apt-get install valgrind)")
    if len(workload.prompts) <= BASELINE_JOBS:
        sys.exit(f"--instructions needs more than {BASELINE_JOBS} --jobs")
    per_job = {}
    for name, (repo, flags) in repos.items():
        totals = []
        for count in (BASELINE_JOBS, len(workload.prompts)):
            with tempfile.TemporaryDirectory() as tmp:
                out = Path(tmp) / "callgrind.out"
                wrapper = ("valgrind", "--tool=callgrind", f"--callgrind-out-file={out}", "--trace-children=no")
                queue = QueuePath(Path(tmp), args.max_num_seqs, args.threads, args.concurrency, repo, wrapper, flags=flags)
                try:
                    jobs = [workload.job(i) for i in range(count)]
                    for result in queue.client.results(queue.client.submit_many(jobs), timeout=3600):
                        assert result.ok, result.error
                finally:
                    queue.close()
                totals.append(int(re.search(r"^(?:summary|totals):\s+(\d+)", out.read_text(), re.M).group(1)))
        per_job[name] = (totals[1] - totals[0]) / (len(workload.prompts) - BASELINE_JOBS)
        print(f"- {name}: worker totals {totals[0]:,} ({BASELINE_JOBS} jobs) and {totals[1]:,} "
              f"({len(workload.prompts)} jobs): **{per_job[name] / 1e6:.3f} M instructions per job**")
    if len(per_job) > 1:
        mine, theirs = per_job.values()
        print(f"- this checkout / other: **{mine / theirs:.2f}**")


def compare(workload: Workload, local_runs: dict[str, list[Run]], queue_runs: dict[str, list[Run]],
            added: dict[str, list[Paired]], added_one: dict[str, list[Paired]]) -> None:
    """Per round, each path's figure over the other's (this checkout's first): the rounds ran side by side; then the
    lone jobs' added latency, whose probes alternated job by job."""
    n = len(workload.prompts)
    (this, other) = list(queue_runs)[:2]
    print(f"\n### this checkout / {other.removeprefix('against ')}, per round (median)\n")
    rows = [("throughput ratio (queue / in-process)", lambda name, i: local_runs[name][i].elapsed / queue_runs[name][i].elapsed)]
    for process in ("worker", "engine", "redis"):
        rows.append((f"{process} CPU per job (ms)", lambda name, i, p=process: 1000 * queue_runs[name][i].cpu.get(p, 0) / n))
    rows.append(("worker CPU per job / in-process CPU per job",
                 lambda name, i: queue_runs[name][i].cpu["worker"] / local_runs[name][i].cpu["in-process"]))
    print("| | this checkout | other | this / other |")
    print("|---|---|---|---|")
    for label, figure in rows:
        mine = [figure(this, i) for i in range(len(queue_runs[this]))]
        theirs = [figure(other, i) for i in range(len(queue_runs[other]))]
        quotients = [a / b for a, b in zip(mine, theirs) if b]
        print(f"| {label} | {', '.join(f'{v:.3f}' for v in mine)} | {', '.join(f'{v:.3f}' for v in theirs)} | "
              f"**{statistics.median(quotients):.2f}** |")
    if added[this]:
        for label, probes, figure in (("added latency", added, lambda p: p.added),
                                      ("added latency outside the decode steps", added, lambda p: p.added_outside_decode),
                                      ("one-token jobs' added latency", added_one, lambda p: p.added)):
            mine, theirs = [1000 * figure(p) for p in probes[this]], [1000 * figure(p) for p in probes[other]]
            print(f"- lone jobs, {label} (ms): p50 {percentile(mine, 50):.1f} against {percentile(theirs, 50):.1f}; "
                  f"p99 {percentile(mine, 99):.1f} against {percentile(theirs, 99):.1f}; median of the same job's "
                  f"difference (this - other): {statistics.median(a - b for a, b in zip(mine, theirs)):+.2f}")


if __name__ == "__main__":
    main()
