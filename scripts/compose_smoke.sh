#!/usr/bin/env bash
# The compose test: real containers from docker-compose.yml (CPU profile), jobs from the host, a killed
# worker, then `down -v`. Exits non-zero on any failure, including when Docker cannot run here at all.
#
#   sudo scripts/compose_smoke.sh          # root: installs Docker from Debian and starts its own daemon
#
# 1. Installs Docker Engine, compose and debootstrap from the distribution's packages if missing.
#    (Debian bookworm packages compose v1, `docker-compose` 1.29; `docker compose` v2 is used when present.)
# 2. Starts a private dockerd (own socket, data root under $TOKENMILL_COMPOSE_CACHE, no iptables, no
#    bridge: the test uses host networking only) and stops it on exit.
# 3. Makes the base image from Debian packages (debootstrap, `docker import`): no image is ever pulled.
# 4. Builds tokenmill:cpu, tokenmill:flower and tokenmill:api from the Dockerfile on that base (torch from the CPU wheel
#    this machine's pip finds locally, served on loopback; the rest from PyPI), plus Redis and S3 (moto)
#    stand-ins. Builds use the host network (`--network host`).
# 5. Generates the credentials docker-compose.yml requires (Redis password, MinIO root and worker keys,
#    Flower basic auth, the api's key and MinIO user: random for each run) into an env file, then
#    `compose -f docker-compose.yml -f scripts/compose-smoke/compose.smoke.yml --profile cpu up -d`, waits
#    for health, and runs scripts/compose_smoke_check.py from the host (see there for the checks).
# 6. `compose down -v`, and checks that nothing is left.
#
# Everything built is cached in $TOKENMILL_COMPOSE_CACHE (default /var/cache/tokenmill-compose): the base
# rootfs tarball, the torch wheel and Docker's data root with its layers, so a rerun on the same machine rebuilds only what
# changed. Ports (loopback only): SMOKE_{REDIS,S3,METRICS,FLOWER,WHEELS,API}_PORT, defaults 16379, 19000,
# 19400, 15555, 18000, 18080: below Linux's ephemeral range (32768-60999), where the outgoing connections and
# "free port" picks of other processes on the machine could take them mid-run.
set -euo pipefail
cd "$(dirname "$0")/.."
REPO="$PWD"

CACHE="${TOKENMILL_COMPOSE_CACHE:-/var/cache/tokenmill-compose}"
RUN_DIR="${TOKENMILL_COMPOSE_RUN:-/run/tokenmill-compose}"
export DOCKER_HOST="unix://$RUN_DIR/docker.sock"
# Debian's client, the same version as Debian's daemon (another `docker` earlier on PATH may be a client
# of a different version, or a client without the classic builder).
DOCKER=/usr/bin/docker
export SMOKE_REDIS_PORT="${SMOKE_REDIS_PORT:-16379}" SMOKE_S3_PORT="${SMOKE_S3_PORT:-19000}"
export SMOKE_METRICS_PORT="${SMOKE_METRICS_PORT:-19400}" SMOKE_FLOWER_PORT="${SMOKE_FLOWER_PORT:-15555}"
SMOKE_WHEELS_PORT="${SMOKE_WHEELS_PORT:-18000}"
export SMOKE_API_PORT="${SMOKE_API_PORT:-18080}"
export COMPOSE_PROJECT_NAME=tokenmill-smoke DOCKER_BUILDKIT=0 COMPOSE_DOCKER_CLI_BUILD=0
BASE_IMAGE=tokenmill-base:bookworm
TORCH_VERSION=2.13.0
COMPOSE=()
STARTED_DAEMON=0
STACK_UP=0
WHEEL_SERVER=
T0=$SECONDS

log() { echo "[compose-smoke +$((SECONDS - T0))s] $*"; }
fail() { echo "compose-smoke: FAILED: $*" >&2; exit 1; }

cleanup() {
    local rc=$?
    if [ "$STACK_UP" = 1 ]; then
        if [ "$rc" != 0 ]; then
            log "failure: last worker log lines and container states"
            "${COMPOSE[@]}" ps || true
            "${COMPOSE[@]}" logs --no-color > "$CACHE/compose-failure.log" 2>&1 || true
            grep -v "pidbox received" "$CACHE/compose-failure.log" | tail -40 || true
            log "all container logs: $CACHE/compose-failure.log"
        fi
        "${COMPOSE[@]}" down -v --remove-orphans >/dev/null 2>&1 || true
    fi
    if [ -n "$WHEEL_SERVER" ]; then kill "$WHEEL_SERVER" 2>/dev/null || true; fi
    rm -f "${ENV_FILE:-}"
    if [ "$STARTED_DAEMON" = 1 ] && [ -f "$RUN_DIR/dockerd.pid" ]; then
        kill "$(cat "$RUN_DIR/dockerd.pid")" 2>/dev/null || true
        for _ in $(seq 30); do [ -e "$RUN_DIR/dockerd.pid" ] || break; sleep 0.5; done
    fi
    if [ "$rc" = 0 ]; then log "PASSED in $((SECONDS - T0))s"; else echo "compose-smoke: FAILED (exit $rc)" >&2; fi
}
trap cleanup EXIT

