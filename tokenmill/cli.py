"""The `tokenmill` command.

    tokenmill generate [--model builtin:tiny] [--prompt TEXT ...] [--input prompts.jsonl] [--max-tokens N]
    tokenmill worker --model M --broker redis://... [--queues a,b] [--concurrency N] [...]
    tokenmill dead-letters [--broker URL] list [--full] | requeue (ID ... | --all) | purge (ID ... | --all)
    tokenmill cancel [--broker URL] (ID ... | --run RUN)
    tokenmill annotate INPUT -o OUTPUT --template '...{{ column }}...' [--broker ...]   (tokenmill.apps.cli)
    tokenmill batch -i requests.jsonl -o results.jsonl [--errors errors.jsonl] [--broker ...]
    tokenmill health [--url http://127.0.0.1:9400/metrics] [--max-age 60]
    tokenmill serve [--host 127.0.0.1] [--port 8000] [--broker ...] [--files-dir DIR]   (tokenmill.apps.api)

`generate` runs prompts offline through `tokenmill.LLM` and prints one JSON line per completion; with no
arguments it completes a few demo prompts on the built-in tiny model (the README's quick start).
`worker` flags are generated from `WorkerSettings`, so each has a `TOKENMILL_<NAME>` environment
variable twin; a flag wins over the variable. `dead-letters` lists the jobs workers gave up on (one JSON
line each), queues them again with their delivery count reset, or drops them. `cancel` stops jobs by id, or
every job of an `annotate --broker` / `batch --broker` run, queued or running (`Client.cancel`). `health` exits 0 only
while a worker's engine is serving (the Docker healthcheck; `tokenmill.worker.health`).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from tokenmill.apps.cli import MAX_TOKENS_HELP

if TYPE_CHECKING:
    from tokenmill.worker.settings import WorkerSettings

DEMO_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a mill that ground tokens instead of grain,",
]

#: Short flag spellings the issue promises, besides the ones generated from field names.
_ALIASES = {"broker_url": ["--broker"]}
#: sysexits' EX_CONFIG: the worker's model cannot be loaded as configured; restarting it would fail the same way.
EXIT_CONFIG = 78
#: sysexits' EX_UNAVAILABLE: the worker's broker did not answer at its start (`--broker-wait`).
EXIT_UNAVAILABLE = 69


#: The extra that installs each optional top-level module (pyproject.toml's optional dependencies).
EXTRAS = {"torch": "worker", "transformers": "worker", "triton": "worker", "xgrammar": "worker", "llguidance": "worker",
          "boto3": "worker", "prometheus_client": "worker", "tqdm": "worker", "tokenizers": "worker",
          "pyarrow": "annotate", "jinja2": "annotate", "rich": "annotate",
          "fastapi": "serve", "uvicorn": "serve", "multipart": "serve", "python_multipart": "serve",
          "standardwebhooks": "serve"}


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # named under its subcommand (argparse names the top-level program)
        command = " ".join(filter(None, (args.command, getattr(args, "action", None))))
        parser.exit(2, f"tokenmill {command}: unrecognized arguments: {' '.join(unknown)} (see tokenmill {command} "
                    "--help)\n")
    try:
        return _run(args)
    except ModuleNotFoundError as exc:
        extra = EXTRAS.get((exc.name or "").split(".")[0])
        if extra is None:
            raise
        print(f"tokenmill {args.command}: needs the {extra!r} extra ({exc.name} is not installed): "
              f"pip install 'tokenmill[{extra}]'", file=sys.stderr)
        return 2


def _run(args: argparse.Namespace) -> int:
    if args.command == "worker":
        return _worker(args)
    if args.command == "dead-letters":
        return _dead_letters(args)
    if args.command == "cancel":
        return _cancel(args)
    if args.command in ("annotate", "batch"):
        from tokenmill.apps.cli import run

        return run(args)
    if args.command == "health":
        return _health(args)
    if args.command == "serve":
        from tokenmill.apps.api.server import run as serve

        return serve(args)
    return _generate(args)


def build_parser() -> argparse.ArgumentParser:
    from importlib.metadata import PackageNotFoundError, version

    parser = OneLineErrors(prog="tokenmill", description="Queue-driven LLM batch jobs.")
    try:
        parser.add_argument("--version", action="version", version=f"tokenmill {version('tokenmill')}")
    except PackageNotFoundError:  # run from a source tree that was never installed
        parser.add_argument("--version", action="version", version="tokenmill (not installed)")
    commands = parser.add_subparsers(dest="command", required=True)
    gen = commands.add_parser("generate", help="complete prompts offline and print JSON lines")
    gen.add_argument("--model", default="builtin:tiny", help="model (default: builtin:tiny)")
    gen.add_argument("--prompt", action="append", default=[], help="a prompt; repeat for more")
    gen.add_argument("--input", type=Path, help="JSONL file: one string or {\"prompt\": ...} per line")
    gen.add_argument("--max-tokens", type=int, default=None, help=MAX_TOKENS_HELP)
    gen.add_argument("--temperature", type=float, default=0.0, help="sampling temperature; 0 is greedy")
    gen.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling: keep the top tokens of this "
                     "probability mass")
    gen.add_argument("--seed", type=int, default=None, help="sampling seed (default: the engine's)")
    gen.add_argument("--dtype", default="auto", help="weights and activations dtype (auto, float32, bfloat16, "
                     "float16)")
    structured = gen.add_mutually_exclusive_group()
    structured.add_argument("--json-schema", metavar="FILE|JSON", help="force a JSON value matching this schema (a file or inline JSON)")
    structured.add_argument("--choice", metavar="A,B,C", help="force the completion to be exactly one of these comma-separated strings")
    structured.add_argument("--regex", metavar="R", help="force the whole completion to match this regular expression")
    structured.add_argument("--json-object", action="store_true", help="force any JSON object")
    gen.add_argument("--choice-probabilities", action="store_true", help="with --choice: each choice's probability "
                     "as a whole (no sampling), and the most probable choice as the text")
    worker = commands.add_parser("worker", help="run a queue worker (Celery on Redis)")
    _add_settings_flags(worker)
    _add_dead_letter_commands(commands)
    cancel = commands.add_parser("cancel", help="cancel queued or running jobs by id, or a whole annotate/batch run")
    _add_queue_flags(cancel)
    cancel.add_argument("ids", nargs="*", metavar="ID", help="job ids")
    cancel.add_argument("--run", help="cancel every job of this annotate --broker / batch --broker run (its run id)")
    from tokenmill.apps.cli import add_parsers as add_annotate_parsers

    add_annotate_parsers(commands)  # `annotate` and `batch`
    from tokenmill.apps.api.server import add_parser as add_serve_parser

    add_serve_parser(commands)
    health = commands.add_parser("health", help="exit 0 only while a worker's engine is serving (container healthcheck)")
    health.add_argument("--url", default=None, help="metrics URL (default: http://127.0.0.1:$TOKENMILL_METRICS_PORT/metrics)")
    health.add_argument("--max-age", type=float, default=60.0, help="seconds without an engine status report that count as down")
    _show_defaults(parser)
    return parser


class OneLineErrors(argparse.ArgumentParser):
    """A flag argparse refuses is one line naming it, exit status 2, as every other unusable input (argparse prints
    the whole usage first: some 40 lines for `annotate`). Its subcommands' parsers are of this class too."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: {message} (see {self.prog} --help)\n")


