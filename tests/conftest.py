"""Shared fixtures for the engine tests (helpers live in model_fixtures.py, importable by test modules)."""

from __future__ import annotations

from pathlib import Path

import pytest

from model_fixtures import CONFIGS, build_model_dir


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {arch: build_model_dir(arch, root) for arch in CONFIGS}
