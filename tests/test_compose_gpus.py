"""docker-compose.yml gives every GPU worker a GPU of its own, and the docs promise nothing else.

A service that reserves `count: 1` GPU and is scaled (`--scale worker=4`, `deploy.replicas`) gives every replica
the same GPU: compose cannot hand replicas distinct devices (docker/compose#11863). So each GPU worker is its own
service pinned with `device_ids`, all from one shared definition, and the profiles `gpu`, `gpu2`, `gpu4`, ... start
the workers of GPUs 0..N-1. Read with pyyaml (compose's own `config` is not installed here); the checks are run on
the old layout too, so they can fail.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parent.parent
COMPOSE = REPO / "docker-compose.yml"
#: Where a reader could be told how to scale GPU workers.
DOCS = [REPO / "README.md", COMPOSE, *sorted((REPO / "docs").rglob("*.md"))]
#: What may differ between two GPU worker services: which profiles start them and which GPU they reserve.
PER_GPU_KEYS = {"profiles", "deploy"}
#: `--scale SERVICE=N`, as compose takes it.
SCALE = re.compile(r"--scale[ =]([A-Za-z0-9][A-Za-z0-9_.-]*)=")
#: Sentences that promise one GPU per replica (whitespace folded first).
PER_REPLICA_CLAIM = re.compile(r"\bGPUs?\b[^.;:()]*\bper replica\b|\bone GPU each\b", re.IGNORECASE)

#: The layout this replaced (one GPU service with `count: 1`, scaled with --scale), to show the checks catch it.
OLD_LAYOUT = """
services:
  worker:
    profiles: ["gpu"]
    image: tokenmill:cuda
    build: {context: ., target: worker, args: {TORCH_VARIANT: cuda}}
    deploy:
      resources:
        reservations:
          devices:
            - driver: nvidia
              count: 1                                  # one GPU per replica; use device_ids to pin GPUs
              capabilities: [gpu]
  worker-cpu:
    profiles: ["cpu"]
    image: tokenmill:cpu
    build: {context: ., target: worker, args: {TORCH_VARIANT: cpu}}
"""
OLD_DOC = """- **Scaling out**: `docker compose --profile gpu up -d --scale worker=4` (one GPU each; on a host with
  fewer GPUs the extra replicas do not start) or `--scale worker-cpu=N`."""


def load(text: str) -> dict[str, Any]:
    return yaml.safe_load(text)


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return load(COMPOSE.read_text())


def devices(service: dict[str, Any]) -> list[dict[str, Any]]:
    """The service's device reservations (`deploy.resources.reservations.devices`)."""
    reservations = ((service.get("deploy") or {}).get("resources") or {}).get("reservations") or {}
    return reservations.get("devices") or []


