"""Compose's S3 users reach their own bucket only: the policies docker-compose.yml's `minio-init` writes, enforced
by a real S3 server with access control on, under a real worker (results bucket, put only) and a real
`tokenmill serve` (files bucket: get, put, delete).

MinIO cannot run here (its image cannot be pulled and Debian does not package it), so the server is moto's,
started with `INITIAL_NO_AUTH_ACTION_COUNT`: past that many set-up calls, every request must be signed by an
IAM user it knows and is allowed only what that user's policies allow, in the same policy language MinIO uses.
It runs through `moto_iam_server.py`, which authorizes each request by the IAM action AWS documents for it (moto
5.2.6 asks for `s3:CreateMultipartUpload`, which is no IAM action: see that file).
The policy documents are produced by running the compose file's own `printf` lines. What this does not run are
the `mc admin` commands that load the policies into MinIO and attach them to the users.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import boto3
import pytest
import yaml
from botocore.exceptions import ClientError
from service_fixtures import REPO, RedisServer, free_port, wait_for
from test_serve import chat_line, serve, wait_status  # noqa: F401 (serve: the fixture)

from tokenmill.client import Client

RESULTS_BUCKET = "results"
FILES_BUCKET = "files"
OTHER_BUCKET = "prod-config"
MOTO_IAM_SERVER = Path(__file__).with_name("moto_iam_server.py")
#: The unauthenticated calls of `_set_up`: three buckets; three users, one inline policy and one access key each.
SET_UP_CALLS = 12


def compose_policy(bucket_variable: str, policy: str, user_variable: str, bucket: str) -> str:
    """The policy document `minio-init` writes for the bucket in `$bucket_variable`, by running its own printf
    line in a shell; checks that the script loads it as `policy` and attaches it to the user in `$user_variable`."""
    compose = yaml.safe_load((REPO / "docker-compose.yml").read_text())
    script = compose["services"]["minio-init"]["command"][0].replace("$$", "$")  # compose's escaping of `$`
    match = re.search(rf"printf '[^']*'\s*\\?\s*\"\${bucket_variable}\"\s*>\s*(\S+)", script)
    assert match, f"minio-init no longer writes the {policy} policy with printf"
    assert f"mc admin policy create local {policy} {match.group(1)}" in script
    assert f'mc admin policy attach local {policy} --user "${user_variable}"' in script
    printf = match.group(0)[: match.group(0).rindex(">")]
    return subprocess.run(["sh", "-c", printf], env={bucket_variable: bucket, "PATH": os.environ["PATH"]},
                          check=True, capture_output=True, text=True).stdout


@dataclass
class Keys:
    access_key: str
    secret_key: str

    def s3(self, endpoint: str) -> object:
        return boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1",
                            aws_access_key_id=self.access_key, aws_secret_access_key=self.secret_key)


@dataclass
class EnforcingS3:
    endpoint: str
    worker: Keys
    api: Keys
    admin: Keys


def _set_up(endpoint: str) -> EnforcingS3:
    """The buckets and users `minio-init` makes, with the policies it writes, plus an admin for the test's reads."""
    unsigned = {"endpoint_url": endpoint, "region_name": "us-east-1", "aws_access_key_id": "setup",
                "aws_secret_access_key": "setup"}
    s3, iam = boto3.client("s3", **unsigned), boto3.client("iam", **unsigned)
    for bucket in (RESULTS_BUCKET, FILES_BUCKET, OTHER_BUCKET):
        s3.create_bucket(Bucket=bucket)
    policies = {
        "worker": compose_policy("RESULTS_BUCKET", "tokenmill-results", "MINIO_WORKER_USER", RESULTS_BUCKET),
        "api": compose_policy("FILES_BUCKET", "tokenmill-files", "MINIO_API_USER", FILES_BUCKET),
        "admin": '{"Version":"2012-10-17","Statement":[{"Effect":"Allow","Action":["s3:*"],"Resource":["*"]}]}',
    }
    keys = {}
    for user, policy in policies.items():
        iam.create_user(UserName=user)
        iam.put_user_policy(UserName=user, PolicyName="policy", PolicyDocument=policy)
        key = iam.create_access_key(UserName=user)["AccessKey"]
        keys[user] = Keys(key["AccessKeyId"], key["SecretAccessKey"])
    return EnforcingS3(endpoint, **keys)


