"""Fixtures of the service tests; they live in `service_fixtures` so test modules can import its helpers."""

from service_fixtures import _aws_env, redis_server, result_log, s3_server, start_worker  # noqa: F401
