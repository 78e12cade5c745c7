# tokenmill image: the worker (CPU or CUDA torch, chosen by a build argument) and a small Flower image.
#
#   docker build -t tokenmill:cpu .                                   # CPU torch (PyTorch's CPU wheel index)
#   docker build -t tokenmill:cuda --build-arg TORCH_VARIANT=cuda .    # CUDA torch from PyPI (CUDA libraries as wheels)
#   docker build -t tokenmill:flower --target flower .                 # Celery's Flower + the light tokenmill, no torch
#   docker build -t tokenmill:api --target api .                       # `tokenmill serve` (the OpenAI Batch API), no torch
#
# Base images are build arguments (defaults: the usual public images), so the file builds wherever they
# are mirrored: --build-arg BASE_IMAGE=registry.example/python:3.11-slim-bookworm. A base without
# Python (plain Debian bookworm) gets Debian's python3, which is 3.11 as well. Versions are pinned:
# torch by TORCH_VERSION, everything else by docker/requirements.lock (scripts/lock.sh).
# PIP_FIND_LINKS (a build argument, e.g. http://127.0.0.1:8000/ serving a local CPU torch wheel; build
# with --network host) is searched before any index; TORCH_CPU_INDEX= stops pip asking PyTorch's index.
# Model weights are never baked in: they are downloaded at run time into $HF_HOME (a volume in
# docker-compose.yml).
# No `# syntax=` line: the file builds with BuildKit and with the classic builder alike. The classic
# builder runs every stage before its target, so the order is: python, wheel, flower, api, worker.

ARG BASE_IMAGE=python:3.11-slim-bookworm

# -- python: the base image plus a Python 3.11 that can make virtual environments -------------------
FROM ${BASE_IMAGE} AS python
RUN if ! python3 -c "import ensurepip, venv" 2>/dev/null; then \
        apt-get update \
        && apt-get install -y --no-install-recommends python3 python3-venv ca-certificates \
        && rm -rf /var/lib/apt/lists/*; \
    fi \
    && python3 -c "import sys; assert sys.version_info[:2] == (3, 11), sys.version" \
    && groupadd --gid 1000 tokenmill \
    && useradd --uid 1000 --gid 1000 --create-home --shell /usr/sbin/nologin tokenmill
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PATH=/opt/venv/bin:$PATH
COPY docker/requirements.lock /opt/requirements.lock

# -- wheel: tokenmill built into a wheel; its sources and build tools stay in this stage -------------
FROM python AS wheel
COPY pyproject.toml README.md /src/
COPY tokenmill /src/tokenmill
RUN python3 -m venv /opt/build && /opt/build/bin/pip wheel --no-deps --wheel-dir /dist /src

# -- flower: Celery's monitoring UI on the same broker, as `celery -A tokenmill.worker.app flower`: ---------
# tokenmill's own app, so Flower connects as the workers do (broker URL from TOKENMILL_BROKER_URL, rediss://
# with the certificate verified). Only the light tokenmill (no torch, no model): its dependencies are
# installed first (a layer that survives code changes), then the wheel without dependencies.
FROM python AS flower
RUN python3 -m venv /opt/venv \
    && pip install -c /opt/requirements.lock "celery[redis]" flower "redis[hiredis]" kombu pydantic pydantic-settings jsonschema \
        orjson
COPY --from=wheel /dist /opt/dist
RUN pip install --no-deps /opt/dist/tokenmill-*.whl && pip check && python3 -c "import tokenmill.worker.app"
USER tokenmill
WORKDIR /home/tokenmill
EXPOSE 5555
HEALTHCHECK --interval=15s --timeout=5s --start-period=30s --retries=3 \
    CMD ["python3", "-c", "import os, urllib.request; urllib.request.urlopen(f'http://127.0.0.1:{os.environ.get(\"FLOWER_PORT\", \"5555\")}/healthcheck', timeout=4)"]
ENTRYPOINT ["celery"]
CMD ["-A", "tokenmill.worker.app", "flower"]

# -- api: `tokenmill serve`, the OpenAI Files and Batches API in front of the queue. The light tokenmill plus the
# `serve` extra (FastAPI, uvicorn, pyarrow for the batch files, boto3 for files in S3/MinIO); no torch, no model.
FROM python AS api
RUN python3 -m venv /opt/venv \
    && pip install -c /opt/requirements.lock "celery[redis]" "redis[hiredis]" kombu pydantic pydantic-settings jsonschema \
        orjson pyarrow jinja2 rich tqdm fastapi uvicorn python-multipart boto3 standardwebhooks
COPY --from=wheel /dist /opt/dist
RUN pip install --no-deps /opt/dist/tokenmill-*.whl && pip check && tokenmill serve --help >/dev/null
USER tokenmill
WORKDIR /home/tokenmill
EXPOSE 8000
# Up once it answers HTTP (401 without a key is an answer).
HEALTHCHECK --interval=10s --timeout=5s --start-period=30s --retries=3 \
    CMD ["python3", "-c", "import urllib.request, urllib.error\ntry: urllib.request.urlopen('http://127.0.0.1:8000/v1/models', timeout=4)\nexcept urllib.error.HTTPError: pass"]
ENTRYPOINT ["tokenmill"]
CMD ["serve", "--host", "0.0.0.0", "--port", "8000"]

# -- worker (the default target) -------------------------------------------------------------------
FROM python AS worker
ARG TORCH_VARIANT=cpu
ARG TORCH_VERSION=2.13.0
ARG TORCH_CPU_INDEX=https://download.pytorch.org/whl/cpu
ARG PIP_FIND_LINKS=
LABEL org.opencontainers.image.title="tokenmill" \
      org.opencontainers.image.description="Queue-driven LLM batch-job worker (torch: ${TORCH_VARIANT})"
# torch first, in its own layer: it is most of the image and changes least. Then the pinned rest; then
# tokenmill itself, so a code change rebuilds only the small last layers.
RUN python3 -m venv /opt/venv \
    && case "$TORCH_VARIANT" in \
        cpu) pip install -c /opt/requirements.lock \
                 ${TORCH_CPU_INDEX:+--extra-index-url "$TORCH_CPU_INDEX"} "torch==${TORCH_VERSION}+cpu" ;; \
        cuda) pip install -c /opt/requirements.lock "torch==${TORCH_VERSION}" ;; \
        *) echo "TORCH_VARIANT must be cpu or cuda, not '${TORCH_VARIANT}'" >&2; exit 1 ;; \
    esac
RUN pip install -r /opt/requirements.lock
COPY --from=wheel /dist /tmp/dist
RUN pip install --no-deps /tmp/dist/*.whl && rm -rf /tmp/dist && pip check && tokenmill --help >/dev/null
COPY examples /app/examples
ENV HF_HOME=/home/tokenmill/.cache/huggingface \
    TOKENMILL_TORCH_VARIANT=${TORCH_VARIANT}
# The directory exists (owned by the user) so a fresh named volume mounted there is writable.
RUN mkdir -p "$HF_HOME" && chown -R tokenmill:tokenmill /home/tokenmill/.cache
USER tokenmill
WORKDIR /app
EXPOSE 9400
# Healthy only while the engine serves (its status reports are fresh), not merely while the process lives.
# start-period covers the model download and load on first start.
HEALTHCHECK --interval=15s --timeout=10s --start-period=600s --retries=3 CMD ["tokenmill", "health"]
ENTRYPOINT ["tokenmill"]
CMD ["worker"]
