"""The README's configuration reference against the settings classes, and docker-compose.yml against both.

Every field of every pydantic-settings class in the package must have a row in the README section
"Configuration reference" with its environment variable, its `tokenmill worker` flag and its default,
and every row must name a real setting: adding a setting without documenting it fails here, and the
failure message prints the rows to paste. The compose file may only set variables that exist.
"""

from __future__ import annotations

import importlib
import inspect
import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic_settings import BaseSettings

import tokenmill
from tokenmill.cli import build_parser

REPO = Path(__file__).resolve().parent.parent
SECTION = "## Configuration reference"


def settings_classes() -> list[type[BaseSettings]]:
    """Every BaseSettings subclass defined in a tokenmill module that defines a class named *Settings."""
    package = Path(tokenmill.__file__).parent
    found: list[type[BaseSettings]] = []
    for path in sorted(package.rglob("*.py")):
        if not re.search(r"^class \w*Settings\(", path.read_text(), re.MULTILINE):
            continue
        module = importlib.import_module(".".join(path.relative_to(package.parent).with_suffix("").parts))
        for _, cls in inspect.getmembers(module, inspect.isclass):
            if issubclass(cls, BaseSettings) and cls.__module__ == module.__name__:
                found.append(cls)
    return found


def settings_fields() -> dict[str, tuple[str, Any]]:
    """Environment variable -> (field name, field info), over all settings classes."""
    fields: dict[str, tuple[str, Any]] = {}
    for cls in settings_classes():
        prefix = cls.model_config.get("env_prefix", "")
        for name, info in cls.model_fields.items():
            fields[f"{prefix}{name}".upper()] = (name, info)
    return fields


def render_default(info: Any) -> str:
    """How the README writes a default: `value` in backticks, `unset` for None (the description says what then)."""
    value = info.get_default(call_default_factory=True)
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return f"`{value}`"


def readme_rows() -> dict[str, list[str]]:
    """Environment variable -> the cells of its row in the README's configuration reference."""
    text = (REPO / "README.md").read_text()
    assert SECTION in text, f"README.md has no '{SECTION}' section"
    section = text.split(SECTION, 1)[1].split("\n## ", 1)[0]
    rows: dict[str, list[str]] = {}
    for line in section.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        match = re.fullmatch(r"`([A-Z][A-Z0-9_]*)`", cells[0]) if line.startswith("|") else None
        if match:
            rows[match.group(1)] = cells
    return rows


def worker_flags() -> dict[str, list[str]]:
    """Field name -> the `tokenmill worker` flags that set it."""
    worker = build_parser()._subparsers._group_actions[0].choices["worker"]
    return {action.dest: list(action.option_strings) for action in worker._actions if action.option_strings}


def suggested_row(variable: str, name: str, info: Any) -> str:
    flags = ", ".join(f"`{flag}`" for flag in worker_flags().get(name, [])) or "–"
    return f"| `{variable}` | {flags} | {render_default(info)} | {info.description} |"


def test_the_scan_finds_the_worker_settings() -> None:
    names = {cls.__name__ for cls in settings_classes()}
    assert {"QueueSettings", "WorkerSettings"} <= names
    assert "TOKENMILL_BROKER_URL" in settings_fields() and "TOKENMILL_MODEL" in settings_fields()


def test_every_setting_has_a_readme_row() -> None:
    rows = readme_rows()
    missing = {var: field for var, field in settings_fields().items() if var not in rows}
    suggestions = "\n".join(suggested_row(var, name, info) for var, (name, info) in missing.items())
    assert not missing, f"settings missing from README '{SECTION}'; add these rows:\n{suggestions}"


def test_every_readme_row_is_a_setting() -> None:
    stale = sorted(set(readme_rows()) - set(settings_fields()))
    assert not stale, f"README '{SECTION}' documents settings that do not exist: {stale}"


def test_readme_defaults_and_flags_match_the_settings() -> None:
    rows, flags = readme_rows(), worker_flags()
    wrong = []
    for variable, (name, info) in settings_fields().items():
        cells = rows.get(variable)
        if cells is None or len(cells) < 4:
            continue  # reported by test_every_setting_has_a_readme_row
        if cells[2] != render_default(info):
            wrong.append(f"{variable}: README default {cells[2]}, settings say {render_default(info)}")
        for flag in flags.get(name, []):
            if f"`{flag}`" not in cells[1]:
                wrong.append(f"{variable}: README flags {cells[1]!r} lack `{flag}`")
    assert not wrong, "\n".join(wrong)


# -- docker-compose.yml ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return yaml.safe_load((REPO / "docker-compose.yml").read_text())


def test_compose_sets_only_real_settings(compose: dict[str, Any]) -> None:
    known = set(settings_fields())
    for service in ("worker", "worker-cpu"):
        env = compose["services"][service]["environment"]
        unknown = sorted(k for k in env if k.startswith("TOKENMILL_") and k not in known)
        assert not unknown, f"{service} sets variables no settings class reads: {unknown}"


