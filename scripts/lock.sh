#!/usr/bin/env bash
# Regenerate the two locks from pyproject.toml with uv (`uv pip compile`), keeping every pin that still satisfies
# pyproject.toml's ranges; `--upgrade` moves every package to the newest release those ranges allow.
#
#   requirements/test.lock   every extra: what the README's test command and .ci/run install (`pip install -c`)
#   docker/requirements.lock the images' packages: worker, flower, annotate and serve, torch left out (the
#                            Dockerfile installs torch by variant, CPU or CUDA, before the lock)
#
# Both are resolved for CPython 3.11 on x86_64 Linux with glibc 2.36 (Debian bookworm: the image's base and these
# machines), whatever the machine running this script, with the CPU torch wheel from $TORCH_WHEELS (default
# /opt/wheels) for torch==2.13.0. triton is pinned in the image lock to the version the CUDA build of torch
# requires, so both image variants share one lock. `scripts/upgrade_deps.sh` upgrades and runs the suite.
set -euo pipefail
cd "$(dirname "$0")/.."
UV_VERSION=0.13.9
TRITON_FOR_CUDA_TORCH="${TRITON_VERSION:-3.7.1}"   # torch==2.13.0 (PyPI, CUDA) requires triton==3.7.1
upgrade=()
case "${1:-}" in
    "") ;;
    --upgrade) upgrade=(--upgrade) ;;
    *) echo "usage: scripts/lock.sh [--upgrade]" >&2; exit 2 ;;
esac

tools="${TOKENMILL_LOCK_TOOLS:-${XDG_CACHE_HOME:-$HOME/.cache}/tokenmill-lock-tools}"
if [ "$("$tools/bin/uv" --version 2>/dev/null | cut -d' ' -f2)" != "$UV_VERSION" ]; then
    python3 -m venv "$tools" && "$tools/bin/pip" install -q "uv==$UV_VERSION"
fi
compile=("$tools/bin/uv" pip compile --quiet --python-version 3.11 --python-platform x86_64-manylinux_2_36
         --find-links "${TORCH_WHEELS:-/opt/wheels}" --custom-compile-command "scripts/lock.sh" "${upgrade[@]}")

"${compile[@]}" pyproject.toml --all-extras -o requirements/test.lock
echo "wrote requirements/test.lock ($(grep -c '^[A-Za-z]' requirements/test.lock) packages)"

image_only="$(mktemp)"
trap 'rm -f "$image_only"' EXIT
echo "triton==${TRITON_FOR_CUDA_TORCH}" > "$image_only"
"${compile[@]}" pyproject.toml "$image_only" --extra worker --extra flower --extra annotate --extra serve \
    --no-emit-package torch -o docker/requirements.lock
sed -i "s|$image_only|scripts/lock.sh: triton for the CUDA torch|" docker/requirements.lock
echo "wrote docker/requirements.lock ($(grep -c '^[A-Za-z]' docker/requirements.lock) packages)"