install_packages() {
    local missing=()
    [ -x /usr/sbin/dockerd ] && [ -x /usr/bin/docker ] || missing+=(docker.io)
    command -v docker-compose >/dev/null 2>&1 || "$DOCKER" compose version >/dev/null 2>&1 || missing+=(docker-compose)
    command -v debootstrap >/dev/null 2>&1 || missing+=(debootstrap)
    [ ${#missing[@]} = 0 ] && return 0
    [ "$(id -u)" = 0 ] || fail "need root to install ${missing[*]} (apt-get) and to run dockerd"
    log "installing ${missing[*]} from Debian"
    # No package may start a service on install: the daemon is started below, with this test's options.
    local guard=0
    if [ ! -e /usr/sbin/policy-rc.d ]; then printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d; chmod +x /usr/sbin/policy-rc.d; guard=1; fi
    export DEBIAN_FRONTEND=noninteractive
    local rc=0
    if ! { apt-get update -qq && apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null; }; then rc=1; fi
    if [ "$guard" = 1 ]; then rm -f /usr/sbin/policy-rc.d; fi
    [ "$rc" = 0 ] || fail "apt-get install ${missing[*]} failed"
}

secret() { python3 -c "import secrets; print(secrets.token_hex(16))"; }

make_env_file() {
    # compose has no default credentials: this run's are made here, readable by root only.
    mkdir -p "$RUN_DIR"
    REDIS_PASSWORD="$(secret)" MINIO_ROOT_USER="root-$(secret | cut -c1-8)" MINIO_ROOT_PASSWORD="$(secret)"
    MINIO_WORKER_USER="worker-$(secret | cut -c1-8)" MINIO_WORKER_PASSWORD="$(secret)"
    FLOWER_USER="flower-$(secret | cut -c1-8)" FLOWER_PASSWORD="$(secret)"
    MINIO_API_USER="api-$(secret | cut -c1-8)" MINIO_API_PASSWORD="$(secret)" API_KEY="sk-$(secret)"
    ENV_FILE="$RUN_DIR/smoke.env"
    (umask 077; {
        cat scripts/compose-smoke/smoke.env
        for name in REDIS_PASSWORD MINIO_ROOT_USER MINIO_ROOT_PASSWORD MINIO_WORKER_USER MINIO_WORKER_PASSWORD \
                    FLOWER_USER FLOWER_PASSWORD MINIO_API_USER MINIO_API_PASSWORD API_KEY; do
            echo "$name=${!name}"
        done
    } > "$ENV_FILE")
}

pick_compose() {
    if "$DOCKER" compose version >/dev/null 2>&1; then COMPOSE=("$DOCKER" compose); else COMPOSE=(docker-compose); fi
    log "compose: $("${COMPOSE[@]}" version --short 2>/dev/null || echo '?') (${COMPOSE[*]})"
    # --env-file: a developer's own .env in the checkout must not change what the test runs.
    COMPOSE+=(--env-file "$ENV_FILE")
}

render_compose() {
    # docker-compose.yml + the test override, merged and resolved by compose itself; then the published
    # ports are dropped from the host-network services and the GPU worker is left out (with host networking nothing is published, and
    # compose refuses the combination; compose v1 has no way to remove a list entry in an override).
    local rendered="$RUN_DIR/compose.smoke.rendered.yml"
    "${COMPOSE[@]}" -f docker-compose.yml -f scripts/compose-smoke/compose.smoke.yml --profile cpu config > "$rendered.tmp" \
        || fail "compose config failed"
    python3 - "$rendered.tmp" > "$rendered" <<'PY'
import sys, yaml
config = yaml.safe_load(open(sys.argv[1]))
for name, service in list(config["services"].items()):
    if service.get("profiles") and "cpu" not in service["profiles"]:
        del config["services"][name]  # the GPU worker: not part of this run
        continue
    assert service.get("network_mode") == "host", "every service of the test runs on the host network"
    service.pop("ports", None)
yaml.safe_dump(config, sys.stdout, sort_keys=False)
PY
    rm -f "$rendered.tmp"
    COMPOSE+=(-f "$rendered" --profile cpu)
}

start_daemon() {
    mkdir -p "$CACHE/docker" "$RUN_DIR"
    if "$DOCKER" version >/dev/null 2>&1; then
        log "a dockerd already answers on $DOCKER_HOST; using it"
        return
    fi
    [ "$(id -u)" = 0 ] || fail "Docker cannot run: starting dockerd needs root (this is uid $(id -u))"
    local driver
    for driver in overlay2 fuse-overlayfs vfs; do
        log "starting dockerd (storage driver $driver)"
        dockerd --data-root "$CACHE/docker" --exec-root "$RUN_DIR/exec" --pidfile "$RUN_DIR/dockerd.pid" \
            -H "$DOCKER_HOST" --storage-driver "$driver" --iptables=false --ip-masq=false --bridge=none \
            > "$CACHE/dockerd.log" 2>&1 &
        STARTED_DAEMON=1
        local pid=$!
        for _ in $(seq 60); do
            if "$DOCKER" version >/dev/null 2>&1; then log "dockerd $("$DOCKER" version -f '{{.Server.Version}}') up"; return; fi
            kill -0 "$pid" 2>/dev/null || break
            sleep 1
        done
        kill "$pid" 2>/dev/null || true
        wait "$pid" 2>/dev/null || true
        STARTED_DAEMON=0
        tail -5 "$CACHE/dockerd.log" >&2
    done
    fail "Docker cannot run on this machine: dockerd did not start with any storage driver (log: $CACHE/dockerd.log)"
}

debian_mirror() {
    # The mirror apt already uses (deb822 or one-line sources), else Debian's CDN name.
    local uri
    uri="$(grep -hs '^URIs:' /etc/apt/sources.list.d/*.sources | awk '{print $2}' | grep -v security | head -1)"
    [ -n "$uri" ] || uri="$(grep -hs '^deb ' /etc/apt/sources.list | awk '{print $2}' | grep -v security | head -1)"
    echo "${uri:-http://deb.debian.org/debian}"
}

unmount_under() {
    # What an interrupted debootstrap may have left mounted (proc, sys) inside its target.
    findmnt -rn -o TARGET | grep "^$1/" | sort -r | xargs -r umount -l 2>/dev/null || true
}

make_base_image() {
    if "$DOCKER" image inspect "$BASE_IMAGE" >/dev/null 2>&1; then log "base image $BASE_IMAGE cached"; return; fi
    local tarball="$CACHE/base-bookworm.tar"
    if [ ! -s "$tarball" ]; then
        local root="$CACHE/rootfs.tmp" mirror
        mirror="$(debian_mirror)"
        unmount_under "$root"
        rm -rf "$root"
        log "debootstrap bookworm (minbase + python3) from $mirror"
        debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates bookworm "$root" "$mirror" \
            > "$CACHE/debootstrap.log" 2>&1 || { tail -20 "$CACHE/debootstrap.log" >&2; fail "debootstrap failed"; }
        # The base trusts what this machine trusts: with a TLS-intercepting proxy in front of the package
        # registries, pip and apt in the builds need its CA, which this machine has in its local CA store.
        if compgen -G "/usr/local/share/ca-certificates/*.crt" >/dev/null; then
            cp /usr/local/share/ca-certificates/*.crt "$root/usr/local/share/ca-certificates/"
            chroot "$root" update-ca-certificates >/dev/null 2>&1
        fi
        rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/* "$root"/tmp/*
        tar -C "$root" -c . > "$tarball.tmp" && mv "$tarball.tmp" "$tarball"
        rm -rf "$root"
    fi
    log "importing $tarball as $BASE_IMAGE"
    "$DOCKER" import "$tarball" "$BASE_IMAGE" >/dev/null
}

build_images() {
    # The CPU torch wheel: pip finds it where this machine keeps it (find-links, local indexes), into the
    # cache; a loopback HTTP server hands it to the builds as PIP_FIND_LINKS, so no image downloads torch
    # and no layer keeps a copy of the wheel.
    local wheels="$CACHE/wheels"
    mkdir -p "$wheels"
    if ! compgen -G "$wheels/torch-${TORCH_VERSION}+cpu-*.whl" >/dev/null; then
        python3 -m pip download -q --no-deps --only-binary=:all: -d "$wheels" "torch==${TORCH_VERSION}+cpu" 2>&1 \
            | grep -v "is ignored: it is neither a file nor a directory" || true
        compgen -G "$wheels/torch-${TORCH_VERSION}+cpu-*.whl" >/dev/null \
            || fail "no CPU wheel of torch ${TORCH_VERSION} reachable by pip here"
    fi
    python3 -m http.server --bind 127.0.0.1 --directory "$wheels" "$SMOKE_WHEELS_PORT" > "$CACHE/wheel-server.log" 2>&1 &
    WHEEL_SERVER=$!
    for _ in $(seq 50); do (exec 3<>"/dev/tcp/127.0.0.1/$SMOKE_WHEELS_PORT") 2>/dev/null && break; sleep 0.2; done
    kill -0 "$WHEEL_SERVER" 2>/dev/null || { cat "$CACHE/wheel-server.log" >&2; fail "the wheel server did not start"; }
    local started=$SECONDS
    build tokenmill:cpu . --target worker --build-arg TORCH_VARIANT=cpu --build-arg TORCH_CPU_INDEX= \
        --build-arg "PIP_FIND_LINKS=http://127.0.0.1:$SMOKE_WHEELS_PORT/"
    build tokenmill:flower . --target flower
    build tokenmill:api . --target api
    build tokenmill-smoke/redis:bookworm scripts/compose-smoke -f scripts/compose-smoke/redis.Dockerfile
    build tokenmill-smoke/s3:bookworm scripts/compose-smoke -f scripts/compose-smoke/s3.Dockerfile
    log "images built in $((SECONDS - started))s"
    kill "$WHEEL_SERVER" 2>/dev/null || true
    WHEEL_SERVER=
}

build() {
    local tag=$1 context=$2 started=$SECONDS
    shift 2
    log "building $tag"
    local out="$CACHE/build-${tag//[:\/]/-}.log"
    "$DOCKER" build --network host --build-arg "BASE_IMAGE=$BASE_IMAGE" -t "$tag" "$@" "$context" > "$out" 2>&1 \
        || { tail -30 "$out" >&2; fail "docker build of $tag failed (log: $out)"; }
    log "built $tag in $((SECONDS - started))s ($(grep -c 'Using cache' "$out") of $(grep -c '^Step ' "$out") steps from the cache)"
}

check_ports_free() {
    local port
    for port in "$@"; do
        if (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null; then fail "port $port on 127.0.0.1 is taken; set SMOKE_*_PORT"; fi
    done
}

wait_healthy() {
    local service=$1 limit=$2 id state=""
    id="$("${COMPOSE[@]}" ps -q "$service")"
    [ -n "$id" ] || fail "service $service has no container"
    for _ in $(seq "$limit"); do
        state="$("$DOCKER" inspect -f '{{.State.Health.Status}}' "$id")"
        [ "$state" = healthy ] && { log "$service healthy"; return; }
        sleep 1
    done
    "$DOCKER" inspect -f '{{json .State.Health}}' "$id" >&2
    fail "$service not healthy after ${limit}s (state: $state)"
}

install_packages
make_env_file
pick_compose
start_daemon
render_compose
make_base_image
check_ports_free "$SMOKE_WHEELS_PORT"
build_images
check_ports_free "$SMOKE_REDIS_PORT" "$SMOKE_S3_PORT" "$SMOKE_METRICS_PORT" "$SMOKE_FLOWER_PORT" "$SMOKE_API_PORT"

"${COMPOSE[@]}" down -v --remove-orphans >/dev/null 2>&1 || true   # leftovers of an interrupted run
log "compose up"
STACK_UP=1
"${COMPOSE[@]}" up -d --no-build || fail "compose up failed"
for service in redis minio flower api worker-cpu; do wait_healthy "$service" 180; done
init_state="$("$DOCKER" inspect -f '{{.State.Status}} {{.State.ExitCode}}' "$("${COMPOSE[@]}" ps -q minio-init)")"
[ "$init_state" = "exited 0" ] || fail "minio-init did not create the bucket ($init_state)"
networks="$("$DOCKER" network ls --format '{{.Name}}' | grep -vxE 'host|none' || true)"
[ -z "$networks" ] || fail "a network other than host/none exists: $networks"
log "up and healthy after $((SECONDS - T0))s; running the checks from the host"

PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}" python3 scripts/compose_smoke_check.py \
    --docker "$DOCKER" --compose "${COMPOSE[*]}" \
    --broker "redis://:$REDIS_PASSWORD@127.0.0.1:$SMOKE_REDIS_PORT/0" --s3 "http://127.0.0.1:$SMOKE_S3_PORT" \
    --s3-keys "$MINIO_ROOT_USER:$MINIO_ROOT_PASSWORD" --worker-s3-user "$MINIO_WORKER_USER" \
    --metrics "http://127.0.0.1:$SMOKE_METRICS_PORT/metrics" --flower "http://127.0.0.1:$SMOKE_FLOWER_PORT" \
    --flower-auth "$FLOWER_USER:$FLOWER_PASSWORD" --api "http://127.0.0.1:$SMOKE_API_PORT/v1" --api-key "$API_KEY"

log "compose down -v"
"${COMPOSE[@]}" down -v --remove-orphans
STACK_UP=0
left="$("$DOCKER" ps -aq --filter "label=com.docker.compose.project=$COMPOSE_PROJECT_NAME")"
[ -z "$left" ] || fail "containers left after down: $left"
volumes="$("$DOCKER" volume ls -q --filter "label=com.docker.compose.project=$COMPOSE_PROJECT_NAME")"
[ -z "$volumes" ] || fail "volumes left after down -v: $volumes"
