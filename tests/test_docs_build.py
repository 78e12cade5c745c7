"""The docs site builds with `mkdocs build --strict`: a broken link, a missing page, a docstring that does not
render or a stale generated page fails the suite (and so CI), not a reader."""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
#: The docs extra's packages. The test extra includes the docs extra, so a missing one fails the suite, not skips.
DOCS_EXTRA = {"mkdocs": "mkdocs", "material": "mkdocs-material", "mkdocstrings": "mkdocstrings[python]",
              "mkdocstrings_handlers.python": "mkdocstrings-python"}


def test_the_docs_extra_is_installed() -> None:
    missing = [package for module, package in DOCS_EXTRA.items() if not found(module)]
    assert not missing, f"not installed: {missing}: pip install -e '.[test]' (it includes the docs extra)"


def found(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # a parent package is missing
        return False


def build(config: Path, site: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO), "NO_MKDOCS_2_WARNING": "1"}
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(config), "-d", str(site)],
                          cwd=config.parent, env=env, capture_output=True, text=True, timeout=300)


def test_the_site_builds_strict(tmp_path: Path) -> None:
    done = build(REPO / "mkdocs.yml", tmp_path / "site")
    assert done.returncode == 0, done.stderr[-5000:]
    api = (tmp_path / "site" / "reference" / "python-api" / "index.html").read_text()
    for name in ("engine.llm.LLM.generate", "sampling_params.SamplingParams.json_schema", "client.Client.submit_many",
                 "queue.schemas.JobResult", "apps.annotate.annotate"):
        assert f'id="tokenmill.{name}"' in api, f"the Python API page does not render tokenmill.{name}"
    assert "TOKENMILL_BROKER_URL" in (tmp_path / "site" / "reference" / "configuration" / "index.html").read_text()


def test_a_broken_link_fails_the_build(tmp_path: Path) -> None:
    copy = tmp_path / "repo"
    shutil.copytree(REPO / "docs", copy / "docs")
    shutil.copy(REPO / "mkdocs.yml", copy / "mkdocs.yml")
    page = copy / "docs" / "limits.md"
    page.write_text(page.read_text() + "\nSee [the missing page](guides/no-such-page.md).\n")
    done = build(copy / "mkdocs.yml", tmp_path / "site")
    assert done.returncode != 0 and "no-such-page.md" in done.stderr, done.stderr[-3000:]


def test_the_readme_links_point_at_files_that_exist() -> None:
    """The README is not part of the site, so its relative links (into docs/, read on GitHub) are checked here."""
    text = (REPO / "README.md").read_text()
    links = [target.split("#")[0] for target in re.findall(r"\]\(([^)\s]+)\)", text) if "://" not in target]
    assert len(links) > 20, "the README links into the docs"
    missing = sorted({link for link in links if link and not (REPO / link).exists()})
    assert not missing, f"README.md links to missing files: {missing}"