class DefaultsHelpFormatter(argparse.HelpFormatter):
    """Every option's help ends with its default, unless it has none to show (None, False) or says it already."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        shown = not (action.default is None or action.default is False or action.default == []
                     or action.default is argparse.SUPPRESS)
        if shown and "default" not in text and action.option_strings:
            text += " (default: %(default)s)"
        return text


def _show_defaults(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = DefaultsHelpFormatter
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                _show_defaults(sub)


def _add_queue_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--broker", dest="broker_url", help="Redis URL [env TOKENMILL_BROKER_URL]")
    parser.add_argument("--result-backend", help="Redis URL of results, if not the broker [env TOKENMILL_RESULT_BACKEND]")
    parser.add_argument("--queue", help="queue (where dead-letters requeue sends jobs) [env TOKENMILL_QUEUE]")


def _add_dead_letter_commands(commands: Any) -> None:
    dead = commands.add_parser("dead-letters", help="list, requeue or purge jobs the workers gave up on")
    _add_queue_flags(dead)
    actions = dead.add_subparsers(dest="action", required=True)
    listing = actions.add_parser("list", help="one JSON line per dead letter, newest first")
    listing.add_argument("--full", action="store_true", help="print whole entries (with the job), not summaries")
    for name, text in (("requeue", "queue jobs again, delivery count reset"), ("purge", "drop dead letters")):
        action = actions.add_parser(name, help=text)
        action.add_argument("ids", nargs="*", metavar="ID", help="job ids")
        action.add_argument("--all", action="store_true", help="every dead letter")


def _add_settings_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per `WorkerSettings` field; default None so an unset flag leaves env/default alone."""
    from tokenmill.queue.settings import add_settings_flags
    from tokenmill.worker.settings import WorkerSettings

    add_settings_flags(parser, WorkerSettings, aliases=_ALIASES)


