"""The Docker image's lock (docker/requirements.lock) pins every package pyproject.toml asks for.

The image installs the lock, then tokenmill's wheel with `--no-deps` and `pip check`: a dependency added to
pyproject.toml but not to the lock fails the image build (it did once: jsonschema and xgrammar). This catches
it in the suite; `scripts/lock.sh` regenerates the lock.
"""

from __future__ import annotations

import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

REPO = Path(__file__).resolve().parents[1]
IMAGE_EXTRAS = ("worker", "flower", "annotate")  # what scripts/lock.sh resolves for the image


def _name(requirement: str) -> str:
    return canonicalize_name(Requirement(requirement).name)


def test_the_image_lock_pins_every_dependency_of_the_image() -> None:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    wanted = {_name(r) for r in project["dependencies"]}
    for extra in IMAGE_EXTRAS:
        wanted |= {_name(r) for r in project["optional-dependencies"][extra] if not r.startswith("tokenmill")}
    lines = [line.strip() for line in (REPO / "docker" / "requirements.lock").read_text().splitlines()]
    pinned = {_name(line) for line in lines if line and not line.startswith("#")}
    assert all("==" in line for line in lines if line and not line.startswith("#")), "every lock line pins a version"
    missing = sorted(wanted - pinned - {"torch"})  # torch is installed by variant, before the lock
    assert not missing, f"docker/requirements.lock lacks {missing}: run scripts/lock.sh"


def test_the_light_images_install_every_core_dependency() -> None:
    """The flower and api stages install the light tokenmill's dependencies by name, then its wheel with `--no-deps`
    and `pip check`: a core dependency missing from their lists fails the image build (it did once: orjson)."""
    core = {_name(r) for r in tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]}
    dockerfile = (REPO / "Dockerfile").read_text().replace("\\\n", " ")
    for stage in ("flower", "api"):
        body = dockerfile.split(f" AS {stage}\n", 1)[1].split("\nFROM ", 1)[0]
        install = next(line for line in body.splitlines() if "pip install -c /opt/requirements.lock" in line)
        named = {_name(word.strip('"')) for word in install.split("requirements.lock", 1)[1].split()}
        missing = sorted(core - named)
        assert not missing, f"the Dockerfile's {stage} stage does not install {missing}"


def _pins(lock: Path) -> dict[str, str]:
    lines = [line.strip() for line in lock.read_text().splitlines()]
    requirements = [Requirement(line) for line in lines if line and not line.startswith("#")]
    assert all(str(r.specifier).startswith("==") for r in requirements), f"{lock}: every line pins a version"
    return {canonicalize_name(r.name): str(r.specifier)[2:] for r in requirements}


def test_the_test_lock_pins_every_dependency_of_every_extra() -> None:
    """requirements/test.lock is what the README's test command and .ci/run install: a dependency missing from it
    would be installed at whatever version the registry has that day."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    wanted = {_name(r) for r in project["dependencies"]}
    for requirements in project["optional-dependencies"].values():
        wanted |= {_name(r) for r in requirements if not r.startswith("tokenmill")}
    pins = _pins(REPO / "requirements" / "test.lock")
    missing = sorted(wanted - set(pins))
    assert not missing, f"requirements/test.lock lacks {missing}: run scripts/lock.sh"
    for requirement in project["dependencies"] + [r for rs in project["optional-dependencies"].values() for r in rs]:
        parsed = Requirement(requirement)
        if parsed.name != "tokenmill":
            pinned = pins[canonicalize_name(parsed.name)]
            assert parsed.specifier.contains(pinned, prereleases=True), f"{parsed.name}=={pinned} is outside {parsed}"


def test_the_readme_and_ci_install_the_test_lock() -> None:
    install = 'pip install -q -c requirements/test.lock -e ".[test]"'
    assert install in (REPO / ".ci" / "run").read_text()
    assert 'pip install -c requirements/test.lock -e ".[test]"' in (REPO / "README.md").read_text()
