"""The docs' examples run: each block titled `example (run by the test suite)` in docs/ and README.md.

A renamed option or a changed API breaks CI here rather than a reader's first try. Each block runs in a fresh
process in an empty directory, on builtin:tiny, with this checkout first on the path; a block naming
`redis://localhost:6379/0` runs against a real redis-server and `tokenmill worker` started here, the URL
replaced by theirs; a block naming `http://127.0.0.1:8000/v1` runs against a real `tokenmill serve` (key
`sk-alice`) in front of them, the URL replaced by its own, in a directory holding the HTTP API guide's
`requests.jsonl` lines. Every other python or bash block must say why in its title (`not run by the test
suite: <reason>`) or call itself a `fragment`; an untitled block fails. See docs/development/docs.md.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "service"))
from service_fixtures import RedisServer, Server, Worker  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
RUN_TITLE = "example (run by the test suite)"
NOT_RUN = "not run by the test suite:"
#: A synopsis or part of a program (names defined elsewhere, placeholders): shown, never run.
FRAGMENT = "fragment"
BROKER = "redis://localhost:6379/0"
SERVE = "http://127.0.0.1:8000/v1"
SERVE_KEYS = "alice=sk-alice"
#: The title of the HTTP API guide's `json` block whose lines the serve examples upload as requests.jsonl.
REQUESTS_TITLE = "requests.jsonl (the test suite runs the example below on these lines)"
OPENING = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,})(?P<info>.*)$")
#: Shell functions so `tokenmill` and `python` in a bash example are this checkout's, installed or not.
BASH_PRELUDE = 'set -euo pipefail\ntokenmill() { "$EXAMPLE_PYTHON" -m tokenmill.cli "$@"; }\n' \
               'python() { "$EXAMPLE_PYTHON" "$@"; }\n'


@dataclass(frozen=True)
class Block:
    path: Path
    line: int
    lang: str
    title: str
    code: str

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(REPO)}:{self.line}"


def doc_files() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]


def blocks(path: Path) -> Iterator[Block]:
    """The fenced blocks of a page that name a language, top level only (not a block shown inside a ```` fence)."""
    lines = path.read_text().split("\n")
    number = 0
    while number < len(lines):
        opening = OPENING.match(lines[number])
        number += 1
        if not opening:
            continue
        indent, fence, info = opening["indent"], opening["fence"], opening["info"].strip()
        body = []
        while number < len(lines) and lines[number].strip() != fence:
            body.append(lines[number][len(indent):] if lines[number].startswith(indent) else lines[number])
            number += 1
        number += 1
        lang = info.split()[0] if info else ""
        if lang:
            title = re.search(r'title="([^"]*)"', info)
            yield Block(path, number - len(body) - 1, lang, title[1] if title else "", "\n".join(body) + "\n")


FENCED = [block for path in doc_files() for block in blocks(path)]
ALL = [block for block in FENCED if block.lang in ("python", "bash")]
MARKED = [block for block in ALL if block.title == RUN_TITLE]
#: Each distinct example once (the README repeats some of the guides' examples word for word).
RUN = list({(block.lang, block.code): block for block in reversed(MARKED)}.values())[::-1]


def test_the_docs_and_readme_have_run_examples() -> None:
    pages = {block.path.relative_to(REPO).as_posix() for block in MARKED}
    expected = {"README.md", "docs/getting-started.md", *(f"docs/guides/{name}.md" for name in (
        "offline-api", "structured-outputs", "queue-service", "annotate", "http-api"))}
    assert expected <= pages, f"pages without a run example: {sorted(expected - pages)}"
    assert any(BROKER in block.code for block in RUN), "no example runs against the queue"
    assert any(SERVE in block.code for block in RUN), "no example runs against tokenmill serve"


def kind(title: str) -> str | None:
    """What a block's title says it is: "run", "not run" (with a reason), "fragment", or None (untitled, or wrong)."""
    if title == RUN_TITLE:
        return "run"
    if title.startswith(NOT_RUN) and len(title[len(NOT_RUN):].strip()) >= 8:
        return "not run"
    if title == FRAGMENT or title.startswith(FRAGMENT + ": "):
        return "fragment"
    return None


