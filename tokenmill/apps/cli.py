"""The `tokenmill annotate` and `tokenmill batch` subcommands (argparse only here; the work is imported on use).

Exit status: 0 when every row succeeded, 1 when some rows failed (their errors are in the output and the
summary), 2 when the run could not start (bad option, bad template, unreadable input, duplicate custom_id).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import typing
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tokenmill.apps.options import RunOptions

EXIT_ROWS_FAILED = 1
EXIT_UNUSABLE = 2
EXIT_INTERRUPTED = 130  # as a shell reports SIGINT
#: What --max-tokens says when it is left unset: the one rule of `SamplingParams` (`DEFAULT_MAX_TOKENS`).
MAX_TOKENS_HELP = ("most tokens per completion (default: 256; with --choice, enough for the longest choice; "
                   "the same rule in every command)")


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
    ann.add_argument("--probabilities", action="store_true", help="with --choice: each choice's probability as a "
                     "whole (normalised over the choices, no sampling) in a 'probabilities' column, and the most "
                     "probable choice as the label")
    ann.add_argument("--logprobs", type=int, default=None, metavar="N", help="a 'logprobs' column: each generated "
                     "token with its logprob and its N most likely alternatives (0 to 20; 0: the chosen tokens only)")
    ann.add_argument("--embed", action="store_true", help="embed each rendered prompt instead of completing it: an "
                     "'embedding' column (Parquet: list<float32>) with 'prompt_tokens' and 'error'; no sampling options")
    ann.add_argument("--dimensions", type=int, default=None, metavar="N", help="with --embed: keep the first N "
                     "values of each vector, normalised (as OpenAI's dimensions)")
    ann.add_argument("--score", metavar="A,B,...", help="score these comma-separated continuations given each "
                     "rendered prompt instead of completing it (their log-likelihoods, as lm-eval-harness's "
                     "loglikelihood; spaces kept: ' yes, no' scores ' yes' and ' no'): a 'scores' column of "
                     "{continuation, logprob, is_greedy, num_tokens} with 'prompt_tokens' and 'error'; no sampling options")
    ann.add_argument("--id-column", help="column naming each row (default: its position)")
    ann.add_argument("--column", default="annotation", help="name of the completion text column (default: annotation)")
    ann.add_argument("--input-format", choices=["jsonl", "csv", "parquet"], help="override the input extension")
    ann.add_argument("--output-format", choices=["jsonl", "parquet"], help="override the output extension")
    ann.add_argument("--max-tokens", type=int, default=None, help=MAX_TOKENS_HELP)
    ann.add_argument("--temperature", type=float, default=0.0, help="sampling temperature; 0 is greedy")
    ann.add_argument("--top-p", type=float, default=None, help="nucleus sampling: keep the top tokens of this "
                     "probability mass (default: all)")
    ann.add_argument("--top-k", type=int, default=None, help="keep the k most likely tokens (default: all)")
    ann.add_argument("--seed", type=int, default=None, help="sampling seed of every row (default: the engine's)")
    ann.add_argument("--stop", action="append", default=None, help="stop string; repeat for more")
    ann.add_argument("--limit", type=int, default=None, metavar="N", help="only the first N rows (the output holds "
                     "those)")
    ann.add_argument("--dry-run", action="store_true", help="print the first rendered prompts and the run's plan "
                     "(rows, estimated tokens), then stop: no model is loaded, nothing is written")
    add_run_flags(ann)
    bat = commands.add_parser("batch", help="run an OpenAI Batch API input file")
    bat.add_argument("-i", "--input", required=True, help="requests JSONL (local or s3://)")
    bat.add_argument("-o", "--output", required=True, help="results JSONL (local or s3://)")
    bat.add_argument("--errors", help="failed requests JSONL (default: the output with .errors.jsonl "
                     "in place of its extension: results.jsonl -> results.errors.jsonl)")
    bat.add_argument("--max-tokens", type=int, default=None, help="for requests that set neither max_tokens nor "
                     "max_completion_tokens: " + MAX_TOKENS_HELP)
    add_run_flags(bat)


def add_run_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per `RunOptions` field that has a help (the same help, default and type whichever subcommand), then
    one per engine option (`_engine_flags`): declared once for `annotate` and `batch`."""
    from tokenmill.apps.options import RunOptions, flag_fields
    from tokenmill.queue.settings import flag_type

    hints = typing.get_type_hints(RunOptions)
    for spec in flag_fields():  # not `llm` (Python's alone) nor `engine_options` (the engine's own flags)
        flag, meta = f"--{spec.name.replace('_', '-')}", spec.metadata
        kind, choices = flag_type(hints[spec.name])
        if kind is bool:  # every switch is off by default
            parser.add_argument(flag, action="store_true", help=meta["help"])
            continue
        default = (os.environ.get(meta["env"]) or None) if meta["env"] else spec.default
        parser.add_argument(flag, type=None if kind is str else kind, choices=choices, default=default,
                            metavar=meta["metavar"], help=meta["help"])
    _engine_flags(parser)


