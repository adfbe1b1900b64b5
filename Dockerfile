# syntax=docker/dockerfile:1
# episode-router: the routing sidecar as a small, non-root image.
#
#   docker build -t episode-router:0.1.0 .
#   docker run --rm -p 8080:8080 \
#       -v "$PWD/router.yaml:/etc/episode-router/router.yaml:ro" episode-router:0.1.0
#
# The builder stage turns the package and its dependencies into wheels. It runs on
# the full Python image, whose C compiler builds the router's hot path with mypyc
# (setup.py), for the same Python as the slim image. The final stage installs only
# those wheels: no compiler, no build tools, no source tree, no caches.
# The configuration is mounted at /etc/episode-router/router.yaml; the control
# socket lives in /run/episode-router and the journal in /var/lib/episode-router
# (mount volumes there when the root filesystem is read-only).

ARG PYTHON_IMAGE=python:3.11.11-slim-bookworm
ARG BUILDER_IMAGE=python:3.11.11-bookworm

FROM ${BUILDER_IMAGE} AS builder
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1
WORKDIR /src
COPY pyproject.toml setup.py README.md ./
COPY router ./router
# The benchmark trains the profile-guided build of the hot path (setup.py).
COPY bench ./bench
RUN pip wheel --no-cache-dir --wheel-dir /wheels .

FROM ${PYTHON_IMAGE}
# Must equal the version in pyproject.toml (the tests check it).
ARG VERSION=0.1.0
LABEL org.opencontainers.image.title="episode-router" \
      org.opencontainers.image.description="Routes each RL episode's requests to the worker process that holds it." \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.licenses="Apache-2.0"
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
# The wheels are bind-mounted from the builder, so they never land in a layer.
# setuptools and wheel are build tools the router does not need at run time.
RUN --mount=type=bind,from=builder,source=/wheels,target=/wheels \
    pip install --no-cache-dir --no-index --find-links=/wheels "episode-router==${VERSION}" \
    && pip uninstall --yes setuptools wheel \
    && groupadd --system --gid 10001 episode-router \
    && useradd --system --no-log-init --uid 10001 --gid 10001 \
        --home-dir /nonexistent --shell /usr/sbin/nologin episode-router \
    && install --directory --owner=10001 --group=10001 --mode=0770 \
        /run/episode-router /var/lib/episode-router \
    && install --directory --mode=0755 /etc/episode-router
USER 10001:10001
# 8080: the public listener; 9901: the admin listener (/metrics, /healthz, /readyz).
EXPOSE 8080 9901
# No curl in a slim image: Python's urllib does the probe (any error exits 1).
# It assumes the admin listener on port 9901, as in the default configuration.
HEALTHCHECK --interval=10s --timeout=3s --start-period=10s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:9901/healthz', timeout=2)"]
ENTRYPOINT ["episode-router"]
CMD ["run", "--config", "/etc/episode-router/router.yaml"]
