"""The `tokenmill` command.

    tokenmill generate [--model builtin:tiny] [--prompt TEXT ...] [--input prompts.jsonl] [--max-tokens N]
    tokenmill worker --model M --broker redis://... [--queues a,b] [--concurrency N] [...]
    tokenmill health [--url http://127.0.0.1:9400/metrics] [--max-age 60]

`generate` runs prompts offline through `tokenmill.LLM` and prints one JSON line per completion; with no
arguments it completes a few demo prompts on the built-in tiny model (the README's quick start).
`worker` flags are generated from `WorkerSettings`, so each has a `TOKENMILL_<NAME>` environment
variable twin; a flag wins over the variable. `health` exits 0 only while a worker's engine is serving
(the Docker healthcheck; `tokenmill.worker.health`).
"""

from __future__ import annotations

import argparse
import json
import sys
import types
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tokenmill.worker.settings import WorkerSettings

DEMO_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a mill that ground tokens instead of grain,",
]

#: Short flag spellings the issue promises, besides the ones generated from field names.
_ALIASES = {"broker_url": ["--broker"]}


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "worker":
        return _worker(args)
    if args.command == "health":
        return _health(args)
    return _generate(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tokenmill", description="Queue-driven LLM batch jobs.")
    commands = parser.add_subparsers(dest="command", required=True)
    gen = commands.add_parser("generate", help="complete prompts offline and print JSON lines")
    gen.add_argument("--model", default="builtin:tiny", help="model (default: builtin:tiny)")
    gen.add_argument("--prompt", action="append", default=[], help="a prompt; repeat for more")
    gen.add_argument("--input", type=Path, help="JSONL file: one string or {\"prompt\": ...} per line")
    gen.add_argument("--max-tokens", type=int, default=32)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--dtype", default="auto")
    worker = commands.add_parser("worker", help="run a queue worker (Celery on Redis)")
    _add_settings_flags(worker)
    health = commands.add_parser("health", help="exit 0 only while a worker's engine is serving (container healthcheck)")
    health.add_argument("--url", default=None, help="metrics URL (default: http://127.0.0.1:$TOKENMILL_METRICS_PORT/metrics)")
    health.add_argument("--max-age", type=float, default=60.0, help="seconds without an engine status report that count as down")
    return parser


def _add_settings_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per `WorkerSettings` field; default None so an unset flag leaves env/default alone."""
    from tokenmill.worker.settings import WorkerSettings

    for name, info in WorkerSettings.model_fields.items():
        flags = [f"--{name.replace('_', '-')}", *_ALIASES.get(name, [])]
        kind = _scalar_type(info.annotation)
        help_text = f"{info.description} [env TOKENMILL_{name.upper()}]".replace("%", "%%")
        if kind is bool:
            parser.add_argument(*flags, dest=name, action=argparse.BooleanOptionalAction, default=None, help=help_text)
        else:
            parser.add_argument(*flags, dest=name, type=kind, default=None, help=help_text)


def _scalar_type(annotation: Any) -> type:
    """The type argparse should convert to: `int | None` -> int; lists are given comma-separated."""
    if typing.get_origin(annotation) is typing.Annotated:
        annotation = typing.get_args(annotation)[0]
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        annotation = next(a for a in typing.get_args(annotation) if a is not type(None))
    return annotation if annotation in (bool, int, float) else str


def worker_settings(args: argparse.Namespace) -> WorkerSettings:
    """Settings from `TOKENMILL_*` variables, overridden by the flags that were given."""
    from tokenmill.worker.settings import WorkerSettings

    return WorkerSettings(**{k: v for k, v in vars(args).items() if k != "command" and v is not None})


def _worker(args: argparse.Namespace) -> int:
    from pydantic import ValidationError

    try:
        settings = worker_settings(args)
    except ValidationError as exc:
        print(f"tokenmill worker: invalid settings:\n{exc}", file=sys.stderr)
        return 2
    from tokenmill.worker.main import run_worker

    return run_worker(settings)


def _health(args: argparse.Namespace) -> int:
    from tokenmill.worker.health import engine_problem
    from tokenmill.worker.settings import WorkerSettings

    url = args.url
    if url is None:
        port = WorkerSettings().metrics_port
        if not port:
            print("tokenmill health: the metrics endpoint is off (TOKENMILL_METRICS_PORT=0); nothing to ask", file=sys.stderr)
            return 2
        url = f"http://127.0.0.1:{port}/metrics"
    problem = engine_problem(url, args.max_age)
    if problem:
        print(f"tokenmill health: unhealthy: {problem}", file=sys.stderr)
        return 1
    print("tokenmill health: engine serving")
    return 0


def _generate(args: argparse.Namespace) -> int:
    from tokenmill import SamplingParams
    from tokenmill.errors import InvalidRequestError

    try:  # checked before the model loads, so a typo fails at once
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, seed=args.seed)
    except InvalidRequestError as exc:
        print(f"tokenmill generate: --{exc.field.replace('_', '-')}: {exc.message}", file=sys.stderr)
        return 2
    prompts = list(args.prompt) + (_read_prompts(args.input) if args.input else [])
    prompts = prompts or DEMO_PROMPTS
    from tokenmill import LLM

    llm = LLM(args.model, dtype=args.dtype)
    for index, (prompt, out) in enumerate(zip(prompts, llm.generate(prompts, params))):
        line = {"index": index, "prompt": prompt, "text": out.text, "token_ids": list(out.token_ids), "finish_reason": out.finish_reason}
        if getattr(out, "error", None):
            line["error"] = out.error
        print(json.dumps(line), flush=True)
    return 0


def _read_prompts(path: Path) -> list[str]:
    """Each line: a JSON string, or an object with a "prompt" field."""
    prompts = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        item = json.loads(line)
        prompt = item.get("prompt") if isinstance(item, dict) else item
        if not isinstance(prompt, str) or not prompt:
            raise SystemExit(f"tokenmill generate: {path}:{number}: expected a string or an object with a 'prompt' string")
        prompts.append(prompt)
    return prompts


if __name__ == "__main__":
    sys.exit(main())