@pytest.fixture
def enforcing_s3(tmp_path: Path) -> Iterator[EnforcingS3]:
    port = free_port()
    env = dict(os.environ, INITIAL_NO_AUTH_ACTION_COUNT=str(SET_UP_CALLS))
    with open(tmp_path / "moto.log", "wb") as log:
        server = subprocess.Popen([sys.executable, str(MOTO_IAM_SERVER), "-H", "127.0.0.1", "-p", str(port)],
                                  env=env, stdout=log, stderr=subprocess.STDOUT)
    endpoint = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: _answers(endpoint), 30, "moto server")
        yield _set_up(endpoint)
    finally:
        server.kill()
        server.wait(timeout=10)


def _answers(endpoint: str) -> bool:
    try:
        urllib.request.urlopen(f"{endpoint}/moto-api/", timeout=2)  # moto's dashboard: not an S3 action
        return True
    except OSError:
        return False


def _keys_in(s3: EnforcingS3, bucket: str) -> list[str]:
    return [o["Key"] for o in s3.admin.s3(s3.endpoint).list_objects_v2(Bucket=bucket).get("Contents", [])]


def _worker_env(keys: Keys) -> dict[str, str]:
    return {"AWS_ACCESS_KEY_ID": keys.access_key, "AWS_SECRET_ACCESS_KEY": keys.secret_key}


def test_the_compose_policy_lets_workers_put_results_and_nothing_else(enforcing_s3: EnforcingS3,
                                                                       redis_server: RedisServer, start_worker) -> None:
    s3 = enforcing_s3
    worker_s3 = s3.worker.s3(s3.endpoint)
    with pytest.raises(ClientError, match="InvalidAccessKeyId"):  # the server checks credentials at all
        boto3.client("s3", endpoint_url=s3.endpoint, region_name="us-east-1", aws_access_key_id="testing",
                     aws_secret_access_key="testing").list_objects_v2(Bucket=RESULTS_BUCKET)
    for call in (lambda: worker_s3.get_object(Bucket=RESULTS_BUCKET, Key="x"),
                 lambda: worker_s3.list_objects_v2(Bucket=RESULTS_BUCKET),
                 lambda: worker_s3.delete_object(Bucket=RESULTS_BUCKET, Key="x"),
                 lambda: worker_s3.put_object(Bucket=OTHER_BUCKET, Key="app/settings.json", Body=b"{}"),
                 lambda: worker_s3.put_object(Bucket=FILES_BUCKET, Key="file-x", Body=b"{}")):
        with pytest.raises(ClientError, match="AccessDenied"):
            call()

    # A worker misconfigured to allow both buckets: the store's policy is the second wall.
    start_worker(redis_server.url, "policy", s3_endpoint_url=s3.endpoint, s3_region="us-east-1",
                 output_prefixes=f"s3://{RESULTS_BUCKET}/,s3://{OTHER_BUCKET}/",
                 extra_env=_worker_env(s3.worker)).wait_ready()
    with Client(redis_server.url) as client:
        handles = [client.submit(prompt="hi", max_tokens=3, output=f"s3://{RESULTS_BUCKET}/run1", id="row-1"),
                   client.submit(prompt="hi", max_tokens=3, output=f"s3://{OTHER_BUCKET}/app", id="settings")]
        stored, refused = client.results(handles, timeout=120)
    assert stored.ok and stored.output_uri == f"s3://{RESULTS_BUCKET}/run1/row-1.json"
    assert _keys_in(s3, RESULTS_BUCKET) == ["run1/row-1.json"]
    assert refused.error.code == "output_write_failed" and "AccessDenied" in refused.error.message
    assert len(refused.token_ids) == 3  # the generated text is kept in Redis though S3 refused it
    assert _keys_in(s3, OTHER_BUCKET) == []


