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


#: The settings `tokenmill serve` takes as flags too (the others, the webhook secret among them, as variables only).
FLAGS = ("broker_url", "result_backend", "queue", "files_dir", "s3_endpoint_url", "api_keys", "api_keys_file",
         "max_upload_bytes", "max_batch_lines", "lease_seconds", "default_max_tokens", "webhook_url", "webhook_timeout")


def add_parser(commands: Any) -> None:
    """`serve`'s flags: each setting of `FLAGS` with the description and default `ServeSettings` gives it."""
    from tokenmill.apps.api.settings import ServeSettings
    from tokenmill.queue.settings import flag_type

    serve = commands.add_parser("serve", help="the OpenAI Files and Batches API on the queue (HTTP)")
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this host only)")
    serve.add_argument("--port", type=int, default=8000, help="port to listen on")
    for name in FLAGS:
        info = ServeSettings.model_fields[name]
        flags = [f"--{name.replace('_', '-')}", *(["--broker"] if name == "broker_url" else [])]
        default = f" (default: {info.default})" if info.default is not None else ""
        serve.add_argument(*flags, dest=name, type=flag_type(info.annotation)[0], default=None,
                           help=f"{info.description}{default} [env TOKENMILL_{name.upper()}]".replace("%", "%%"))
    serve.add_argument("--insecure-no-auth", action="store_true",
                       help="serve without API keys (anyone who reaches the port is one tenant)")
    serve.add_argument("--log-level", default="info", help="uvicorn's and tokenmill's log level")


def run(args: argparse.Namespace) -> int:
    from pydantic import ValidationError

    from tokenmill.apps.api.auth import Keys
    from tokenmill.apps.api.settings import ServeSettings

    try:
        settings = ServeSettings(**{n: getattr(args, n) for n in FLAGS if getattr(args, n) is not None})
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