def worker_settings(args: argparse.Namespace) -> WorkerSettings:
    """Settings from `TOKENMILL_*` variables, overridden by the flags that were given."""
    from tokenmill.worker.settings import WorkerSettings

    return WorkerSettings(**{k: v for k, v in vars(args).items() if k != "command" and v is not None})


def _worker(args: argparse.Namespace) -> int:
    from pydantic import ValidationError

    from tokenmill.queue.settings import setting_problems

    try:
        settings = worker_settings(args)
    except ValidationError as exc:
        for problem in setting_problems(exc):
            print(f"tokenmill worker: {problem}", file=sys.stderr)
        return 2
    from tokenmill.errors import ModelLoadError
    from tokenmill.worker.engine_process import EngineFailure
    from tokenmill.worker.main import BrokerUnavailable, run_worker
    from tokenmill.worker.service import FATAL_EXIT_CODE

    try:
        return run_worker(settings)
    except EngineFailure as exc:
        print(f"tokenmill worker: {exc} (exit {FATAL_EXIT_CODE}: a supervisor restarts the worker)", file=sys.stderr)
        return FATAL_EXIT_CODE
    except BrokerUnavailable as exc:
        print(f"tokenmill worker: the broker {exc}: start Redis there, or fix --broker / --result-backend "
              f"(exit {EXIT_UNAVAILABLE})", file=sys.stderr)
        return EXIT_UNAVAILABLE
    except ModelLoadError as exc:
        print(f"tokenmill worker: {exc} (exit {EXIT_CONFIG}: a configuration error, not restarted by a supervisor "
              "that honours EX_CONFIG)", file=sys.stderr)
        return EXIT_CONFIG


def _dead_letters(args: argparse.Namespace) -> int:
    from tokenmill.client import Client
    from tokenmill.queue import dead_letters

    if args.action != "list" and bool(args.ids) == bool(args.all):
        print(f"tokenmill dead-letters {args.action}: give job ids or --all (not both)", file=sys.stderr)
        return 2
    with Client(args.broker_url, result_backend=args.result_backend, queue=args.queue) as client:
        if args.action == "list":
            for letter in dead_letters.read(client.app.backend.client):
                print(letter.raw.decode() if args.full else json.dumps(letter.summary()), flush=True)
            return 0
        ids = None if args.all else args.ids
        if args.action == "requeue":
            handles, missing = client.requeue_dead_letters(ids)
            print(f"requeued {len(handles)} job(s): {' '.join(h.id for h in handles)}".rstrip(": "))
        else:
            count, missing = client.purge_dead_letters(ids)
            print(f"purged {count} dead letter(s)")
    for job_id in missing:
        print(f"tokenmill dead-letters {args.action}: no dead letter for job {job_id}", file=sys.stderr)
    return 1 if missing else 0
