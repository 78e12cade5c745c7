#!/usr/bin/env bash
# Upgrade the locked dependencies as one tested step: every package to the newest release pyproject.toml allows,
# then the README's test command in a fresh virtual environment installed from the new lock.
#
#   scripts/upgrade_deps.sh            # exit 0: both locks upgraded and the suite green; commit them
#                                      # exit 1: the suite failed; the locks are put back as they were and the
#                                      #         upgraded ones kept as *.upgraded beside them, to bisect
#
# A version that breaks a test is found here, by whoever upgrades, and never by a new user: the README's test
# command and .ci/run install the committed lock, never whatever a registry published overnight.
# TOKENMILL_UPGRADE_VENV (default: a new temporary directory) is where the suite's environment is made.
set -euo pipefail
cd "$(dirname "$0")/.."
LOCKS=(requirements/test.lock docker/requirements.lock)
saved="$(mktemp -d)"
venv="${TOKENMILL_UPGRADE_VENV:-$saved/venv}"
cleanup() { rm -rf "$saved"; }
trap cleanup EXIT
for lock in "${LOCKS[@]}"; do cp "$lock" "$saved/$(basename "$lock")"; done

bash scripts/lock.sh --upgrade
echo "changed pins:"
for lock in "${LOCKS[@]}"; do
    diff <(grep -E '^[A-Za-z]' "$saved/$(basename "$lock")") <(grep -E '^[A-Za-z]' "$lock") | sed -n "s|^[<>] |  $lock: &|p" || true
done

python3 -m venv "$venv"
status=0
(
    # The README's test command, in the new environment.
    export PATH="$venv/bin:$PATH"
    python -m pip install -q -c requirements/test.lock -e ".[test]" \
        && python -m pytest -q -n 3 --dist loadfile -p no:cacheprovider
) || status=$?
if [ "$status" -ne 0 ]; then
    for lock in "${LOCKS[@]}"; do
        mv "$lock" "$lock.upgraded" && cp "$saved/$(basename "$lock")" "$lock"
    done
    echo "upgrade_deps: the suite failed (exit $status) on the upgraded lock: the locks are back as they were;" \
         "the upgraded ones are requirements/test.lock.upgraded and docker/requirements.lock.upgraded" >&2
    exit 1
fi
echo "upgrade_deps: the suite passed on the upgraded lock: commit requirements/test.lock and docker/requirements.lock" \
     "(and run scripts/compose_smoke.sh for the images)"
