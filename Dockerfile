# llm-latency-proxy container image.
#
#   docker build -t llm-latency-proxy .
#   docker run --rm -p 8080:8080 -e LLM_PROXY_UPSTREAM=https://api.openai.com/v1 llm-latency-proxy
#
# Every `serve` flag is also an LLM_PROXY_* environment variable (see
# `llm-latency-proxy serve --help`). The same image runs the simulator and the bench:
#   docker run --rm -p 8000:8000 llm-latency-proxy simulate --host 0.0.0.0 --port 8000
#
# Two stages: the first builds the project's wheel and installs it with its
# dependencies into a virtual environment; the second copies only that environment
# onto a clean slim base, so no build tools, sources or pip caches ship.
#
# The image includes the `otel` extra (the OpenTelemetry SDK and its OTLP/HTTP
# exporter), so tracing and OTLP metrics work by setting OTEL_EXPORTER_OTLP_ENDPOINT
# (docs/opentelemetry.md); both stay off until configured and cost nothing then (the
# packages are not even imported). Size: 1.8 MB of wheels, about 12 MB installed (from
# 64 to 76 MB for the whole environment), measured with pip outside Docker (no Docker
# engine where this was written). It also includes the `cache-index` extra (redis-py,
# no dependencies: a 0.6 MB wheel), which the prompt-cache doctor imports only when the
# config file has a [cache-index] table (its index shared by every replica on Redis or
# Valkey: deploy/kubernetes/overlays/shared-prefix-index). For the plain image:
# --build-arg EXTRAS=

ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
ARG EXTRAS=otel,cache-index
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1
WORKDIR /src
COPY pyproject.toml README.md ./
COPY proxy ./proxy
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /wheels . \
 && python -m venv /opt/venv \
 && wheel="$(echo /wheels/*.whl)" \
 && /opt/venv/bin/pip install --no-cache-dir "${wheel}${EXTRAS:+[${EXTRAS}]}"

FROM ${PYTHON_IMAGE}
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    LLM_PROXY_HOST=0.0.0.0 \
    LLM_PROXY_PORT=8080
RUN groupadd --system --gid 10001 proxy \
 && useradd --system --uid 10001 --gid proxy --no-create-home --home-dir /nonexistent \
      --shell /usr/sbin/nologin proxy
COPY --from=build /opt/venv /opt/venv
USER 10001:10001
EXPOSE 8080

# One health check for every command of the image, with no curl: `healthcheck` reads
# PID 1's command line (the entry point, or an init's arguments ending with it) and
# asks /healthz where that command listens: `serve` on its --port or LLM_PROXY_PORT,
# `simulate` on its --port; `bench` and `demo` run no server and count as healthy.
# A shell wrapper is taken for `serve` (docker-compose.yml disables the check for its
# load generator). Any error (refused, timeout, non-2xx) exits 1.
HEALTHCHECK --interval=10s --timeout=3s --start-period=10s --retries=3 \
  CMD ["python", "-m", "proxy", "healthcheck", "--path", "/healthz"]

# Exec form: the proxy is PID 1 and receives SIGTERM itself. It then stops accepting,
# lets in-flight streams finish for up to --graceful-timeout (LLM_PROXY_GRACEFUL_TIMEOUT,
# 30 s) and exits 0; give `docker stop -t` / stop_grace_period a bit more than that.
STOPSIGNAL SIGTERM
ENTRYPOINT ["llm-latency-proxy"]
CMD ["serve"]
