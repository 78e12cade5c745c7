"""S3 endpoint down while results are due: retried with backoff, jobs stay unacked (and are not
delivered again) until written, results land once S3 is back, the worker does not crash."""

from __future__ import annotations

import json
import time

from service_fixtures import S3_BUCKET, TEST_VISIBILITY_TIMEOUT, RedisServer, S3Server, wait_for

from tokenmill.client import Client
from tokenmill.queue.names import DELIVERIES_KEY


def test_results_land_once_s3_is_back(redis_server: RedisServer, s3_server: S3Server, start_worker) -> None:
    client = Client(redis_server.url)
    worker = start_worker(redis_server.url, s3_endpoint_url=s3_server.endpoint, s3_region="us-east-1",
                          s3_retry_max_delay=0.5, output_prefixes=f"s3://{S3_BUCKET}/").wait_ready()
    s3_server.stop()
    handles = client.submit_many([{"prompt": f"outage {i}", "max_tokens": 6, "output": f"s3://{S3_BUCKET}/out"} for i in range(10)])
    wait_for(lambda: worker.metrics().get("tokenmill_output_write_retries_total", 0) >= 20, 60, "failed S3 writes being retried")
    # The outage outlasts the visibility timeout twice over: lease renewal must keep the jobs from being redelivered.
    time.sleep(2 * TEST_VISIBILITY_TIMEOUT)
    broker = redis_server.client()
    assert all(client.get(h.id) is None for h in handles)
    assert broker.zcard("unacked_index") == 10 and broker.llen("tokenmill") == 0

    s3_server.start()
    results = client.results(handles, timeout=60)
    s3 = s3_server.client()
    for result in results:
        assert result.ok and result.output_uri == f"s3://{S3_BUCKET}/out/{result.id}.json"
        stored = json.loads(s3.get_object(Bucket=S3_BUCKET, Key=f"out/{result.id}.json")["Body"].read())
        assert stored["id"] == result.id and len(stored["token_ids"]) == 6
        assert int(broker.get(DELIVERIES_KEY.format(job_id=result.id))) == 1
    assert worker.process.poll() is None
    wait_for(lambda: broker.hlen("unacked") == 0, 10, "every message acked")
