"""The generated reference pages against the code, and docker-compose.yml against the settings.

docs/reference/configuration.md is generated from every pydantic-settings class of the package and
docs/reference/cli.md from the argparse parsers (`python docs/hooks/generated.py`); both are committed, and
these tests fail while either differs from what the code gives, so adding, renaming or re-defaulting a
setting or a flag without regenerating the docs fails here, naming the command to run. The row checks below
say which setting is missing or wrong. The compose file may only set variables that exist.
"""

from __future__ import annotations

import difflib
import importlib.util
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parent.parent
CONFIGURATION = REPO / "docs" / "reference" / "configuration.md"
CLI = REPO / "docs" / "reference" / "cli.md"


def load_generator() -> Any:
    spec = importlib.util.spec_from_file_location("docs_generated", REPO / "docs" / "hooks" / "generated.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


generated = load_generator()
settings_fields = generated.settings_fields
render_default = generated.render_default
worker_flags = generated.worker_flags


def differences(path: Path, want: str) -> str:
    have = path.read_text() if path.exists() else ""
    diff = difflib.unified_diff(have.splitlines(), want.splitlines(), "committed", "generated", lineterm="", n=1)
    return "\n".join(list(diff)[:60])


def page_rows() -> dict[str, list[str]]:
    """Environment variable -> the cells of its row in the configuration reference page."""
    rows: dict[str, list[str]] = {}
    for line in CONFIGURATION.read_text().splitlines():
        cells = [cell.strip() for cell in re.split(r"(?<!\\)\|", line.strip().strip("|"))]
        match = re.fullmatch(r"`([A-Z][A-Z0-9_]*)`", cells[0]) if line.startswith("|") else None
        if match:
            rows[match.group(1)] = cells
    return rows


def test_the_scan_finds_the_worker_settings() -> None:
    names = {cls.__name__ for cls in generated.settings_classes()}
    assert {"QueueSettings", "WorkerSettings", "ServeSettings"} <= names
    assert "TOKENMILL_BROKER_URL" in settings_fields() and "TOKENMILL_MODEL" in settings_fields()


@pytest.mark.parametrize("name", sorted(generated.PAGES))
def test_the_committed_page_is_what_the_code_generates(name: str) -> None:
    want = generated.PAGES[name]()
    path = REPO / "docs" / name
    assert path.exists() and path.read_text() == want, (
        f"docs/{name} differs from the code: run `{generated.REGENERATE}` and commit it\n{differences(path, want)}")


def test_every_setting_has_a_row_with_its_flags_and_default() -> None:
    rows, flags = page_rows(), worker_flags()
    wrong = []
    for variable, (name, info) in settings_fields().items():
        cells = rows.get(variable)
        if cells is None or len(cells) < 4:
            wrong.append(f"{variable}: no row")
            continue
        if cells[2] != render_default(info):
            wrong.append(f"{variable}: page default {cells[2]}, settings say {render_default(info)}")
        for flag in flags.get(name, []):
            if f"`{flag}`" not in cells[1]:
                wrong.append(f"{variable}: page flags {cells[1]!r} lack `{flag}`")
    assert not wrong, "\n".join(wrong)


def test_every_row_is_a_setting() -> None:
    stale = sorted(set(page_rows()) - set(settings_fields()))
    assert not stale, f"{CONFIGURATION.relative_to(REPO)} documents settings that do not exist: {stale}"


def test_every_command_and_flag_is_on_the_cli_page() -> None:
    text = CLI.read_text()
    missing = []

    def walk(parser: Any) -> None:
        if f"`{parser.prog}`" not in text:
            missing.append(parser.prog)
        for action in parser._actions:
            for flag in action.option_strings:
                if flag not in ("-h", "--help") and f"`{flag}`" not in text:
                    missing.append(f"{parser.prog} {flag}")
        for child in generated.subcommands(parser).values():
            walk(child)

    walk(generated.build_parser())
    assert not missing, f"{CLI.relative_to(REPO)} lacks {missing}: run `{generated.REGENERATE}`"


def test_the_generator_follows_a_changed_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    """The check can fail: a new default in a settings class changes the generated page (and its row)."""
    from tokenmill.worker.settings import WorkerSettings

    before = generated.configuration_page()
    field = WorkerSettings.model_fields["max_deliveries"]
    monkeypatch.setattr(field, "default", 7)
    after = generated.configuration_page()
    assert after != before and "| `TOKENMILL_MAX_DELIVERIES` | `--max-deliveries` | `7` |" in after


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
    # docs/guides/delivery-guarantees.md "Durability": everysec unless .env sets REDIS_APPENDFSYNC
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


#: What docker-compose.yml must take from .env, with no usable default (docs/guides/compose.md).
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
