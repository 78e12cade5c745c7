# Test stand-in for MinIO (its image cannot be pulled in CI, and Debian does not package it): moto's
# S3-compatible server, plus boto3 for the bucket-creating init step, on the debootstrapped base.
ARG BASE_IMAGE=tokenmill-base:bookworm
FROM ${BASE_IMAGE}
ARG MOTO_VERSION=5.2.5
ENV PATH=/opt/venv/bin:$PATH PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python3 -m venv /opt/venv && pip install "moto[server]==${MOTO_VERSION}"
USER nobody
CMD ["moto_server", "-H", "0.0.0.0", "-p", "9000"]
