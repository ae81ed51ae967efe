# Two commands a newcomer needs: `make serve` and `make test`. Everything else is set up on demand.
VENV        ?= .venv
PYTHON      ?= python3
# A CPU torch from local disk here. On a GPU host pick the CUDA build (docs/gpu.md), e.g.
#   make install TORCH_INDEX=https://download.pytorch.org/whl/cu128
# The extension compiles against whichever torch is installed, from the same sources.
TORCH_SPEC  ?= torch==2.13.0
TORCH_INDEX ?=
# Optional system packages, installed with apt when run as root: libzmq's headers (without them the extension links
# the libzmq pyzmq's wheel bundles), Prometheus (only tests/test_metrics_prometheus.py needs it; it skips without)
# and the wamerican word list (the default model's English check, tests/test_default_model.py; skips without).
SYS_PKGS    ?= libzmq3-dev prometheus wamerican
PY          := $(VENV)/bin/python
comma       := ,
PIP         := $(PY) -m pip
STAMP       := $(VENV)/.amoe-installed
CPP_SOURCES := $(wildcard cpp/*.cpp cpp/*.h)

.PHONY: install serve train-default test test-busy test-gpu golden lint format bench bench-gpu clean

install: $(STAMP)

$(STAMP): pyproject.toml setup.py $(CPP_SOURCES)
	@missing=""; for p in $(SYS_PKGS); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then echo "[install] apt-get install$$missing"; \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing >/dev/null; \
	  else echo "[install] going on without the optional system packages:$$missing (libzmq: pyzmq's copy is linked)"; fi; \
	fi
	@[ -x $(PY) ] || $(PYTHON) -m venv $(VENV)
	@$(PIP) install -q --upgrade pip setuptools wheel
	@$(PY) -c "import torch" 2>/dev/null || $(PIP) install -q $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX) --extra-index-url https://pypi.org/simple) "$(TORCH_SPEC)" numpy
	@# setup.py picks the libzmq to link at build time, pyzmq's bundled one included: pyzmq comes first.
	@$(PY) -c "import zmq" 2>/dev/null || $(PIP) install -q "pyzmq>=25"
	$(PIP) install -q --no-build-isolation -e '.[dev]'
	@touch $(STAMP)

# Flags for `make serve`, e.g. SERVE_ARGS='--port 0' (a free port; the server logs the URL it listens on).
SERVE_ARGS  ?=
serve: install
	$(VENV)/bin/amoe serve $(SERVE_ARGS)

# The default model served above (amoe/model/data/kjv-moe) trained again from its seed on this CPU (under an hour
# on 2 cores), its held-out perplexity printed beside the unigram baseline's, then its greedy output on five fixed
# prompts compared with the shipped model's (docs/default-model.md). The corpus comes with apt-get download.
TRAIN_OUT := build/default-model
train-default: install
	@apt-cache show bible-kjv=4.38 >/dev/null 2>&1 || [ "$$(id -u)" != 0 ] || apt-get update -qq
	rm -rf $(TRAIN_OUT)
	$(VENV)/bin/amoe default-model train --out $(TRAIN_OUT)
	$(VENV)/bin/amoe default-model compare --model $(TRAIN_OUT)

# The suite runs with an explicit --device cpu (AMOE_DEVICE stands in for the flag): CI has no GPU. The tests in
# tests/gpu are collected and skipped, with the reason; `make test-gpu` runs them on a GPU host.
test: install lint
	AMOE_DEVICE=cpu $(PY) -m pytest -q --durations=25 tests

# The same suite with a busy loop on each core beside it: CI runs on a shared machine, and a test that only passes
# on an idle one is a test of the machine. BUSY_CORES=N sets how many loops (default: one per core).
BUSY_CORES ?= $(shell nproc)
test-busy: install lint
	@pids=""; for i in $$(seq $(BUSY_CORES)); do sh -c 'while :; do :; done' & pids="$$pids $$!"; done; \
	echo "[test-busy] $(BUSY_CORES) busy loops:$$pids"; \
	AMOE_DEVICE=cpu $(PY) -m pytest -q --durations=25 tests; rc=$$?; kill $$pids; exit $$rc

test-gpu: install
	$(PY) -m pytest -q -m gpu tests/gpu

# The model's own figures the tests compare with (tests/golden/*.json), computed again by the functions the tests
# call; after a change to the model, review them as a data diff: `git diff tests/golden`. GOLDEN_AREAS=bounds,...
# writes only those files.
GOLDEN_AREAS ?=
golden: install
	AMOE_DEVICE=cpu $(PY) -m tests.golden $(subst $(comma), ,$(GOLDEN_AREAS))

lint: install
	$(VENV)/bin/ruff check amoe coordinator tests bench examples deploy tools
	$(VENV)/bin/ruff format --check amoe coordinator tests bench examples deploy tools
	$(VENV)/bin/clang-format --dry-run --Werror cpp/*.cpp cpp/*.h

format: install
	$(VENV)/bin/ruff format amoe coordinator tests bench examples deploy tools
	$(VENV)/bin/ruff check --fix amoe coordinator tests bench examples deploy tools
	$(VENV)/bin/clang-format -i cpp/*.cpp cpp/*.h

# Each prints a table and a final JSON line; the AEP-vs-EP comparison (~10 min) is `amoe bench compare --preset quick`.
bench: install
	$(PY) bench/offline.py
	$(PY) bench/scheduler.py
	$(PY) bench/transport.py
	$(PY) bench/metrics_endpoint.py
	$(PY) bench/fuzz_api.py

# GPU hosts only: amoe on the GPU against transformers on the same GPU, offline and served.
bench-gpu: install
	$(PY) bench/gpu.py

# As root: a throwaway non-root user builds and serves a fresh clone of HEAD with a plain `make serve`, libzmq's
# headers hidden (so pyzmq's libzmq is linked), and gets one completion; a final JSON line. Builds everything from
# scratch, so it is not part of `make test`. Without root it says skipped and exits 0.
.PHONY: test-nonroot
test-nonroot:
	$(PYTHON) tools/nonroot_serve.py

# The GPU check (docs/gpu.md "The one-command GPU check"), for a GPU machine that has torch but not amoe's other
# dependencies and no network. gpu-wheels (here, with pip's index at hand) puts them in .whl/ as CPython 3.12 x86-64
# wheels and checks their size; gpu-check (there, with that machine's plain python3: no venv) installs them, builds
# the extension and runs tests/gpu and bench/gpu.py, each step time-boxed, into one JSON file.
.PHONY: gpu-wheels gpu-check
gpu-wheels:
	$(PYTHON) tools/gpu_wheels.py

# Here, the rehearsal: make gpu-check PYTHON=.venv/bin/python GPU_CHECK_FLAGS=--rehearse
GPU_CHECK_OUT   ?= $(if $(OUT),$(OUT),build)/gpu_check.json
GPU_CHECK_FLAGS ?=
gpu-check:
	$(PYTHON) tools/gpu_check.py --out $(GPU_CHECK_OUT) $(GPU_CHECK_FLAGS)

clean:
	rm -rf build *.egg-info amoe/*.so
