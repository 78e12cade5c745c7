# tokenmill worker image (CPU). For a GPU worker, swap the torch line for a CUDA build of torch 2.13.0.
FROM python:3.11-slim

ENV PIP_NO_CACHE_DIR=1 \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1

WORKDIR /app

# Pinned CPU build of torch first, from PyTorch's CPU index: an unpinned torch pulls a multi-GB CUDA build.
RUN pip install --index-url https://download.pytorch.org/whl/cpu torch==2.13.0

COPY pyproject.toml README.md ./
COPY tokenmill ./tokenmill
RUN pip install ".[worker]"
COPY examples ./examples

RUN useradd --create-home --uid 1000 tokenmill
USER tokenmill

# Prometheus metrics.
EXPOSE 9400
ENTRYPOINT ["tokenmill"]
CMD ["worker", "--model", "builtin:tiny"]