def _engine_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per engine option (`EngineConfig`), for the embedded engine; unset, the engine's default holds. A
    name the command uses already (`--seed`, the rows' sampling seed) is `--engine-<name>`."""
    from tokenmill.engine.config import ENGINE_OPTIONS
    from tokenmill.queue.settings import add_flag

    taken = set(parser._option_string_actions)
    for option in ENGINE_OPTIONS:
        flag = f"--{option.name.replace('_', '-')}"
        flag = f"--engine-{flag[2:]}" if flag in taken else flag
        default = f" (default: {option.default})" if option.default is not None else ""
        add_flag(parser, [flag], f"engine_{option.name}", option.kind, option.choices,
                 f"embedded engine: {option.help[0].lower()}{option.help[1:]}{default}", metavar=option.name.upper())


def _engine_options(args: argparse.Namespace) -> dict[str, Any]:
    """The engine options `_engine_flags` were given (unset ones left to the engine's defaults)."""
    from tokenmill.engine.config import ENGINE_OPTIONS

    given = {option.name: getattr(args, f"engine_{option.name}") for option in ENGINE_OPTIONS}
    return {name: value for name, value in given.items() if value is not None}


def run(args: argparse.Namespace) -> int:
    from tokenmill.apps.datasets import DatasetError
    from tokenmill.errors import InvalidRequestError, ModelLoadError

    import redis
    from kombu.exceptions import OperationalError
    from kombu.utils.url import maybe_sanitize_url

    try:
        summary = _annotate(args) if args.command == "annotate" else _batch(args)
    except InvalidRequestError as exc:
        print(f"tokenmill {args.command}: {_flag_of(exc.field, args)}: {exc.message}", file=sys.stderr)
        return EXIT_UNUSABLE
    except (DatasetError, ModelLoadError) as exc:
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


#: Request fields whose flag has another name.
_FLAGS = {"choice_probabilities": "probabilities"}


def _flag_of(field: str, args: argparse.Namespace) -> str:
    """An error's field as the flag that set it (`choice[0]` -> `--choice (choice[0])`), or as it is where no flag
    did (a template's column, a row's field)."""
    name = field.split("[", 1)[0].split(".", 1)[0]
    name = _FLAGS.get(name, name)
    if not hasattr(args, name):
        return field
    flag = f"--{name.replace('_', '-')}"
    return flag if field == name else f"{flag} ({field})"


def options_from(args: argparse.Namespace) -> RunOptions:
    """The run's options from the flags `add_run_flags` declared, the same for `annotate` and `batch`. Raises
    `InvalidRequestError` ("model") with neither --model nor --broker (`require_model`)."""
    from tokenmill.apps.options import RunOptions, flag_fields, require_model

    flagged = {spec.name: getattr(args, spec.name) for spec in flag_fields()}
    options = RunOptions(**flagged, engine_options=_engine_options(args))
    require_model(options)
    return options


def _annotate(args: argparse.Namespace) -> Any:
    from tokenmill.apps.annotate import annotate
    from tokenmill.errors import InvalidRequestError

    sampling = {name: getattr(args, name) for name in ("top_p", "top_k", "seed", "stop", "logprobs")
                if getattr(args, name) is not None}
    if args.probabilities:
        sampling["choice_probabilities"] = True
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
        max_tokens=args.max_tokens, temperature=args.temperature, limit=args.limit, dry_run=args.dry_run,
        embed=args.embed, dimensions=args.dimensions, score=args.score.split(",") if args.score else None, **sampling,
        options=options_from(args),
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

    return batch(args.input, args.output, errors=args.errors, default_max_tokens=args.max_tokens,
                 options=options_from(args))
