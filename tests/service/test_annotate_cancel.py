"""Cancelling a whole `annotate --broker` run: Ctrl-C in the foreground, `tokenmill cancel --run` from elsewhere,
and what a resume does with the cancelled rows. Real redis-server and worker processes on builtin:tiny."""

from __future__ import annotations

import os
import re
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from service_fixtures import REPO, RedisServer, Worker, engine_pid, queued, wait_for

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from annotate_helpers import cli, read_jsonl, write_jsonl  # noqa: E402

import tokenmill  # noqa: E402

TEMPLATE = "Say: {{ text }}"
LONG = {"max_tokens": 3000, "min_tokens": 3000}  # far longer than any test waits: only a cancel ends it early


def _annotate_in_background(source: Path, output: Path, broker: str, **options: Any) -> subprocess.Popen:
    """`tokenmill.annotate(...)` in its own process (so it can get a SIGINT), stdin not a terminal. SIGINT raises
    KeyboardInterrupt there, as at a terminal, even where this process ignores it (a shell's background job) and the
    child would inherit that."""
    code = (f"import signal\nsignal.signal(signal.SIGINT, signal.default_int_handler)\nimport tokenmill\n"
            f"tokenmill.annotate({str(source)!r}, {str(output)!r}, {TEMPLATE!r}, broker={broker!r}, quiet=True, "
            f"rows_per_message=2, **{options!r})\n")
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, "-c", code], env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)


def _run_id(process: subprocess.Popen) -> str:
    line = process.stderr.readline()
    match = re.search(r"tokenmill: run (\w+) ", line)
    assert match, f"no run id printed first: {line!r}"
    return match.group(1)


def _running(worker: Worker, count: int) -> None:
    wait_for(lambda: worker.metrics().get("tokenmill_running_sequences", 0) >= count, 90, f"{count} rows running")


def _idle(worker: Worker) -> None:
    wait_for(lambda: worker.metrics()["tokenmill_running_sequences"] == 0
             and worker.metrics()["tokenmill_jobs_in_flight"] == 0, 60, "the worker to stop generating")


def test_ctrl_c_cancels_the_rows_in_flight_and_checkpoints_them(tmp_path: Path, redis_server: RedisServer,
                                                                start_worker: Any) -> None:
    worker = start_worker(redis_server.url, max_num_seqs=4, num_kv_blocks=1024).wait_ready()
    source = write_jsonl(tmp_path / "in.jsonl", [{"text": f"row {i}"} for i in range(4)])
    run = _annotate_in_background(source, tmp_path / "out.jsonl", redis_server.url, **LONG)
    run_id = _run_id(run)
    _running(worker, 4)
    run.send_signal(signal.SIGINT)
    _, stderr = run.communicate(timeout=90)
    assert f"cancelled 4 jobs of run {run_id}" in stderr
    _idle(worker)  # the four 3,000-token rows stopped
    assert worker.metrics()["tokenmill_jobs_cancelled_total"] == 4
    assert worker.metrics()["tokenmill_generated_tokens_total"] < 4 * 3000


def test_detach_leaves_the_run_going_until_cancel_run_stops_it(tmp_path: Path, redis_server: RedisServer,
                                                               start_worker: Any) -> None:
    worker = start_worker(redis_server.url, max_num_seqs=4, num_kv_blocks=1024).wait_ready()
    source = write_jsonl(tmp_path / "in.jsonl", [{"text": f"row {i}"} for i in range(6)])
    run = _annotate_in_background(source, tmp_path / "out.jsonl", redis_server.url, detach=True, **LONG)
    run_id = _run_id(run)
    _running(worker, 4)  # four run, two wait on the queue
    run.send_signal(signal.SIGINT)
    _, stderr = run.communicate(timeout=90)
    assert f"stop them with: tokenmill cancel --run {run_id}" in stderr
    assert worker.metrics()["tokenmill_running_sequences"] == 4  # still going: detached

    done = cli("cancel", "--broker", redis_server.url, "--run", run_id)
    assert done.returncode == 0, done.stderr
    outcomes = sorted(line.split("\t")[1] for line in done.stdout.splitlines())
    assert len(outcomes) == 6 and outcomes.count("cancelling") >= 4 and set(outcomes) <= {"cancelling", "cancelled"}
    _idle(worker)
    assert cli("cancel", "--broker", redis_server.url, "--run", "no-such-run").returncode == 1


