"""The `tokenmill annotate` and `tokenmill batch` subcommands (argparse only here; the work is imported on use).

Exit status: 0 when every row succeeded, 1 when some rows failed (their errors are in the output and the
summary), 2 when the run could not start (bad option, bad template, unreadable input, duplicate custom_id).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

EXIT_ROWS_FAILED = 1
EXIT_UNUSABLE = 2
EXIT_INTERRUPTED = 130  # as a shell reports SIGINT
_ENGINE_FLAGS = {"dtype": str, "max_num_seqs": int, "max_num_batched_tokens": int, "max_model_len": int,
                 "num_kv_blocks": int, "block_size": int, "attention_backend": str}


def add_parsers(commands: Any) -> None:
    ann = commands.add_parser("annotate", help="run one prompt template over a JSONL/CSV/Parquet dataset")
    ann.add_argument("input", help="file, directory, glob of shards or s3:// URI (JSONL, CSV or Parquet)")
    ann.add_argument("-o", "--output", required=True, help="output path or s3:// URI (.jsonl or .parquet)")
    ann.add_argument("--template", required=True, metavar="TEXT|FILE",
                     help="Jinja2 template over the row's columns, e.g. 'Classify: {{ text }}', or a file holding one")
    ann.add_argument("--system", help="system prompt (also a template)")
    ann.add_argument("--chat", action="store_true", help="system + template as chat messages, with the model's chat template")
    ann.add_argument("--json-schema", help="JSON schema (a file or inline JSON): structured output, parsed into 'parsed'")
    ann.add_argument("--choice", help="comma-separated choices the output must be one of")
    ann.add_argument("--regex", help="regular expression the output must match")
    ann.add_argument("--id-column", help="column naming each row (default: its position)")
    ann.add_argument("--column", default="annotation", help="name of the completion text column (default: annotation)")
    ann.add_argument("--input-format", choices=["jsonl", "csv", "parquet"], help="override the input extension")
    ann.add_argument("--output-format", choices=["jsonl", "parquet"], help="override the output extension")
    ann.add_argument("--max-tokens", type=int, default=64)
    ann.add_argument("--temperature", type=float, default=0.0)
    ann.add_argument("--top-p", type=float, default=None)
    ann.add_argument("--top-k", type=int, default=None)
    ann.add_argument("--seed", type=int, default=None)
    ann.add_argument("--stop", action="append", default=None, help="stop string; repeat for more")
    _common(ann)
    bat = commands.add_parser("batch", help="run an OpenAI Batch API input file")
    bat.add_argument("-i", "--input", required=True, help="requests JSONL (local or s3://)")
    bat.add_argument("-o", "--output", required=True, help="results JSONL (local or s3://)")
    bat.add_argument("--errors", help="failed requests JSONL (default: <output>.errors.jsonl)")
    bat.add_argument("--max-tokens", type=int, default=256, help="for requests that set neither max_tokens nor max_completion_tokens")
    _common(bat)


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", help="model for the embedded engine (default builtin:tiny)")
    parser.add_argument("--broker", help="redis://... : distributed mode, rows go to queue workers")
    parser.add_argument("--queue", help="queue name (default tokenmill)")
    parser.add_argument("--state-dir", help="checkpoint directory (default: <output>.tokenmill-state)")
    parser.add_argument("--checkpoint-interval", type=float, default=2.0, metavar="SECONDS",
                        help="commit finished rows to the checkpoint at least this often (0: after every row)")
    parser.add_argument("--retry-failed", action="store_true", help="recompute rows that ended in error")
    parser.add_argument("--retry-cancelled", action="store_true",
                        help="recompute rows cancelled with `tokenmill cancel` (a Ctrl-C's rows are recomputed anyway)")
    parser.add_argument("--detach", action="store_true",
                        help="distributed: on Ctrl-C leave the queued rows running (default: cancel them)")
    parser.add_argument("--s3-endpoint-url", default=None, help="S3-compatible endpoint (MinIO...) [env TOKENMILL_S3_ENDPOINT_URL]")
    parser.add_argument("--window", type=int, help="rows in flight at most (default 1024 embedded, 4096 distributed)")
    parser.add_argument("--rows-per-message", type=int, default=32, help="rows per queue message (distributed)")
    parser.add_argument("--max-row-bytes", type=int, default=1 << 20, metavar="BYTES",
                        help="a row or line longer than this (decompressed) is not read: it fails alone (default 1 MiB)")
    parser.add_argument("--input-compression", choices=["none", "gzip", "bz2", "zstd", "lz4"],
                        help="decompress the JSONL/CSV input with this codec (default: by suffix, .gz .bz2 .zst .lz4)")
    parser.add_argument("--quiet", action="store_true", help="no progress bar, no summary table")
    for name, kind in _ENGINE_FLAGS.items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=kind, default=None, help="engine option (embedded)")
    parser.add_argument("--no-prefix-caching", action="store_true", help="engine option (embedded)")


def run(args: argparse.Namespace) -> int:
    from tokenmill.apps.datasets import DatasetError
    from tokenmill.errors import InvalidRequestError, ModelLoadError

    import redis
    from kombu.exceptions import OperationalError
    from kombu.utils.url import maybe_sanitize_url

    try:
        summary = _annotate(args) if args.command == "annotate" else _batch(args)
    except (InvalidRequestError, DatasetError, ModelLoadError) as exc:
        print(f"tokenmill {args.command}: {exc}", file=sys.stderr)
        return EXIT_UNUSABLE
    except (redis.ConnectionError, redis.AuthenticationError, OperationalError) as exc:
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        print(f"tokenmill {args.command}: cannot use the broker {maybe_sanitize_url(args.broker)}: {reason} (start "
              "Redis there, or fix --broker and its password)", file=sys.stderr)
        return EXIT_UNUSABLE
    except KeyboardInterrupt:
        print(f"tokenmill {args.command}: interrupted; the checkpoint keeps every finished row: run the same command "
              "to finish", file=sys.stderr)
        return EXIT_INTERRUPTED
    return EXIT_ROWS_FAILED if summary.failed else 0


def _shared(args: argparse.Namespace) -> dict[str, Any]:
    options = {name: getattr(args, name) for name in _ENGINE_FLAGS if getattr(args, name) is not None}
    if args.no_prefix_caching:
        options["enable_prefix_caching"] = False
    return {"model": args.model, "broker": args.broker, "queue": args.queue, "engine_options": options,
            "state_dir": args.state_dir, "checkpoint_interval": args.checkpoint_interval,
            "retry_failed": args.retry_failed, "retry_cancelled": args.retry_cancelled, "detach": args.detach,
            "s3_endpoint_url": args.s3_endpoint_url,
            "window": args.window, "rows_per_message": args.rows_per_message, "max_row_bytes": args.max_row_bytes,
            "input_compression": args.input_compression, "quiet": args.quiet}


def _annotate(args: argparse.Namespace) -> Any:
    from tokenmill.apps.annotate import annotate
    from tokenmill.errors import InvalidRequestError

    sampling = {name: getattr(args, name) for name in ("top_p", "top_k", "seed", "stop") if getattr(args, name) is not None}
    schema = None
    if args.json_schema:
        text = text_or_file(args.json_schema)
        try:
            schema = json.loads(text)
        except RecursionError:
            raise InvalidRequestError("json_schema", "nests too deeply to parse") from None
        except ValueError as exc:
            raise InvalidRequestError("json_schema", f"not a JSON file or inline JSON: {exc}") from None
    return annotate(
        args.input, args.output, text_or_file(args.template), system=args.system, chat=args.chat, json_schema=schema,
        choice=[c.strip() for c in args.choice.split(",")] if args.choice else None, regex=args.regex,
        id_column=args.id_column, column=args.column, input_format=args.input_format, output_format=args.output_format,
        max_tokens=args.max_tokens, temperature=args.temperature, **sampling, **_shared(args),
    )


def text_or_file(value: str) -> str:
    """`value` itself, or the text of the file it names (as `--json-schema` takes FILE|JSON, here and in
    `tokenmill generate`)."""
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as file:
            return file.read()
    return value


def _batch(args: argparse.Namespace) -> Any:
    from tokenmill.apps.batch import batch

    return batch(args.input, args.output, errors=args.errors, default_max_tokens=args.max_tokens, **_shared(args))
