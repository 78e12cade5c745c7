"""`JobResult.read()`: a job with an S3 output, run by a real worker, read back through the client from a real
S3 server (moto), and the errors when the object cannot be read or is not the job's."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from botocore.exceptions import ClientError
from service_fixtures import REPO, S3_BUCKET, RedisServer, S3Server, free_port

from tokenmill.client import Client
from tokenmill.queue.result_objects import ResultReadError
from tokenmill.queue.schemas import JobResult

PREFIX = "runs/read"


@pytest.fixture
def stub(redis_server: RedisServer, s3_server: S3Server, start_worker) -> JobResult:
    """The result in Redis of a job a real worker ran with its output in S3."""
    start_worker(redis_server.url, s3_endpoint_url=s3_server.endpoint, s3_region="us-east-1",
                 output_prefixes=f"s3://{S3_BUCKET}/").wait_ready()
    with Client(redis_server.url) as client:
        job = client.submit(prompt="read me back", max_tokens=8, temperature=0.0, output=f"s3://{S3_BUCKET}/{PREFIX}")
        return job.result(timeout=60)


def _stored(s3_server: S3Server, job_id: str) -> dict:
    return json.loads(s3_server.client().get_object(Bucket=S3_BUCKET, Key=f"{PREFIX}/{job_id}.json")["Body"].read())


def test_read_returns_what_the_worker_wrote(stub: JobResult, s3_server: S3Server,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    assert stub.ok and stub.text is None and stub.token_ids is None
    assert stub.output_uri == f"s3://{S3_BUCKET}/{PREFIX}/{stub.id}.json"
    stored = _stored(s3_server, stub.id)

    full = stub.read(endpoint_url=s3_server.endpoint)
    assert full.text == stored["text"] and full.token_ids == stored["token_ids"]
    assert len(full.token_ids) == full.usage.completion_tokens > 0
    assert full.to_wire() == {**stored, "output_uri": stub.output_uri}
    assert full.read() is full  # the text is here now: nothing more to fetch

    monkeypatch.setenv("TOKENMILL_S3_ENDPOINT_URL", s3_server.endpoint)  # the worker's setting, read by default
    assert stub.read() == full


def test_read_errors_name_the_uri_and_the_cause(stub: JobResult, s3_server: S3Server) -> None:
    s3 = s3_server.client()
    key = f"{PREFIX}/{stub.id}.json"
    s3.delete_object(Bucket=S3_BUCKET, Key=key)
    with pytest.raises(ResultReadError) as gone:
        stub.read(endpoint_url=s3_server.endpoint)
    assert str(gone.value) == f"cannot read {stub.output_uri}: NoSuchKey: The specified key does not exist."
    assert gone.value.uri == stub.output_uri and isinstance(gone.value.__cause__, ClientError)

    with pytest.raises(ResultReadError, match=rf"^cannot read {stub.output_uri}: EndpointConnectionError: .*$"):
        stub.read(endpoint_url=f"http://127.0.0.1:{free_port()}")

    other = JobResult(id="someone-else", status="succeeded", text="not yours").to_wire()
    s3.put_object(Bucket=S3_BUCKET, Key=key, Body=json.dumps(other).encode())
    with pytest.raises(ResultReadError, match=r"holds the result of another job \(someone-else"):
        stub.read(endpoint_url=s3_server.endpoint)

    s3.put_object(Bucket=S3_BUCKET, Key=key, Body=b"<html>not json</html>")
    with pytest.raises(ResultReadError, match=r"^cannot read s3://.*: not a job result: Invalid JSON"):
        stub.read(endpoint_url=s3_server.endpoint)


def test_an_inline_result_is_its_own_full_result() -> None:
    result = JobResult(id="inline", status="succeeded", text="here")
    assert result.read() is result


def test_reading_without_boto3_names_the_install() -> None:
    code = (
        "import sys\n"
        "sys.modules['boto3'] = None\n"
        "from tokenmill.queue.schemas import JobResult\n"
        "try:\n"
        "    JobResult(id='a', status='succeeded', output_uri='s3://results/a.json').read()\n"
        "except ImportError as exc:\n"
        "    print(exc)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "pip install boto3" in done.stdout and "pip install 'tokenmill[worker]'" in done.stdout
