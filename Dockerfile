# responses-router in a container: the router and its default extras, config.example.toml by
# default (a managed pool of two simulated workers), a non-root user, a health check on /health.
#   docker build -t responses-router .
#   docker run -p 8080:8080 responses-router
# Your own config: mount it and name it, e.g.
#   docker run -p 8080:8080 -v $PWD/cfg.toml:/etc/responses-router/cfg.toml:ro \
#     responses-router --config /etc/responses-router/cfg.toml --host 0.0.0.0
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /opt/responses-router
COPY pyproject.toml README.md ./
COPY router ./router
COPY backends ./backends
COPY policies ./policies
RUN python -m pip install . && rm -rf build

# The example config's store (var/responses.db) and worker logs lie beside it: a folder the user owns.
RUN useradd --system --create-home --home-dir /var/lib/responses-router --uid 10001 router
COPY --chown=router:router config.example.toml /var/lib/responses-router/config.toml
USER router
WORKDIR /var/lib/responses-router

EXPOSE 8080
HEALTHCHECK --interval=10s --timeout=3s --start-period=20s --retries=3 \
    CMD python -c "import sys, urllib.request; sys.exit(urllib.request.urlopen('http://127.0.0.1:8080/health', timeout=2).status != 200)"
ENTRYPOINT ["responses-router"]
CMD ["--config", "/var/lib/responses-router/config.toml", "--host", "0.0.0.0"]