def gpu_services(compose: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Services that reserve a device or run the CUDA image."""
    def is_gpu(service: dict[str, Any]) -> bool:
        cuda = ((service.get("build") or {}).get("args") or {}).get("TORCH_VARIANT") == "cuda"
        return bool(devices(service)) or cuda or str(service.get("image", "")).endswith(":cuda")
    return {name: service for name, service in compose["services"].items() if is_gpu(service)}


def device_problems(compose: dict[str, Any]) -> list[str]:
    """What would put two workers on one GPU, or a worker on none."""
    wrong, owner = [], {}
    services = gpu_services(compose)
    if len(services) < 2:
        wrong.append(f"GPU worker services {sorted(services)}: one service per GPU is the only way to several GPUs")
    for name, service in services.items():
        requests = devices(service)
        if len(requests) != 1:
            wrong.append(f"{name}: {len(requests)} device reservations, want one (one GPU per worker)")
        for request in requests:
            if "count" in request:
                wrong.append(f"{name}: reserves count {request['count']!r}: every replica would get the same GPU "
                             "(docker/compose#11863); pin it with device_ids")
            ids = [str(device) for device in request.get("device_ids") or []]
            if len(ids) != 1:
                wrong.append(f"{name}: device_ids {ids}, want exactly one GPU")
            for device in ids:
                if device in owner:
                    wrong.append(f"GPU {device}: reserved by both {owner[device]} and {name}")
                owner[device] = name
            if request.get("driver") != "nvidia" or "gpu" not in (request.get("capabilities") or []):
                wrong.append(f"{name}: {request} (want driver nvidia, capabilities [gpu])")
        replicas = (service.get("deploy") or {}).get("replicas", 1)
        if replicas != 1 or service.get("scale", 1) != 1:
            wrong.append(f"{name}: {replicas} replicas / scale {service.get('scale')}: they would share its GPU")
    return wrong


def scale_problems(text: str, gpu_names: set[str]) -> list[str]:
    """`--scale` of a GPU service, or a sentence promising one GPU per replica."""
    folded = " ".join(text.split())
    wrong = [f"`--scale {name}=N`: its replicas would share one GPU" for name in SCALE.findall(folded)
             if name in gpu_names]
    wrong += [f"promises one GPU per replica: {match.group(0)!r}" for match in PER_REPLICA_CLAIM.finditer(folded)]
    return wrong


def test_each_gpu_worker_reserves_a_gpu_of_its_own(compose: dict[str, Any]) -> None:
    wrong = device_problems(compose)
    assert not wrong, "docker-compose.yml:\n" + "\n".join(wrong)


def test_the_profiles_start_the_workers_of_gpus_0_to_n(compose: dict[str, Any]) -> None:
    services = gpu_services(compose)
    profiles = sorted({profile for service in services.values() for profile in service.get("profiles") or []})
    assert "gpu" in profiles and "gpu2" in profiles, profiles
    assert all(service.get("profiles") for service in services.values()), "a GPU worker without a profile"
    for profile in profiles:
        match = re.fullmatch(r"gpu(\d*)", profile)
        assert match, f"GPU worker profile {profile!r}: want gpu or gpuN"
        count = int(match.group(1) or 1)
        started = [name for name, service in services.items() if profile in service["profiles"]]
        ids = sorted(str(device) for name in started for device in devices(services[name])[0]["device_ids"])
        assert ids == sorted(str(i) for i in range(count)), f"--profile {profile} starts {started} on GPUs {ids}"
    assert "worker" in services and devices(services["worker"])[0]["device_ids"] == ["0"], "worker is GPU 0"
    cpu = compose["services"]["worker-cpu"]
    assert cpu["profiles"] == ["cpu"] and not devices(cpu), "the CPU worker reserves no GPU"


def test_the_gpu_workers_share_one_definition(compose: dict[str, Any]) -> None:
    services = gpu_services(compose)
    first = {k: v for k, v in services["worker"].items() if k not in PER_GPU_KEYS}
    for name, service in services.items():
        rest = {k: v for k, v in service.items() if k not in PER_GPU_KEYS}
        assert rest == first, f"{name} differs from worker beyond its profiles and GPU: " \
                              f"{sorted(k for k in set(rest) | set(first) if rest.get(k) != first.get(k))}"
    assert first["build"]["args"]["TORCH_VARIANT"] == "cuda" and first["image"].endswith(":cuda")
    text = COMPOSE.read_text()
    assert text.count("<<: *gpu-worker") == len(services), "each GPU service merges the x-gpu-worker anchor"


def test_no_doc_says_scale_gives_each_replica_a_gpu(compose: dict[str, Any]) -> None:
    names = set(gpu_services(compose))
    wrong = [f"{path.relative_to(REPO)}: {problem}" for path in DOCS for problem in scale_problems(path.read_text(), names)]
    assert not wrong, "\n".join(wrong)
    assert "compose#11863" in (REPO / "docs" / "guides" / "compose.md").read_text(), "the guide says why"


def test_the_checks_catch_the_old_layout() -> None:
    old = load(OLD_LAYOUT)
    wrong = device_problems(old)
    assert any("count 1" in problem for problem in wrong) and any("one service per GPU" in p for p in wrong), wrong
    assert any("share" in problem for problem in device_problems(load(OLD_LAYOUT.replace(
        '    profiles: ["gpu"]\n', '    profiles: ["gpu"]\n    scale: 4\n', 1))))
    problems = scale_problems(OLD_DOC + "\n" + OLD_LAYOUT, set(gpu_services(old)))
    assert any("--scale worker=" in p for p in problems), problems
    assert any("one GPU each" in p for p in problems) and any("per replica" in p for p in problems), problems
    assert not scale_problems("`--scale worker-cpu=4`", set(gpu_services(old)))
    pinned = "{deploy: {resources: {reservations: {devices: [{driver: nvidia, device_ids: ['0'], capabilities: [gpu]}]}}}}"
    two_on_one = load(f"services: {{worker: {pinned}, worker-gpu1: {pinned}}}")
    assert any("GPU 0: reserved by both worker and worker-gpu1" in p for p in device_problems(two_on_one))
