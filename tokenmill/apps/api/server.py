"""`tokenmill serve`: the flags, the refusal to run without keys, and uvicorn.

Why FastAPI + uvicorn: FastAPI gives request parsing (multipart uploads through python-multipart, JSON
bodies through pydantic, which tokenmill already uses for its wire format) and one place to turn every error
into OpenAI's shape; uvicorn is the standard ASGI server for it. Both are widely used and maintained.
"""

from __future__ import annotations

import argparse
import ipaddress
import logging
import sys
from typing import Any

EXIT_UNUSABLE = 2


#: The settings `tokenmill serve` takes as flags too (the others, the webhook secret among them, as variables only).
FLAGS = ("broker_url", "result_backend", "queue", "files_dir", "s3_endpoint_url", "api_keys", "api_keys_file",
         "max_upload_bytes", "max_batch_lines", "lease_seconds", "default_max_tokens", "max_completion_window",
         "rate_limit", "rate_burst", "max_drivers", "max_active_batches", "max_batch_records", "max_queued_jobs",
         "max_queued_prompt_bytes", "max_stored_files", "max_stored_bytes", "file_expires", "batch_expires",
         "openapi_schema", "webhook_url", "webhook_timeout", "embeddings_timeout", "max_embedding_requests",
         "request_threads", "redis_connections", "max_publishers", "max_http_connections", "request_head_timeout",
         "min_body_rate", "max_tenant_requests", "max_tenant_uploads")


def add_parser(commands: Any) -> None:
    """`serve`'s flags: each setting of `FLAGS` with the description and default `ServeSettings` gives it."""
    from tokenmill.apps.api.settings import ServeSettings
    from tokenmill.queue.settings import add_settings_flags

    serve = commands.add_parser("serve", help="the OpenAI Files and Batches API on the queue (HTTP)")
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this host only)")
    serve.add_argument("--port", type=int, default=8000, help="port to listen on")
    add_settings_flags(serve, ServeSettings, FLAGS, aliases={"broker_url": ["--broker"]})
    serve.add_argument("--insecure-no-auth", action="store_true",
                       help="serve without API keys (anyone who reaches the port is one tenant); loopback hosts only")
    serve.add_argument("--log-level", default="info", help="uvicorn's and tokenmill's log level")


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name other than localhost: it may resolve anywhere
        return False


def run(args: argparse.Namespace) -> int:
    from pydantic import ValidationError

    from tokenmill.apps.api.auth import Keys
    from tokenmill.apps.api.settings import ServeSettings
    from tokenmill.queue.settings import setting_problems

    try:
        settings = ServeSettings(**{n: getattr(args, n) for n in FLAGS if getattr(args, n) is not None})
        keys = Keys(settings, insecure=args.insecure_no_auth)
    except ValidationError as exc:
        for problem in setting_problems(exc):
            print(f"tokenmill serve: {problem}", file=sys.stderr)
        return EXIT_UNUSABLE
    except (ValueError, OSError) as exc:
        print(f"tokenmill serve: {exc}", file=sys.stderr)
        return EXIT_UNUSABLE
    if args.insecure_no_auth and not _loopback(args.host):
        print(f"tokenmill serve: --insecure-no-auth serves only this host: --host {args.host} would let anyone who "
              "reaches it in; give keys (TOKENMILL_API_KEYS_FILE), or --host 127.0.0.1", file=sys.stderr)
        return EXIT_UNUSABLE
    if args.api_keys:
        print("tokenmill serve: warning: keys given with --api-keys are visible to every user of this host in `ps`; "
              "prefer TOKENMILL_API_KEYS_FILE or TOKENMILL_API_KEYS", file=sys.stderr)
    if not keys and not args.insecure_no_auth:
        print("tokenmill serve: no API key configured (TOKENMILL_API_KEYS, TOKENMILL_API_KEYS_FILE or --api-keys); "
              "refusing to serve without auth unless --insecure-no-auth", file=sys.stderr)
        return EXIT_UNUSABLE
    import uvicorn

    from tokenmill.apps.api.app import create_app
    from tokenmill.apps.api.connections import uvicorn_options
    from tokenmill.apps.api.resources import raise_open_files_limit

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    raise_open_files_limit(settings)  # before anything opens a descriptor
    # a deadline for each request head (`connections`); what a request may take is the app's `guard`
    uvicorn.run(create_app(settings, keys), host=args.host, port=args.port, log_level=args.log_level,
                **uvicorn_options(settings))
    return 0