def _cancel(args: argparse.Namespace) -> int:
    """One line per job: its id and outcome (cancelled, cancelling, finished: already had its result)."""
    from tokenmill.client import Client

    if bool(args.ids) == bool(args.run):
        print("tokenmill cancel: give job ids or --run RUN (not both)", file=sys.stderr)
        return 2
    missing: list[str] | None = []
    with Client(args.broker_url, result_backend=args.result_backend, queue=args.queue) as client:
        if args.run:
            outcomes = client.cancel_run(args.run)
        else:
            missing = client.unknown(args.ids)
            outcomes = client.cancel([job_id for job_id in args.ids if job_id not in (missing or [])])
        queue = client.queue
    if args.run and not outcomes:
        print(f"tokenmill cancel: no jobs recorded for run {args.run}", file=sys.stderr)
        return 1
    for job_id, outcome in outcomes.items():
        print(f"{job_id}\t{outcome}", flush=True)
    if missing is None:
        print(f"tokenmill cancel: queue {queue!r} is too long to read whole: ids not found elsewhere were recorded as "
              "cancelled, as for a job not sent yet", file=sys.stderr)
    for job_id in missing or []:
        print(f"tokenmill cancel: no job {job_id}: no result, never delivered, not on queue {queue!r} (nothing "
              "cancelled; check the id, or --queue)", file=sys.stderr)
    return 1 if missing else 0


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
    from tokenmill.errors import InvalidRequestError, ModelLoadError
    from tokenmill.sampling_params import SamplingParams

    try:  # checked before the model loads, so a typo fails at once
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, seed=args.seed,
                                **_structured_options(args))
    except InvalidRequestError as exc:
        print(f"tokenmill generate: --{exc.field.replace('_', '-')}: {exc.message}", file=sys.stderr)
        return 2
    prompts = list(args.prompt) + (_read_prompts(args.input) if args.input else [])
    prompts = prompts or DEMO_PROMPTS
    from tokenmill.engine.llm import LLM

    try:
        llm = LLM(args.model, dtype=args.dtype)
    except ModelLoadError as exc:
        print(f"tokenmill generate: {exc}", file=sys.stderr)
        return 2
    for index, (prompt, out) in enumerate(zip(prompts, llm.generate(prompts, params))):
        line = {"index": index, "prompt": prompt, "text": out.text, "token_ids": list(out.token_ids), "finish_reason": out.finish_reason}
        if getattr(out, "error", None):
            line["error"] = out.error
        if out.constraint_satisfied is not None:
            line.update(constraint_satisfied=out.constraint_satisfied, parsed=out.parsed, constraint_error=out.constraint_error)
        if getattr(out, "choice_probabilities", None) is not None:
            line["choice_probabilities"] = out.choice_probabilities
        print(json.dumps(line), flush=True)
    return 0


def _structured_options(args: argparse.Namespace) -> dict[str, Any]:
    """--json-schema (a file, or inline JSON when it is not a file), --choice a,b,c, --regex, --json-object."""
    from tokenmill.apps.cli import text_or_file
    from tokenmill.errors import InvalidRequestError

    options: dict[str, Any] = {}
    if args.json_schema is not None:
        text = text_or_file(args.json_schema)
        if text is args.json_schema and not text.lstrip().startswith("{"):
            raise InvalidRequestError("json_schema", f"{args.json_schema!r} is neither a file nor inline JSON")
        options["json_schema"] = text
    if args.choice is not None:
        options["choice"] = [c for c in args.choice.split(",")]
    if args.regex is not None:
        options["regex"] = args.regex
    if args.json_object:
        options["json_object"] = True
    if args.choice_probabilities:
        options["choice_probabilities"] = True
    return options


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
