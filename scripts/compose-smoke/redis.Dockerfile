# Test stand-in for the redis image (no container registry in CI): Debian's redis-server on the
# debootstrapped base that scripts/compose_smoke.sh imports.
ARG BASE_IMAGE=tokenmill-base:bookworm
FROM ${BASE_IMAGE}
RUN apt-get update \
    && apt-get install -y --no-install-recommends redis-server \
    && rm -rf /var/lib/apt/lists/* \
    && mkdir -p /data && chown redis:redis /data
USER redis
WORKDIR /data
CMD ["redis-server"]