def test_every_block_is_run_or_says_why_not() -> None:
    """No python or bash block is skipped silently: an untitled one fails here, as does a mistyped run title."""
    wrong = [f"{block.where}: title {block.title!r}: want {RUN_TITLE!r}, '{NOT_RUN} <reason>' or {FRAGMENT!r}"
             for block in ALL if kind(block.title) is None]
    assert not wrong, "\n".join(wrong)


def test_the_title_check_catches_untitled_and_mistyped_blocks() -> None:
    assert [kind(title) for title in (RUN_TITLE, f"{NOT_RUN} needs Docker", FRAGMENT, f"{FRAGMENT}: a synopsis")] == \
        ["run", "not run", "fragment", "fragment"]
    assert {kind(title) for title in ("", "example (run by the test-suite)", f"{NOT_RUN} no", "fragments")} == {None}


def example_env() -> dict[str, str]:
    env = {key: value for key, value in os.environ.items() if not key.startswith("TOKENMILL_")}
    env.update(PYTHONPATH=str(REPO), EXAMPLE_PYTHON=sys.executable, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    return env


def run_block(block: Block, cwd: Path, broker_url: str | None = None, serve_url: str | None = None) -> str:
    code = block.code if broker_url is None else block.code.replace(BROKER, broker_url)
    code = code if serve_url is None else code.replace(SERVE, serve_url)
    command = [sys.executable, "-c", code] if block.lang == "python" else ["bash", "-c", BASH_PRELUDE + code]
    done = subprocess.run(command, cwd=cwd, env=example_env(), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, (f"{block.where} exited {done.returncode}:\n{code}\n--- stdout\n{done.stdout[-3000:]}"
                                  f"\n--- stderr\n{done.stderr[-3000:]}")
    return done.stdout


@pytest.mark.parametrize("block", [b for b in RUN if BROKER not in b.code and SERVE not in b.code],
                         ids=lambda b: b.where)
def test_offline_example_runs(block: Block, tmp_path: Path) -> None:
    assert run_block(block, tmp_path).strip(), f"{block.where} printed nothing"


@pytest.fixture(scope="module")
def queue(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real redis-server and one `tokenmill worker` on builtin:tiny, for the examples that use the queue."""
    directory = tmp_path_factory.mktemp("docs-queue")
    server = RedisServer(directory / "redis")
    server.start()
    worker = Worker(server.url, directory / "worker.log", "docs", {})
    try:
        worker.wait_ready()
        yield server.url
    finally:
        worker.close()
        server.kill()


@pytest.mark.parametrize("block", [b for b in RUN if BROKER in b.code], ids=lambda b: b.where)
def test_queue_example_runs(block: Block, queue: str, tmp_path: Path) -> None:
    run_block(block, tmp_path, broker_url=queue)


@pytest.fixture(scope="module")
def serve(queue: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real `tokenmill serve` with the docs' key in front of the `queue` fixture's redis-server and worker."""
    directory = tmp_path_factory.mktemp("docs-serve")
    server = Server(queue, directory / "files", directory / "serve.log", **{"api-keys": SERVE_KEYS})
    try:
        yield f"http://127.0.0.1:{server.port}/v1"
    finally:
        server.close()


def requests_lines() -> str:
    [block] = [block for block in FENCED if block.lang == "json" and block.title == REQUESTS_TITLE]
    return block.code


@pytest.mark.parametrize("block", [b for b in RUN if SERVE in b.code], ids=lambda b: b.where)
def test_serve_example_runs(block: Block, serve: str, tmp_path: Path) -> None:
    lines = requests_lines()
    (tmp_path / "requests.jsonl").write_text(lines)
    output = [json.loads(line) for line in run_block(block, tmp_path, serve_url=serve).splitlines() if line.strip()]
    wanted = [json.loads(line)["custom_id"] for line in lines.splitlines()]
    assert [line["custom_id"] for line in output] == wanted, output
    assert all(line["response"]["status_code"] == 200 for line in output), output


def test_the_readme_is_a_short_front_door() -> None:
    """The README opens the project in a few screens (issue 55: at most 200 lines); histories and per-commit
    comparisons live in docs/benchmarks."""
    lines = (REPO / "README.md").read_text().splitlines()
    assert len(lines) <= 200, f"README.md has {len(lines)} lines"
    assert '.[all]"' in "\n".join(lines), "the quick start installs every extra the examples need"
