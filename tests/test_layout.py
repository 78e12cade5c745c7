"""The package layout: imports run one way between the rooms of `tokenmill/`, with no circle and no private name
shared across files.

Every import counts, wherever it stands (module level, inside a function, under `TYPE_CHECKING`), and so does a
string that names a tokenmill module whole (`"tokenmill.queue.transport:Transport"` in a Celery setting,
`_LAZY` in the package root): each is a file that needs another one. A new circle or an arrow back up the chain
fails here, naming the files.
"""

from __future__ import annotations

import ast
import functools
import graphlib
import re
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "tokenmill"

#: Room of each module: its subpackage, or its own name for a top-level module. `common` is what every room
#: may use: the errors and the sampling parameters, which the engine, the scheduler and the contract share.
COMMON = {"errors", "sampling_params", "schema_support"}
#: Which rooms each room may import. The engine side runs worker -> engine -> scheduler -> kernels; the queue
#: side applications -> client/worker -> queue (the contract); the contract imports neither side.
ALLOWED: dict[str, set[str]] = {
    "common": {"common"},
    "kernels": {"common"},
    "scheduler": {"common"},
    "engine": {"scheduler", "kernels", "common"},
    "queue": {"common"},
    "client": {"queue", "common"},
    "worker": {"queue", "engine", "common"},
    "apps": {"client", "engine", "queue", "common"},
    "cli": {"apps", "worker", "client", "queue", "engine", "common"},
    # the package root only names what `from tokenmill import ...` offers, resolved lazily
    "root": {"engine", "client", "apps", "queue", "common"},
}
#: Modules a producer loads: none of them may pull in torch, transformers, the engine or the worker.
PRODUCER_MODULES = ("tokenmill", "tokenmill.client", "tokenmill.queue.app", "tokenmill.queue.dead_letters",
                    "tokenmill.queue.names", "tokenmill.queue.schemas", "tokenmill.queue.settings",
                    "tokenmill.queue.transport")

MODULE_STRING = re.compile(r"(tokenmill(?:\.\w+)+)(?::\w+)?")


def module_files() -> dict[str, Path]:
    """Dotted module name -> file, for every module of the package."""
    files = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return files


def room(module: str) -> str:
    parts = module.split(".")
    if len(parts) == 1:
        return "root"
    return "common" if parts[1] in COMMON else parts[1]


@functools.cache
def parse(path: Path) -> ast.Module:
    """`ast.parse` of one file, once for all the checks below (they only read the tree); parsed again if CPython 3.11
    raises its spurious "AST constructor recursion depth mismatch": 3.11 keeps that depth in state shared between
    threads, so a parse in another thread of the test process (3.11's traceback formatting parses source lines, e.g. a
    library logging a retry) can trip this one; the file is not at fault."""
    for _ in range(2):
        try:
            return ast.parse(path.read_text(), str(path))
        except SystemError as error:
            if "recursion depth mismatch" not in str(error):
                raise
    return ast.parse(path.read_text(), str(path))


def imports_of(module: str, path: Path, modules: set[str]) -> list[tuple[str, list[str], int]]:
    """(imported module, names taken from it, line) for every import and whole-module string in one file."""
    found = []
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(parse(path)):
        if isinstance(node, ast.Import):
            found += [(alias.name, [], node.lineno) for alias in node.names if alias.name in modules]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against this file's package
                base = ".".join([*package.split(".")[: len(package.split(".")) - node.level + 1], *filter(None, [base])])
            if base not in modules:
                continue
            names = []
            for alias in node.names:
                if f"{base}.{alias.name}" in modules:  # `from tokenmill.queue import dead_letters`: a module
                    found.append((f"{base}.{alias.name}", [], node.lineno))
                else:
                    names.append(alias.name)
            if names:
                found.append((base, names, node.lineno))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            match = MODULE_STRING.fullmatch(node.value)
            if match and match.group(1) in modules:
                found.append((match.group(1), [], node.lineno))
    return found


def private_definitions(tree: ast.AST) -> set[str]:
    """The private names a file defines: functions, classes, module and class variables, `self._x` attributes."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
    return {name for name in names if name.startswith("_") and not name.startswith("__")}


def private_uses() -> list[str]:
    """`other._name` where `_name` is defined in another tokenmill file and not in this one (`self._x` and
    `cls._x` are a class's own business; a private name of a third-party object is not ours to judge here)."""
    trees = {module: parse(path) for module, path in module_files().items()}
    defined = {module: private_definitions(tree) for module, tree in trees.items()}
    uses = []
    for module, tree in trees.items():
        elsewhere = set().union(*(names for other, names in defined.items() if other != module)) - defined[module]
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and node.attr in elsewhere
                    and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))):
                uses.append(f"{module}:{node.lineno} uses .{node.attr}")
    return uses


def import_graph() -> tuple[dict[str, set[str]], list[str]]:
    """Module -> the tokenmill modules it needs, and every `from X import _private` taken across files."""
    files = module_files()
    graph: dict[str, set[str]] = {name: set() for name in files}
    private = []
    for module, path in files.items():
        for target, names, line in imports_of(module, path, set(files)):
            if target != module:
                graph[module].add(target)
            private += [f"{module}:{line} takes {target}.{name}" for name in names
                        if name.startswith("_") and not name.startswith("__")]
    return graph, private


def test_the_graph_sees_every_room_and_its_arrows() -> None:
    """The walk itself: it finds the rooms, function-level and string imports (else the checks below prove nothing)."""
    graph, _ = import_graph()
    assert {room(m) for m in graph} == set(ALLOWED)
    assert "tokenmill.engine.llm_engine" in graph["tokenmill.worker.engine_process"]  # imported inside a function
    assert "tokenmill.queue.transport" in graph["tokenmill.queue.app"]  # named by a Celery setting string
    assert "tokenmill.queue.names" in graph["tokenmill.client"]


def test_no_import_circle() -> None:
    graph, _ = import_graph()
    try:
        graphlib.TopologicalSorter(graph).prepare()
    except graphlib.CycleError as exc:
        pytest.fail("import circle: " + " -> ".join(exc.args[1]))


def test_arrows_run_one_way_between_rooms() -> None:
    graph, _ = import_graph()
    wrong = sorted(f"{module} ({room(module)}) -> {target} ({room(target)})"
                   for module, targets in graph.items() for target in targets
                   if room(target) != room(module) and room(target) not in ALLOWED.get(room(module), set()))
    assert not wrong, "imports against the layout:\n" + "\n".join(wrong)


def test_no_private_name_is_shared_across_files() -> None:
    _, private = import_graph()
    private += private_uses()
    assert not private, "private names shared across files (make them public in one module):\n" + "\n".join(private)


def test_producer_modules_load_no_torch_engine_or_worker() -> None:
    code = (
        "import importlib, sys\n"
        f"for name in {PRODUCER_MODULES!r}: importlib.import_module(name)\n"
        "from tokenmill import Client, Job, JobResult, SamplingParams\n"
        "Client('redis://127.0.0.1:1/0')\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers', 'triton')\n"
        "               or m.startswith(('tokenmill.worker', 'tokenmill.engine', 'tokenmill.apps')))\n"
        "assert not heavy, heavy\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
