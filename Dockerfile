# whoseturn: the proxy (`whoseturn serve`, the default command) in a small image that
# runs as a non-root user. The same image runs the simulated engine for the laptop
# profile (`whoseturn sim ...`): the package carries both, with no extra dependencies.
#
#   docker build -t whoseturn .
#   docker run -p 8080:8080 -e WHOSETURN_ENGINES=http://vllm:8000 whoseturn
#
# Configuration: mount a YAML file at /etc/whoseturn/whoseturn.yaml (the working
# directory, where `whoseturn serve` looks for it) or point $WHOSETURN_CONFIG at one;
# WHOSETURN_* variables override the file. The Batch API's SQLite store lives on the
# volume /var/lib/whoseturn (or set WHOSETURN_BATCH_STORE=postgres and
# WHOSETURN_BATCH_DSN for a shared PostgreSQL store). BASE is any Debian-like image
# with python3 (3.11+) and its venv module; pip honours PIP_INDEX_URL /
# PIP_FIND_LINKS / PIP_NO_INDEX given as build arguments, for a private mirror or an
# offline wheelhouse.
ARG BASE=python:3.11-slim

FROM ${BASE} AS build
ARG PIP_INDEX_URL
ARG PIP_FIND_LINKS
ARG PIP_NO_INDEX
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1
RUN python3 -m venv /opt/whoseturn
WORKDIR /src
COPY pyproject.toml README.md ./
COPY proxy ./proxy
COPY loadtests ./loadtests
RUN /opt/whoseturn/bin/pip install . \
 && find /opt/whoseturn -name __pycache__ -prune -exec rm -rf {} + \
 && rm -rf /opt/whoseturn/lib/python3*/site-packages/pip \
           /opt/whoseturn/lib/python3*/site-packages/setuptools \
           /opt/whoseturn/bin/pip*

FROM ${BASE}
COPY --from=build /opt/whoseturn /opt/whoseturn
RUN mkdir -p /etc/whoseturn /var/lib/whoseturn \
 && chown 10001:10001 /var/lib/whoseturn
ENV PATH=/opt/whoseturn/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    HOME=/var/lib/whoseturn \
    WHOSETURN_HOST=0.0.0.0 \
    WHOSETURN_PORT=8080 \
    WHOSETURN_BATCH_STORE_PATH=/var/lib/whoseturn/batch.sqlite3
WORKDIR /etc/whoseturn
VOLUME ["/var/lib/whoseturn"]
USER 10001:10001
EXPOSE 8080
# Ready once an engine answers; the sim's own check is /health (compose overrides it).
HEALTHCHECK --interval=10s --timeout=3s --start-period=10s --retries=3 \
  CMD ["python3", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/readyz' % os.environ.get('WHOSETURN_PORT', '8080'), timeout=2)"]
ENTRYPOINT ["whoseturn"]
CMD ["serve"]
