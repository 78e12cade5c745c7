"""Shared fixtures for the engine tests (helpers live in model_fixtures.py, importable by test modules).

Seeds. A test that draws random inputs takes the `random_seed` fixture and runs once per seed of the run:
`TOKENMILL_TEST_SEEDS`, comma-separated integers where `fresh` stands for a newly drawn one. The
default, `DEFAULT_SEEDS`, is what CI runs: fixed seeds (a failure there is a bug that stays reproducible)
and one fresh seed (new inputs every run, to find bugs; a failing fresh seed is a bug too, never a
reason to rerun). Each seed is in the test id (`[seed=...]`) and the run prints them all, so any failure
reruns exactly with `TOKENMILL_TEST_SEEDS=<seed>`.
"""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest

# One torch thread, before torch is imported (subprocesses inherit it). The test models are tiny: extra
# intra-op threads only add overhead, and on a loaded machine their spin-waits multiply it (measured here,
# load ~6 on 2 cores: test_token_budgets_and_block_sizes[1-1] took 16.6 s of CPU with 2 threads, 3.3 s with 1).
os.environ.setdefault("OMP_NUM_THREADS", "1")

from model_fixtures import CONFIGS, build_model_dir  # noqa: E402

SEEDS_VARIABLE = "TOKENMILL_TEST_SEEDS"
DEFAULT_SEEDS = "1846882154,fresh"
_seeds = pytest.StashKey[list[int]]()


def parse_seeds(spec: str) -> list[int]:
    """`"1,fresh"` -> `[1, <a new random seed>]`; anything else than integers and `fresh` is an error."""
    seeds = []
    for item in (part.strip() for part in spec.split(",")):
        if item == "fresh":
            seeds.append(random.SystemRandom().randrange(2**31))
        elif item.isdigit():
            seeds.append(int(item))
        else:
            raise pytest.UsageError(f"{SEEDS_VARIABLE}: {item!r} is neither a non-negative integer nor 'fresh'")
    return list(dict.fromkeys(seeds))


def pytest_configure(config: pytest.Config) -> None:
    seeds = parse_seeds(os.environ.get(SEEDS_VARIABLE) or DEFAULT_SEEDS)
    config.stash[_seeds] = seeds
    # Resolved once: subprocesses (and pytest-xdist workers, which must collect the same ids) see these.
    os.environ[SEEDS_VARIABLE] = ",".join(map(str, seeds))


def _seed_line(config: pytest.Config) -> str:
    seeds = ",".join(map(str, config.stash[_seeds]))
    return f"test seeds: {SEEDS_VARIABLE}={seeds} (rerun one with {SEEDS_VARIABLE}=<seed>)"


def pytest_report_header(config: pytest.Config) -> str:
    return _seed_line(config)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter, config: pytest.Config) -> None:
    """Also under `-q`, which hides the header."""
    terminalreporter.write_line(_seed_line(config))


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "random_seed" in metafunc.fixturenames:
        seeds = metafunc.config.stash[_seeds]
        metafunc.parametrize("random_seed", seeds, ids=[f"seed={s}" for s in seeds])


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {arch: build_model_dir(arch, root) for arch in CONFIGS}
