"""The docs pages generated from the code: the configuration reference and the CLI reference.

One source each: the pydantic-settings classes of the package (every `*Settings` class) and the argparse
parsers of `tokenmill` (`tokenmill/cli.py`, `tokenmill/apps/cli.py`, `tokenmill/apps/api/server.py`). The
pages are committed, so they read on GitHub as well as on the site; `python docs/hooks/generated.py`
rewrites them, `tests/test_docs_reference.py` fails while a committed page differs from what the code gives,
and as an MkDocs hook this module makes `mkdocs build --strict` fail the same way.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import logging
import re
import sys
from pathlib import Path
from typing import Any, Callable

DOCS = Path(__file__).resolve().parent.parent
REGENERATE = "python docs/hooks/generated.py"
log = logging.getLogger("mkdocs.hooks.generated")


# -- settings ----------------------------------------------------------------------------------------


def settings_classes() -> list[type]:
    """Every BaseSettings subclass defined in a tokenmill module that defines a class named *Settings."""
    from pydantic_settings import BaseSettings

    import tokenmill

    package = Path(tokenmill.__file__).parent
    found: list[type] = []
    for path in sorted(package.rglob("*.py")):
        if not re.search(r"^class \w*Settings\(", path.read_text(), re.MULTILINE):
            continue
        module = importlib.import_module(".".join(path.relative_to(package.parent).with_suffix("").parts))
        for _, cls in inspect.getmembers(module, inspect.isclass):
            if issubclass(cls, BaseSettings) and cls.__module__ == module.__name__:
                found.append(cls)
    return found


def settings_fields() -> dict[str, tuple[str, Any]]:
    """Environment variable -> (field name, field info), over all settings classes, in class order."""
    fields: dict[str, tuple[str, Any]] = {}
    for cls in sorted(settings_classes(), key=lambda cls: CLASS_ORDER.index(cls.__name__)
                      if cls.__name__ in CLASS_ORDER else len(CLASS_ORDER)):
        prefix = cls.model_config.get("env_prefix", "")
        for name, info in cls.model_fields.items():
            fields[f"{prefix}{name}".upper()] = (name, info)
    return fields


#: Producers' and workers' shared settings first, then the worker's, then the server's.
CLASS_ORDER = ["QueueSettings", "WorkerSettings", "ServeSettings"]


def render_default(info: Any) -> str:
    """A default as the page writes it: `value` in backticks, `unset` for None (the meaning says what then)."""
    value = info.get_default(call_default_factory=True)
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return f"`{value}`"


def worker_flags() -> dict[str, list[str]]:
    """Field name -> the `tokenmill worker` flags that set it."""
    worker = subcommands(build_parser())["worker"]
    return {action.dest: list(action.option_strings) for action in worker._actions if action.option_strings}


def cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


CONFIGURATION_INTRO = """\
# Configuration reference

<!-- Generated from the settings classes by `{regenerate}`: edit the Field descriptions, not this page. -->

Every worker setting, from `tokenmill/queue/settings.py` (`QueueSettings`: what producers and workers
share), `tokenmill/worker/settings.py` (`WorkerSettings`: the worker) and `tokenmill/apps/api/settings.py`
(`ServeSettings`: `tokenmill serve`, whose flags of the same names, e.g. `--files-dir`, win over them too).
Each is a `TOKENMILL_<NAME>` environment variable (in compose: a line in `.env`) and a `tokenmill worker`
flag; a flag wins over the variable, an empty variable counts as unset.

This page is generated from those classes (`{regenerate}`); `tests/test_docs_reference.py` fails when it
differs from them, so a setting cannot be added, renamed or given a new default without this table following.

| variable | `tokenmill worker` flag | default | meaning |
|---|---|---|---|
"""


def configuration_page() -> str:
    flags = worker_flags()
    rows = []
    for variable, (name, info) in settings_fields().items():
        names = ", ".join(f"`{flag}`" for flag in flags.get(name, [])) or "–"
        rows.append(f"| `{variable}` | {names} | {render_default(info)} | {cell(info.description or '')} |\n")
    return CONFIGURATION_INTRO.format(regenerate=REGENERATE) + "".join(rows)


# -- CLI ---------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    from tokenmill.cli import build_parser as tokenmill_parser

    return tokenmill_parser()


def subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    """Name -> parser of each subcommand of `parser`, in the order they were added."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def subcommand_help(parser: argparse.ArgumentParser) -> dict[str, str]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return {choice.dest: choice.help or "" for choice in action._choices_actions}
    return {}


