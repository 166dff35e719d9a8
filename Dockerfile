# health-sidecar: a small image with the sidecar as entrypoint, built in two stages.
# The builder installs the package and its dependencies (all wheels) into a virtualenv; the final
# stage copies only that virtualenv onto the same slim base: no compilers, no pip cache, no tests.
# BASE: any Debian-like image with python (python3-venv); CI, which cannot pull, builds with
# --build-arg BASE=local/debian-python:<hash>, made by scripts/docker_ci.sh from Debian's packages.
# EXTRAS: optional extras of the package; EXTRAS=dynamo adds Dynamo's runtime client (about
# 230 MB) for SIDECAR_TRANSPORT=dynamo: docker build --build-arg EXTRAS=dynamo -t ...:0.1.0-dynamo .
# EXTRAS=grpc adds the engines' gRPC stubs (smg-grpc-proto) for SIDECAR_TRANSPORT=grpc.

ARG BASE=python:3.11.14-slim-bookworm
FROM ${BASE} AS builder
ARG EXTRAS=""
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
RUN python -m venv /opt/venv
COPY pyproject.toml README.md ./
COPY sidecar ./sidecar
RUN /opt/venv/bin/pip install --no-cache-dir ".${EXTRAS:+[$EXTRAS]}"

FROM ${BASE}
COPY --from=builder /opt/venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
# A numeric non-root user (Kubernetes runAsNonRoot can check it); the root filesystem may be
# read-only: the sidecar writes no files (but for the Dynamo transport under Kubernetes
# discovery, its own discovery directory in TMPDIR: mount an emptyDir at /tmp).
USER 10001:10001
EXPOSE 9090
# The sidecar's own health only: /sidecar/live fails when its monitor stops. Never /live or
# /health: those judge the engine, and an engine problem is not the sidecar's.
HEALTHCHECK --interval=10s --timeout=3s --start-period=10s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request as u; u.build_opener(u.ProxyHandler({})).open('http://127.0.0.1:%s/sidecar/live' % os.environ.get('DYN_SYSTEM_PORT', '9090'), timeout=2)"]
ENTRYPOINT ["health-sidecar"]
CMD ["serve"]
