"""The checks of scripts/compose_smoke.sh, run from the host against the running compose stack.

1. Jobs from the host with `tokenmill.Client`: every result succeeds with exactly `max_tokens` tokens,
   identical greedy prompts give identical tokens, and one job with output="s3://results/run1" is read
   back from the S3 store with boto3 (Redis keeps the stub with `output_uri`).
2. `/metrics` answers and counts the jobs; the engine heartbeat `tokenmill health` relies on is there.
3. Flower's API lists the worker with the basic-auth credentials and refuses without them.
   Credentials: Redis refuses a client without the password; the worker container was given MinIO's
   worker user (not root) and may write only under s3://results/ (a job outside fails, naming output).
4. Crash: the worker's main process is SIGKILLed mid-run (from the host, as the kernel's OOM killer
   would); the container exits 137, Docker's restart policy restarts it, and every job finishes.
5. `docker kill -s KILL` on the worker container mid-run: Docker treats a kill through its API as a
   deliberate stop and does not apply the restart policy (printed either way); the operator's
   `compose start` brings the worker back and every job finishes.
6. Exactly once: each job's result is written once (one publish on its result key, counted from the
   start) and stored once, every job has a completed run in the worker's log (across its restarts), and
   the killed runs were redelivered (a result with attempt > 1). A run killed after generating but
   before its result was stored is generated again; that is reported, not counted as a second finish.
7. The `api` service with the `openai` SDK: `GET /v1/models` lists the worker's model; a batch file is
   uploaded (its bytes land in the files bucket), run to `completed`, and its output file holds every line in
   input order with equal completions for equal greedy prompts; a line naming a model no worker serves is in
   the error file (`model_not_found`); a wrong key gets 401.

Exits non-zero (an AssertionError or timeout) on any failure.
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import shlex
import subprocess
import time
import urllib.error
import urllib.request
from base64 import b64encode
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

import boto3
import redis
from prometheus_client.parser import text_string_to_metric_families

from tokenmill import Client
from tokenmill.queue.names import DELIVERIES_KEY
from tokenmill.queue.schemas import JobResult

BUCKET, PREFIX = "results", "run1"
#: Tokens per job of the batches killed mid-run: long enough (seconds on an idle machine) that every job is
#: still running at the kill, which comes as soon as all of them have started.
MID_RUN_TOKENS = 2048


def log(message: str) -> None:
    print(f"[compose-check {time.strftime('%H:%M:%S')}] {message}", flush=True)


def wait_for(what: str, condition: Callable[[], Any], timeout: float, interval: float = 0.5) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")


class Stack:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.client = Client(args.broker)
        self.redis = redis.Redis.from_url(args.broker)
        self.submitted: list[str] = []
        # Every result write publishes on its key's channel: a job written twice shows a count of 2, which
        # a GET of the single result key could never reveal.
        self.result_writes: collections.Counter[str] = collections.Counter()
        self._pubsub = self.redis.pubsub()
        self._pubsub.psubscribe(**{"celery-task-meta-*": self._record})
        self._listener = self._pubsub.run_in_thread(sleep_time=0.01, daemon=True)

    def _record(self, message: dict[str, Any]) -> None:
        self.result_writes[message["channel"].decode().removeprefix("celery-task-meta-")] += 1

    def writes_so_far(self) -> collections.Counter[str]:
        """The result writes counted up to now, once the listener thread has caught up.

        A result is readable the moment its store script ran, but the listener thread may not yet have taken
        the PUBLISH that went with it (CI once read a job's count as 0 just after reading its result). One
        connection's messages arrive in the order Redis sent them, so once a marker published now is counted,
        so is every write published before it.
        """
        marker = f"marker-{time.monotonic_ns()}"
        self.redis.publish(f"celery-task-meta-{marker}", "")
        wait_for("the result listener to catch up", lambda: self.result_writes[marker], timeout=30, interval=0.05)
        return self.result_writes

    def sh(self, *command: str) -> str:
        return subprocess.run(command, check=True, capture_output=True, text=True).stdout.strip()

    def worker_id(self) -> str:
        return self.sh(*shlex.split(self.args.compose), "ps", "-q", "worker-cpu")

    def state(self) -> dict[str, Any]:
        return json.loads(self.sh(self.args.docker, "inspect", "-f", "{{json .State}}", self.worker_id()))

    def restart_count(self) -> int:
        return int(self.sh(self.args.docker, "inspect", "-f", "{{.RestartCount}}", self.worker_id()))

    def submit(self, tag: str, count: int, max_tokens: int, **extra: Any) -> list:
        jobs = [
            {"id": f"{tag}-{i}", "prompt": f"Smoke test prompt {i % 5}:", "max_tokens": max_tokens,
             "temperature": 0.0, "ignore_eos": True, "metadata": {"tag": tag}, **extra}
            for i in range(count)
        ]
        handles = self.client.submit_many(jobs)
        self.submitted += [h.id for h in handles]
        return handles

    def results(self, handles: list, timeout: float) -> dict[str, JobResult]:
        got = {r.id: r for r in self.client.as_completed(handles, timeout=timeout)}
        assert sorted(got) == sorted(h.id for h in handles), "missing results"
        return got

    def done(self, handles: list) -> int:
        return sum(1 for h in handles if self.client.get(h.id) is not None)


def check_results(results: dict[str, JobResult], max_tokens: int) -> None:
    by_prompt: dict[str, list[int]] = {}
    for result in results.values():
        assert result.ok, f"job {result.id} failed: {result.error}"
        assert result.usage is not None and result.usage.completion_tokens == max_tokens, (result.id, result.usage)
        if result.output_uri is None:
            assert result.token_ids is not None and len(result.token_ids) == max_tokens, result.id
            prompt_key = result.id.rsplit("-", 1)[1]
            tokens = by_prompt.setdefault(str(int(prompt_key) % 5), list(result.token_ids))
            assert tokens == list(result.token_ids), f"greedy job {result.id} differs from the same prompt's other jobs"


def step_jobs_and_s3(stack: Stack) -> None:
    handles = stack.submit("basic", 30, 16)
    s3_handle = stack.submit("s3", 1, 16, output=f"s3://{BUCKET}/{PREFIX}")[0]
    results = stack.results(handles + [s3_handle], timeout=180)
    check_results(results, 16)
    stub = results[s3_handle.id]
    expected_uri = f"s3://{BUCKET}/{PREFIX}/{s3_handle.id}.json"
    assert stub.output_uri == expected_uri, stub.output_uri
    user, password = stack.args.s3_keys.split(":", 1)
    s3 = boto3.client("s3", endpoint_url=stack.args.s3, region_name="us-east-1",
                      aws_access_key_id=user, aws_secret_access_key=password)
    body = json.loads(s3.get_object(Bucket=BUCKET, Key=f"{PREFIX}/{s3_handle.id}.json")["Body"].read())
    full = JobResult.model_validate(body)
    assert full.id == s3_handle.id and full.ok and full.text and len(full.token_ids or []) == 16, body
    log(f"31 jobs from the host: all succeeded, 16 tokens each; {expected_uri} read back with boto3 ({len(full.text)} chars)")


def metric_values(url: str) -> dict[str, float]:
    text = urllib.request.urlopen(url, timeout=5).read().decode()
    return {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples}


def step_metrics(stack: Stack) -> None:
    values = metric_values(stack.args.metrics)
    assert values.get("tokenmill_jobs_succeeded_total", 0) >= 31, values.get("tokenmill_jobs_succeeded_total")
    age = time.time() - values["tokenmill_engine_last_status_timestamp_seconds"]
    assert age < 10, f"engine heartbeat is {age:.1f}s old"
    log(f"/metrics: tokenmill_jobs_succeeded_total={values['tokenmill_jobs_succeeded_total']:.0f}, "
        f"engine heartbeat {age:.1f}s old")


def step_flower(stack: Stack) -> None:
    url = f"{stack.args.flower}/api/workers?refresh=1"
    auth = {"Authorization": "Basic " + b64encode(stack.args.flower_auth.encode()).decode()}

    def workers() -> list[str]:
        try:
            data = json.loads(urllib.request.urlopen(urllib.request.Request(url, headers=auth), timeout=10).read())
        except OSError:
            return []
        return [name for name in data if name.startswith("tokenmill@")]

    names = wait_for("Flower to list the worker", workers, timeout=60, interval=2)
    try:
        urllib.request.urlopen(url, timeout=10)
        raise AssertionError("Flower's API answered without credentials")
    except urllib.error.HTTPError as exc:
        assert exc.code == 401, exc.code
    log(f"Flower /api/workers lists {names} with basic auth, and answers 401 without it")


def step_credentials(stack: Stack) -> None:
    broker = urlsplit(stack.args.broker)
    try:
        redis.Redis(host=broker.hostname, port=broker.port).ping()
        raise AssertionError("Redis answered a client without the password")
    except redis.AuthenticationError:
        pass
    env = dict(line.split("=", 1) for line in json.loads(
        stack.sh(stack.args.docker, "inspect", "-f", "{{json .Config.Env}}", stack.worker_id())))
    root = stack.args.s3_keys.split(":", 1)[0]
    assert env["AWS_ACCESS_KEY_ID"] == stack.args.worker_s3_user != root, env["AWS_ACCESS_KEY_ID"]
    assert env["TOKENMILL_OUTPUT_PREFIXES"] == f"s3://{BUCKET}/", env.get("TOKENMILL_OUTPUT_PREFIXES")
    outside = stack.client.submit(id="outside-0", prompt="escape", max_tokens=4, output="s3://other-bucket/x")
    [result] = stack.client.results([outside], timeout=60)
    assert result.error is not None and (result.error.code, result.error.field) == ("invalid_request", "output"), result
    stack.redis.delete(stack.client.app.backend.get_key_for_task(outside.id))  # not one of the exactly-once jobs
    log(f"Redis refuses a client without the password; the worker holds MinIO user {env['AWS_ACCESS_KEY_ID']} "
        f"(not root) and writes only under s3://{BUCKET}/ (s3://other-bucket/x refused: {result.error.code})")


def kill_mid_run(stack: Stack, tag: str, kill: Callable[[], None]) -> tuple[list, int]:
    handles = stack.submit(tag, 24, MID_RUN_TOKENS)
    started = [DELIVERIES_KEY.format(job_id=h.id) for h in handles]  # set when a job starts running on a worker
    # The worker holds 5 jobs at once (TOKENMILL_MAX_NUM_SEQS=4 + a quarter), so the 24 start in waves; a wave of
    # 2048-token jobs took ~20 s at a load average of 7-10 on 2 cores (all started after ~2 min): allow 5.
    wait_for("every job of the batch to start", lambda: stack.redis.exists(*started) == len(started), timeout=300,
             interval=0.1)
    done = stack.done(handles)
    assert done < len(handles), f"all {len(handles)} jobs finished before the kill: nothing was in flight"
    before = stack.restart_count()
    kill()
    log(f"killed the worker with {done}/{len(handles)} jobs of '{tag}' done")
    return handles, before


def step_process_kill(stack: Stack) -> None:
    def kill_main_process() -> None:
        pid = stack.state()["Pid"]
        subprocess.run(["kill", "-KILL", str(pid)], check=True)

    handles, before = kill_mid_run(stack, "crash", kill_main_process)
    wait_for("Docker's restart policy to restart the worker",
             lambda: stack.restart_count() > before and stack.state()["Running"], timeout=60)
    log(f"worker exited 137 and was restarted by its restart policy (RestartCount {before} -> {stack.restart_count()})")
    results = stack.results(handles, timeout=300)
    check_results(results, MID_RUN_TOKENS)
    retried = [r.id for r in results.values() if (r.attempt or 1) > 1]
    assert retried, "no job was redelivered: the kill did not hit a running job"
    log(f"all {len(handles)} jobs finished; {len(retried)} were redelivered after the crash")


def step_docker_kill(stack: Stack) -> None:
    container = stack.worker_id()
    handles, before = kill_mid_run(stack, "dkill", lambda: stack.sh(stack.args.docker, "kill", "-s", "KILL", container))
    deadline = time.monotonic() + 15  # Docker restarts within a second when it does; wait well beyond that
    while time.monotonic() < deadline and not (stack.state()["Running"] and stack.restart_count() > before):
        time.sleep(0.5)
    state = stack.state()
    if state["Running"] and stack.restart_count() > before:
        log("docker kill -s KILL: Docker applied the restart policy and restarted the worker")
    else:
        assert not state["Running"] and state["ExitCode"] == 137, state
        log("docker kill -s KILL: exit 137, and Docker did NOT restart the container within 15s: a kill through "
            "Docker's API counts as a deliberate stop, so the restart policy is not applied (Docker documents this "
            "for manual stops); starting it again with `compose start worker-cpu`")
        stack.sh(*shlex.split(stack.args.compose), "start", "worker-cpu")
    results = stack.results(handles, timeout=300)
    check_results(results, MID_RUN_TOKENS)
    log(f"all {len(handles)} jobs finished after the docker kill")


def step_exactly_once(stack: Stack) -> None:
    writes = stack.writes_so_far()
    wrong = {job_id: writes[job_id] for job_id in stack.submitted if writes[job_id] != 1}
    assert not wrong, f"jobs whose result was not written exactly once (id: writes): {wrong}"
    stored = sum(1 for _ in stack.redis.scan_iter("celery-task-meta-*"))
    assert stored == len(stack.submitted), f"{stored} stored results for {len(stack.submitted)} jobs"
    logs = subprocess.run([stack.args.docker, "logs", stack.worker_id()], capture_output=True, text=True, check=True)
    runs = collections.Counter(re.findall(r"job (\S+) succeeded", logs.stdout + logs.stderr))
    missing = [job_id for job_id in stack.submitted if runs[job_id] < 1]
    assert not missing, f"jobs with a result but no completed run in the worker's log: {missing}"
    repeated = sorted(job_id for job_id in stack.submitted if runs[job_id] > 1)
    log(f"exactly once: {len(stack.submitted)} jobs, each result written once and stored once; "
        f"{len(repeated)} generated again because a kill came after generation but before the result was stored "
        f"{repeated or ''}".rstrip())


def step_api(stack: Stack) -> None:
    import openai
    from openai import OpenAI

    client = OpenAI(base_url=stack.args.api, api_key=stack.args.api_key, max_retries=2)
    wait_for("the worker's model in GET /v1/models", lambda: "builtin:tiny" in [m.id for m in client.models.list()], 60)
    lines = [{"custom_id": f"api-{i}", "method": "POST", "url": "/v1/chat/completions",
              "body": {"model": "builtin:tiny", "messages": [{"role": "user", "content": f"Smoke prompt {i % 3}"}],
                       "max_tokens": 8, "temperature": 0}} for i in range(12)]
    lines.append({"custom_id": "unserved", "method": "POST", "url": "/v1/chat/completions",
                  "body": {"model": "no-such-model", "messages": [{"role": "user", "content": "hi"}]}})
    data = "".join(json.dumps(line) + "\n" for line in lines).encode()
    uploaded = client.files.create(file=("smoke.jsonl", data), purpose="batch")
    user, password = stack.args.s3_keys.split(":", 1)
    s3 = boto3.client("s3", endpoint_url=stack.args.s3, region_name="us-east-1",
                      aws_access_key_id=user, aws_secret_access_key=password)
    assert s3.get_object(Bucket="files", Key=uploaded.id)["Body"].read() == data, "the upload is not in the files bucket"
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="1h")
    done = wait_for("the batch to finish", lambda: (b := client.batches.retrieve(batch.id)).status in (
        "completed", "failed", "cancelled", "expired") and b, 300, interval=1)
    assert done.status == "completed", (done.status, done.errors)
    counts = done.request_counts
    assert (counts.total, counts.completed, counts.failed) == (13, 12, 1), counts
    output = [json.loads(line) for line in client.files.content(done.output_file_id).text.splitlines()]
    assert [line["custom_id"] for line in output] == [f"api-{i}" for i in range(12)]
    texts = [line["response"]["body"]["choices"][0]["message"]["content"] for line in output]
    assert all(texts[i] == texts[i % 3] for i in range(12)), "equal greedy prompts gave different completions"
    [error] = [json.loads(line) for line in client.files.content(done.error_file_id).text.splitlines()]
    assert error["custom_id"] == "unserved" and (error["response"] or {}).get("status_code") == 404, error
    assert error["response"]["body"]["error"]["code"] == "model_not_found", error
    try:
        OpenAI(base_url=stack.args.api, api_key="sk-wrong", max_retries=0).files.list()
        raise AssertionError("a wrong API key was accepted")
    except openai.AuthenticationError:
        pass
    log(f"api: batch {batch.id} of 13 lines through the openai SDK: 12 completed in input order, 1 model_not_found; "
        "files in the files bucket; a wrong key gets 401")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for name in ("docker", "compose", "broker", "s3", "s3-keys", "worker-s3-user", "metrics", "flower", "flower-auth",
                 "api", "api-key"):
        parser.add_argument(f"--{name}", required=True)
    stack = Stack(parser.parse_args())
    step_jobs_and_s3(stack)
    step_metrics(stack)
    step_flower(stack)
    step_credentials(stack)
    step_process_kill(stack)
    step_docker_kill(stack)
    step_exactly_once(stack)
    step_api(stack)  # after the exactly-once count, which counts every stored result as one of its jobs
    log("all checks passed")


if __name__ == "__main__":
    main()
