# The gateway image the Helm chart (charts/gateway) runs: `docker build -t policy-gateway:0.1.0 .`
# Stage 1 builds the wheel and installs it with the pinned runtime dependencies (requirements.lock only: no test
# or chart tooling) into a venv; stage 2 copies that venv into a clean base and runs it as a non-root user.
# Read-only root filesystem: the process writes only under /var/lib/gateway (the chart's gateway.dataDir volume)
# and /tmp (the chart's tmp emptyDir); bytecode is compiled at build time. Linted by hadolint
# (tests/packaging/test_dockerfile.py); see docs/operations.md "Building the image".
ARG PYTHON_IMAGE=python:3.11.7-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
COPY pyproject.toml README.md LICENSE requirements.lock ./
COPY gateway ./gateway
COPY backends ./backends
RUN python -m venv /opt/gateway \
    && /opt/gateway/bin/python -m pip wheel --no-deps -w /tmp/dist . \
    && /opt/gateway/bin/python -m pip install -c requirements.lock /tmp/dist/policy_gateway-*.whl \
    && /opt/gateway/bin/python -m compileall -q /opt/gateway/lib \
    && /opt/gateway/bin/gateway --version

FROM ${PYTHON_IMAGE}
LABEL org.opencontainers.image.title="policy-gateway" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.description="Policy-engine LLM gateway (OpenAI-compatible edge proxy)"
# uid/gid 10001: the chart's podSecurityContext.runAsUser/runAsGroup
RUN groupadd --system --gid 10001 gateway \
    && useradd --system --uid 10001 --gid gateway --home-dir /var/lib/gateway --no-create-home \
       --shell /usr/sbin/nologin gateway \
    && mkdir -p /var/lib/gateway /etc/gateway \
    && chown gateway:gateway /var/lib/gateway
COPY --from=build /opt/gateway /opt/gateway
ENV PATH=/opt/gateway/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    HOME=/var/lib/gateway \
    TMPDIR=/tmp
WORKDIR /var/lib/gateway
USER 10001:10001
EXPOSE 8080
HEALTHCHECK NONE
CMD ["gateway", "serve", "--config", "/etc/gateway/gateway.yaml"]