def test_a_resume_finishes_the_rows_its_ctrl_c_cancelled(tmp_path: Path, redis_server: RedisServer,
                                                          start_worker: Any) -> None:
    """Cancelled by the run's own Ctrl-C before any worker took them, the rows are computed by the next run of the same
    command, under new job ids (their old ones hold `cancelled` results)."""
    source = write_jsonl(tmp_path / "in.jsonl", [{"text": f"row {i}"} for i in range(5)])
    output, options = tmp_path / "out.jsonl", {"max_tokens": 4}
    run = _annotate_in_background(source, output, redis_server.url, **options)
    _run_id(run)
    wait_for(lambda: queued(redis_server.client()) >= 3, 60, "the rows to be queued")
    run.send_signal(signal.SIGINT)
    _, stderr = run.communicate(timeout=90)
    assert "cancelled 5 jobs" in stderr and "the same command computes them again" in stderr

    worker = start_worker(redis_server.url).wait_ready()
    resumed = tokenmill.annotate(str(source), str(output), TEMPLATE, broker=redis_server.url, quiet=True, **options)
    assert (resumed.rows, resumed.ok, resumed.computed) == (5, 5, 5)
    assert all(row["error"] is None and row["annotation"] for row in read_jsonl(output))
    assert worker.metrics()["tokenmill_jobs_succeeded_total"] == 5  # the cancelled jobs themselves never ran
    again = tokenmill.annotate(str(source), str(output), TEMPLATE, broker=redis_server.url, quiet=True, **options)
    assert (again.ok, again.reused, again.computed) == (5, 5, 0)


def test_rows_cancelled_on_purpose_stay_cancelled_unless_told_to_retry_them(tmp_path: Path, redis_server: RedisServer,
                                                                           start_worker: Any) -> None:
    """`tokenmill cancel --run` from elsewhere: the run ends with those rows cancelled, and a resume keeps them so
    unless `retry_cancelled`."""
    source = write_jsonl(tmp_path / "in.jsonl", [{"text": f"row {i}"} for i in range(3)])
    output, options = tmp_path / "out.jsonl", {"max_tokens": 4}
    run = _annotate_in_background(source, output, redis_server.url, **options)
    run_id = _run_id(run)
    wait_for(lambda: queued(redis_server.client()) >= 2, 60, "the rows to be queued")
    assert cli("cancel", "--broker", redis_server.url, "--run", run_id).returncode == 0
    _, stderr = run.communicate(timeout=90)
    assert run.returncode == 0, stderr  # annotate() returns its summary; the rows carry their errors
    assert all(row["error"].startswith("cancelled:") for row in read_jsonl(output))
    worker = start_worker(redis_server.url).wait_ready()
    kept = tokenmill.annotate(str(source), str(output), TEMPLATE, broker=redis_server.url, quiet=True, **options)
    assert (kept.failed, kept.reused) == (3, 3)
    retried = tokenmill.annotate(str(source), str(output), TEMPLATE, broker=redis_server.url, quiet=True,
                                 retry_cancelled=True, **options)
    assert (retried.ok, retried.computed) == (3, 3)
    assert worker.metrics()["tokenmill_jobs_succeeded_total"] == 3