def test_compose_redis_never_drops_jobs_and_workers_outlive_their_grace(compose: dict[str, Any]) -> None:
    services = compose["services"]
    redis_command = services["redis"]["command"]
    # README "Durability": everysec unless .env sets REDIS_APPENDFSYNC
    fsync = "${REDIS_APPENDFSYNC:-everysec}"
    for flag, value in (("--appendonly", "yes"), ("--appendfsync", fsync), ("--maxmemory-policy", "noeviction")):
        assert redis_command[redis_command.index(flag) + 1] == value
    for service in ("worker", "worker-cpu"):
        worker = services[service]
        grace = float(worker["environment"]["TOKENMILL_SHUTDOWN_GRACE"])
        assert float(worker["stop_grace_period"].rstrip("s")) > grace
        assert worker["restart"] == "unless-stopped"
    gpu = services["worker"]["deploy"]["resources"]["reservations"]["devices"][0]
    assert gpu["driver"] == "nvidia" and gpu["capabilities"] == ["gpu"]
    assert services["worker"]["build"]["args"]["TORCH_VARIANT"] == "cuda"
    assert services["worker-cpu"]["build"]["args"]["TORCH_VARIANT"] == "cpu"


#: What docker-compose.yml must take from .env, with no usable default (README "Docker compose").
CREDENTIALS = ("REDIS_PASSWORD", "MINIO_ROOT_USER", "MINIO_ROOT_PASSWORD", "MINIO_WORKER_USER", "MINIO_WORKER_PASSWORD",
               "MINIO_API_USER", "MINIO_API_PASSWORD", "FLOWER_USER", "FLOWER_PASSWORD", "API_KEY")


def test_compose_credentials_come_from_env_with_no_default(compose: dict[str, Any]) -> None:
    text = (REPO / "docker-compose.yml").read_text()
    for name in CREDENTIALS:
        uses = re.findall(r"\$\{" + name + r"([^}]*)\}", text)
        assert uses and all(use.startswith(":?set ") for use in uses), f"{name}: {uses} (want ${{{name}:?set ...}})"
    services = compose["services"]
    redis_command = services["redis"]["command"]
    assert redis_command[redis_command.index("--requirepass") + 1].startswith("${REDIS_PASSWORD:?")
    for service in ("worker", "worker-cpu", "flower", "api"):
        assert services[service]["environment"]["TOKENMILL_BROKER_URL"].startswith("redis://:${REDIS_PASSWORD:?"), service
    for service in ("worker", "worker-cpu"):
        env = services[service]["environment"]
        assert env["AWS_ACCESS_KEY_ID"].startswith("${MINIO_WORKER_USER:?"), service  # never MinIO's root
        assert env["TOKENMILL_OUTPUT_PREFIXES"] == "s3://${RESULTS_BUCKET:-results}/"
        assert env["TOKENMILL_METRICS_ADDR"] == "0.0.0.0"  # Prometheus scrapes worker:9400 in the network
    assert services["flower"]["environment"]["FLOWER_BASIC_AUTH"].startswith("${FLOWER_USER:?")
    api = services["api"]["environment"]
    assert api["TOKENMILL_API_KEYS"].startswith("default=${API_KEY:?")
    assert api["AWS_ACCESS_KEY_ID"].startswith("${MINIO_API_USER:?")  # its own MinIO user, never root's
    assert all(port.startswith("127.0.0.1:") for port in services["api"]["ports"])
    assert "FLOWER_UNAUTHENTICATED_API" not in text
    example = (REPO / ".env.example").read_text()
    for name in CREDENTIALS:
        assert re.search(rf"^{name}=$", example, re.MULTILINE), f".env.example must list {name}= (empty: no default)"


def test_compose_without_credentials_stops_saying_what_to_set(tmp_path: Path) -> None:
    import shutil
    import subprocess

    binary = shutil.which("docker-compose")
    if binary is None:
        pytest.skip("docker-compose is not installed")
    (tmp_path / "docker-compose.yml").write_text((REPO / "docker-compose.yml").read_text())
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    done = subprocess.run([binary, "--profile", "cpu", "config"], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode != 0 and "set REDIS_PASSWORD in .env" in done.stderr, done.stderr
    values = {name: f"value-{name.lower()}" for name in CREDENTIALS}
    (tmp_path / ".env").write_text("".join(f"{k}={v}\n" for k, v in values.items()))
    done = subprocess.run([binary, "--profile", "cpu", "config"], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    rendered = yaml.safe_load(done.stdout)["services"]
    assert rendered["worker-cpu"]["environment"]["TOKENMILL_BROKER_URL"] == "redis://:value-redis_password@redis:6379/0"
    assert rendered["worker-cpu"]["environment"]["AWS_ACCESS_KEY_ID"] == "value-minio_worker_user"
    assert rendered["flower"]["environment"]["FLOWER_BASIC_AUTH"] == "value-flower_user:value-flower_password"