def test_the_compose_policy_lets_the_api_keep_files_and_nothing_else(enforcing_s3: EnforcingS3, tmp_path: Path,
                                                                      redis_server: RedisServer, start_worker,
                                                                      serve) -> None:  # noqa: F811 (the fixture)
    """`tokenmill serve` with the api user's keys keeps a batch's files in the files bucket (upload, output,
    download, delete: every S3 call it makes), and those keys reach no other bucket."""
    s3 = enforcing_s3
    api_s3 = s3.api.s3(s3.endpoint)
    for call in (lambda: api_s3.put_object(Bucket=RESULTS_BUCKET, Key="r.json", Body=b"{}"),
                 lambda: api_s3.get_object(Bucket=RESULTS_BUCKET, Key="r.json"),
                 lambda: api_s3.list_objects_v2(Bucket=FILES_BUCKET)):
        with pytest.raises(ClientError, match="AccessDenied"):
            call()
    # boto3 uploads a file over 8 MiB in parts, and aborts them when the upload fails. AWS authorizes creating,
    # uploading and completing parts as `s3:PutObject` and the abort as `s3:AbortMultipartUpload`.
    upload = api_s3.create_multipart_upload(Bucket=FILES_BUCKET, Key="whole")["UploadId"]
    part = api_s3.upload_part(Bucket=FILES_BUCKET, Key="whole", UploadId=upload, PartNumber=1, Body=b"{}")
    api_s3.complete_multipart_upload(Bucket=FILES_BUCKET, Key="whole", UploadId=upload,
                                     MultipartUpload={"Parts": [{"ETag": part["ETag"], "PartNumber": 1}]})
    api_s3.delete_object(Bucket=FILES_BUCKET, Key="whole")
    upload = api_s3.create_multipart_upload(Bucket=FILES_BUCKET, Key="partial")["UploadId"]
    api_s3.abort_multipart_upload(Bucket=FILES_BUCKET, Key="partial", UploadId=upload)
    with pytest.raises(ClientError, match="AccessDenied"):  # and in no other bucket
        api_s3.create_multipart_upload(Bucket=RESULTS_BUCKET, Key="partial")
    start_worker(redis_server.url, "api-policy", extra_env=_worker_env(s3.worker)).wait_ready()
    server = serve(redis_server.url, env={**_worker_env(s3.api), "AWS_DEFAULT_REGION": "us-east-1"},
                   **{"files-dir": f"s3://{FILES_BUCKET}/", "s3-endpoint-url": s3.endpoint})
    client = server.client()
    requests = tmp_path / "in.jsonl"
    requests.write_text("".join(json.dumps(chat_line(f"r{i}", f"hi {i}")) + "\n" for i in range(3)))
    file_id = client.files.create(file=requests.open("rb"), purpose="batch").id
    batch = client.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h")
    done = wait_status(client, batch.id, ("completed", "failed", "cancelled", "expired"), 120)
    assert done.status == "completed" and done.request_counts.completed == 3, done
    output = [json.loads(line) for line in client.files.content(done.output_file_id).text.splitlines()]
    assert [line["custom_id"] for line in output] == ["r0", "r1", "r2"]
    assert sorted(_keys_in(s3, FILES_BUCKET)) == sorted([file_id, done.output_file_id])
    client.files.delete(file_id)
    assert _keys_in(s3, FILES_BUCKET) == [done.output_file_id]
    assert _keys_in(s3, RESULTS_BUCKET) == [] and _keys_in(s3, OTHER_BUCKET) == []
