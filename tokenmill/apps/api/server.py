"""`tokenmill serve`: the flags, the refusal to run without keys, and uvicorn.

Why FastAPI + uvicorn: FastAPI gives request parsing (multipart uploads through python-multipart, JSON
bodies through pydantic, which tokenmill already uses for its wire format) and one place to turn every error
into OpenAI's shape; uvicorn is the standard ASGI server for it. Both are widely used and maintained.
"""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Any

EXIT_UNUSABLE = 2


def add_parser(commands: Any) -> None:
    serve = commands.add_parser("serve", help="the OpenAI Files and Batches API on the queue (HTTP)")
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this host only)")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--broker", dest="broker_url", help="Redis URL [env TOKENMILL_BROKER_URL]")
    serve.add_argument("--result-backend", help="Redis URL of results, if not the broker [env TOKENMILL_RESULT_BACKEND]")
    serve.add_argument("--queue", help="queue the jobs go to [env TOKENMILL_QUEUE]")
    serve.add_argument("--files-dir", help="where files are kept: a directory or s3://bucket/prefix "
                       "[env TOKENMILL_FILES_DIR]")
    serve.add_argument("--s3-endpoint-url", help="S3 endpoint of an s3:// files store, e.g. MinIO's "
                       "[env TOKENMILL_S3_ENDPOINT_URL]")
    serve.add_argument("--api-keys", help="comma-separated tenant=key or keys [env TOKENMILL_API_KEYS]")
    serve.add_argument("--api-keys-file", help="file of 'tenant sha256:<hex>' lines [env TOKENMILL_API_KEYS_FILE]")
    serve.add_argument("--max-upload-bytes", type=int, help="[env TOKENMILL_MAX_UPLOAD_BYTES]")
    serve.add_argument("--max-batch-lines", type=int, help="[env TOKENMILL_MAX_BATCH_LINES]")
    serve.add_argument("--lease-seconds", type=float, help="[env TOKENMILL_LEASE_SECONDS]")
    serve.add_argument("--webhook-url", help="where batch events are POSTed [env TOKENMILL_WEBHOOK_URL; the secret: "
                       "env TOKENMILL_WEBHOOK_SECRET]")
    serve.add_argument("--webhook-timeout", type=float, help="[env TOKENMILL_WEBHOOK_TIMEOUT]")
    serve.add_argument("--insecure-no-auth", action="store_true",
                       help="serve without API keys (anyone who reaches the port is one tenant)")
    serve.add_argument("--log-level", default="info")


def run(args: argparse.Namespace) -> int:
    from pydantic import ValidationError

    from tokenmill.apps.api.auth import Keys
    from tokenmill.apps.api.settings import ServeSettings

    names = ("broker_url", "result_backend", "queue", "files_dir", "s3_endpoint_url", "api_keys", "api_keys_file",
             "max_upload_bytes", "max_batch_lines", "lease_seconds", "webhook_url", "webhook_timeout")
    try:
        settings = ServeSettings(**{n: getattr(args, n) for n in names if getattr(args, n) is not None})
        keys = Keys(settings, insecure=args.insecure_no_auth)
    except (ValidationError, ValueError, OSError) as exc:
        print(f"tokenmill serve: {exc}", file=sys.stderr)
        return EXIT_UNUSABLE
    if not keys and not args.insecure_no_auth:
        print("tokenmill serve: no API key configured (TOKENMILL_API_KEYS, TOKENMILL_API_KEYS_FILE or --api-keys); "
              "refusing to serve without auth unless --insecure-no-auth", file=sys.stderr)
        return EXIT_UNUSABLE
    import uvicorn

    from tokenmill.apps.api.app import create_app

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    uvicorn.run(create_app(settings, keys), host=args.host, port=args.port, log_level=args.log_level)
    return 0