def _annotate_cli(*args: str) -> subprocess.Popen:
    """`tokenmill annotate ...` in its own process with SIGINT raising KeyboardInterrupt (see above), no terminal."""
    code = ("import signal, sys\nsignal.signal(signal.SIGINT, signal.default_int_handler)\nfrom tokenmill.cli import main\n"
            "sys.exit(main(sys.argv[1:]))\n")
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, "-c", code, "annotate", *args], env=env, stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def test_ctrl_c_of_a_big_run_exits_in_seconds_and_the_worker_goes_on(tmp_path: Path, redis_server: RedisServer,
                                                                    start_worker: Any) -> None:
    """The wedged worker's reproduction: 1,000 rows of 200 tokens in flight, Ctrl-C. The command exits within 10 s
    (cancelling the rows, checkpointing what came back), a second command on the same output meanwhile is refused in
    one line, and the same worker then completes a fresh run and the resume of the first."""
    worker = start_worker(redis_server.url).wait_ready()
    source = write_jsonl(tmp_path / "big.jsonl", [{"id": f"r{i}", "text": f"row {i}"} for i in range(1000)])
    output = tmp_path / "out.jsonl"
    command = [str(source), "-o", str(output), "--template", TEMPLATE, "--max-tokens", "200", "--id-column", "id",
               "--broker", redis_server.url, "--quiet"]
    run = _annotate_cli(*command)
    run_id = _run_id(run)
    _running(worker, 32)
    second = _annotate_cli(*command)
    _, refused = second.communicate(timeout=120)
    assert second.returncode == 2 and f"another run (pid {run.pid}, run {run_id})" in refused, refused
    assert "Traceback" not in refused

    interrupted_at = time.monotonic()
    run.send_signal(signal.SIGINT)
    _, stderr = run.communicate(timeout=60)
    assert run.returncode == 130, stderr
    assert time.monotonic() - interrupted_at <= 10, f"exited {time.monotonic() - interrupted_at:.1f}s after Ctrl-C"
    assert f"jobs of run {run_id}" in stderr

    small = write_jsonl(tmp_path / "small.jsonl", [{"id": f"f{i}", "text": f"fresh {i}"} for i in range(50)])
    fresh = cli("annotate", str(small), "-o", str(tmp_path / "fresh.jsonl"), "--template", TEMPLATE, "--max-tokens", "4",
                "--id-column", "id", "--broker", redis_server.url, "--quiet")
    assert fresh.returncode == 0, fresh.stderr
    resumed = cli("annotate", *command)
    assert resumed.returncode in (0, 1), resumed.stderr  # rows cancelled by the Ctrl-C are that row's error
    assert len(read_jsonl(output)) == 1000


def test_a_second_ctrl_c_exits_at_once_with_the_checkpoint_intact(tmp_path: Path, redis_server: RedisServer,
                                                                  start_worker: Any) -> None:
    """The first Ctrl-C waits for the cancelled rows' results, which a frozen engine never sends; the second one ends
    that wait at once, and the checkpoint is a sound database."""
    worker = start_worker(redis_server.url, max_num_seqs=4, num_kv_blocks=1024).wait_ready()
    source = write_jsonl(tmp_path / "in.jsonl", [{"id": f"r{i}", "text": f"row {i}"} for i in range(4)])
    os.kill(engine_pid(worker.process.pid), signal.SIGSTOP)  # no row can finish, nor answer its cancel
    run = _annotate_cli(str(source), "-o", str(tmp_path / "out.jsonl"), "--template", TEMPLATE, "--id-column", "id",
                        "--max-tokens", "3000", "--broker", redis_server.url, "--quiet")
    _run_id(run)
    wait_for(lambda: queued(redis_server.client()) == 0 and redis_server.client().keys("tokenmill:deliveries:*"),
             60, "the worker to take the rows")
    run.send_signal(signal.SIGINT)
    time.sleep(1.0)
    assert run.poll() is None, "the first Ctrl-C should wait for the cancelled rows"
    second_at = time.monotonic()
    run.send_signal(signal.SIGINT)
    _, stderr = run.communicate(timeout=30)
    # within 3 s: the wait it ends would have run 4 s more
    assert run.returncode == 130 and time.monotonic() - second_at < 3.0, (run.returncode, stderr)
    assert "Traceback" not in stderr
    with sqlite3.connect(tmp_path / "out.jsonl.tokenmill-state" / "checkpoint.sqlite") as db:
        assert db.execute("PRAGMA integrity_check").fetchone() == ("ok",)