def usage(parser: argparse.ArgumentParser) -> str:
    """The usage line at a fixed width (argparse otherwise wraps at the terminal's)."""
    formatter = argparse.HelpFormatter(parser.prog, width=100)
    formatter.add_usage(parser.usage, parser._actions, parser._mutually_exclusive_groups)
    return formatter.format_help().strip()


def option_default(action: argparse.Action) -> str:
    if action.default in (None, argparse.SUPPRESS) or isinstance(action, argparse._StoreTrueAction) or action.required:
        return "–"
    if isinstance(action, argparse._AppendAction) and action.default == []:
        return "–"
    return f"`{action.default}`"


def option_row(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
    names = ", ".join(f"`{name}`" for name in action.option_strings) or f"`{action.metavar or action.dest}`"
    formatter = parser._get_formatter()
    meaning = formatter._expand_help(action) if action.help else ""
    if action.choices and not isinstance(action, argparse._SubParsersAction):
        meaning = f"{meaning} (one of {', '.join(f'`{choice}`' for choice in action.choices)})".strip()
    if action.required and action.option_strings:
        meaning = f"required. {meaning}".strip()
    return f"| {names} | {option_default(action)} | {cell(meaning)} |\n"


def command_section(parser: argparse.ArgumentParser, help_text: str, depth: int) -> str:
    out = [f"{'#' * depth} `{parser.prog}`\n\n"]
    if help_text:
        out.append(f"{help_text[0].upper()}{help_text[1:]}.\n\n")
    out.append(f"```text\n{usage(parser)}\n```\n\n")
    actions = [a for a in parser._actions
               if not isinstance(a, (argparse._HelpAction, argparse._SubParsersAction))]
    if actions:
        out.append("| argument | default | meaning |\n|---|---|---|\n")
        out.extend(option_row(parser, action) for action in actions)
        out.append("\n")
    helps = subcommand_help(parser)
    for name, child in subcommands(parser).items():
        out.append(command_section(child, helps.get(name, ""), depth + 1))
    return "".join(out)


CLI_INTRO = """\
# CLI reference

<!-- Generated from the argparse parsers by `{regenerate}`: edit the parsers' help texts, not this page. -->

Every `tokenmill` command and flag, generated from the argument parsers (`tokenmill/cli.py`,
`tokenmill/apps/cli.py`, `tokenmill/apps/api/server.py`) by `{regenerate}`; `tests/test_docs_reference.py`
fails when this page differs from them. `tokenmill worker`'s flags are its settings: each also reads the
`TOKENMILL_*` variable in brackets (see the [configuration reference](configuration.md)), and a flag wins
over the variable. "–" in the default column: none (the flag is off, or the setting's own default applies).
`--version` (`tokenmill --version`) prints the installed version.

"""


def cli_page() -> str:
    parser = build_parser()
    helps = subcommand_help(parser)
    sections = [command_section(child, helps.get(name, ""), 2) for name, child in subcommands(parser).items()]
    return CLI_INTRO.format(regenerate=REGENERATE) + "".join(sections).rstrip("\n") + "\n"


# -- pages -------------------------------------------------------------------------------------------

PAGES: dict[str, Callable[[], str]] = {
    "reference/configuration.md": configuration_page,
    "reference/cli.md": cli_page,
}


def stale_pages() -> list[str]:
    """The generated pages whose committed text differs from what the code gives now."""
    return [name for name, render in PAGES.items()
            if not (DOCS / name).exists() or (DOCS / name).read_text() != render()]


def on_pre_build(config: Any) -> None:
    """MkDocs hook: a stale generated page is a warning, so `mkdocs build --strict` fails on it."""
    for name in stale_pages():
        log.warning("docs/%s differs from what the code generates: run `%s`", name, REGENERATE)


def main() -> int:
    for name, render in PAGES.items():
        (DOCS / name).write_text(render())
        print(f"wrote docs/{name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
