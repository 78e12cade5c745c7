"""Fixtures of the service tests; they live in `service_fixtures` so test modules can import its helpers."""

from service_fixtures import (  # noqa: F401
    _aws_env,
    plain_listener,
    redis_server,
    result_log,
    s3_server,
    start_server,
    start_worker,
    tls_redis_server,
)
