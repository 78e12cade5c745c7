"""Send jobs whose results are written to MinIO (or any S3 store), then read them back with boto3.

    python examples/results_to_minio.py [--broker redis://localhost:6379/0] [--jobs 20] [--bucket results]
        [--s3-endpoint http://127.0.0.1:9000]

With the compose stack: the worker writes s3://<bucket>/<run>/<id>.json to MinIO (the `minio-init`
service created the bucket); Redis keeps only a stub holding `output_uri`. Credentials are boto3's usual
ones, else `MINIO_ROOT_USER` / `MINIO_ROOT_PASSWORD` from the environment (the values in your .env; the
workers' own MinIO user may only write). The broker URL carries the Redis password:
`TOKENMILL_BROKER_URL=redis://:$REDIS_PASSWORD@127.0.0.1:6379/0`. Exits 1 if a result is missing or failed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import boto3

from tokenmill import Client


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--broker", default=None, help="Redis URL (default: $TOKENMILL_BROKER_URL)")
    parser.add_argument("--jobs", type=int, default=20)
    parser.add_argument("--bucket", default="results")
    parser.add_argument("--s3-endpoint", default=os.environ.get("S3_ENDPOINT_URL", "http://127.0.0.1:9000"))
    parser.add_argument("--timeout", type=float, default=600)
    args = parser.parse_args()

    run = f"run-{time.strftime('%Y%m%d-%H%M%S')}"
    output = f"s3://{args.bucket}/{run}"
    client = Client(args.broker)
    handles = client.submit_many(
        {"id": f"{run}-{i}", "prompt": f"Write one sentence about the number {i}.", "max_tokens": 32, "output": output}
        for i in range(args.jobs)
    )
    print(f"submitted {len(handles)} jobs writing to {output}/")
    stubs = {result.id: result for result in client.as_completed(handles, timeout=args.timeout)}
    failed = [r.id for r in stubs.values() if not r.ok]
    if failed:
        print(f"failed jobs: {failed}", file=sys.stderr)
        return 1

    s3 = boto3.client(
        "s3",
        endpoint_url=args.s3_endpoint,
        aws_access_key_id=os.environ.get("AWS_ACCESS_KEY_ID", os.environ.get("MINIO_ROOT_USER")),
        aws_secret_access_key=os.environ.get("AWS_SECRET_ACCESS_KEY", os.environ.get("MINIO_ROOT_PASSWORD")),
        region_name=os.environ.get("AWS_DEFAULT_REGION", "us-east-1"),
    )
    listed = s3.list_objects_v2(Bucket=args.bucket, Prefix=f"{run}/").get("KeyCount", 0)
    print(f"{listed} objects under s3://{args.bucket}/{run}/")
    for stub in list(stubs.values())[:3]:
        key = stub.output_uri.removeprefix(f"s3://{args.bucket}/")
        body = json.loads(s3.get_object(Bucket=args.bucket, Key=key)["Body"].read())
        print(f"{stub.output_uri}: {body['usage']['completion_tokens']} tokens: {body['text']!r}")
    return 0 if listed == len(handles) else 1


if __name__ == "__main__":
    sys.exit(main())
