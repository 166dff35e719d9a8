# llama.cpp's llama-server around a binary built elsewhere, for machines that cannot pull
# ghcr.io/ggml-org/llama.cpp (CI: tests/test_docker.py builds it with the binary that
# scripts/prepare_engines.sh builds and caches, on the base image of scripts/docker_ci.sh).
#   docker build --network host -f deploy/compose/llama-server.Dockerfile \
#       --build-arg BASE=local/debian-python:<hash> -t local/llama-server:ci CONTEXT
# CONTEXT holds only the llama-server binary. It is linked statically against llama.cpp and
# ggml (BUILD_SHARED_LIBS=OFF); `ldd` lists libgomp.so.1, libstdc++.so.6, libgcc_s.so.1, libm
# and libc: the first two are not in a minimal Debian, hence libgomp1 and libstdc++6.
ARG BASE=debian:bookworm-slim
FROM ${BASE}
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
RUN apt-get update \
    && apt-get install -y --no-install-recommends libgomp1=12.* libstdc++6=12.* \
    && rm -rf /var/lib/apt/lists/*
COPY llama-server /usr/local/bin/llama-server
# Fail the build when a library is missing, or the binary does not run here.
RUN if ldd /usr/local/bin/llama-server | grep 'not found'; then exit 1; fi \
    && llama-server --version
USER 10001:10001
EXPOSE 8080
ENTRYPOINT ["llama-server"]
