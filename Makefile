# Two commands a newcomer needs: `make serve` and `make test`. Everything else is set up on demand.
VENV        ?= .venv
PYTHON      ?= python3
# A CPU torch from local disk here; set TORCH_SPEC for a CUDA install on a GPU host.
TORCH_SPEC  ?= torch==2.13.0
SYS_PKGS    ?= libzmq3-dev prometheus
PY          := $(VENV)/bin/python
PIP         := $(PY) -m pip
STAMP       := $(VENV)/.amoe-installed
CPP_SOURCES := $(wildcard cpp/*.cpp cpp/*.h)

.PHONY: install serve test lint format bench clean

install: $(STAMP)

$(STAMP): pyproject.toml setup.py $(CPP_SOURCES)
	@missing=""; for p in $(SYS_PKGS); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" = 0 ]; then echo "[install] apt-get install$$missing"; \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing >/dev/null; \
	  else echo "[install] please install system packages:$$missing"; exit 1; fi; \
	fi
	@[ -x $(PY) ] || $(PYTHON) -m venv $(VENV)
	@$(PIP) install -q --upgrade pip setuptools wheel
	@$(PY) -c "import torch" 2>/dev/null || $(PIP) install -q "$(TORCH_SPEC)" numpy
	$(PIP) install -q --no-build-isolation -e '.[dev]'
	@touch $(STAMP)

serve: install
	$(VENV)/bin/amoe serve

test: install lint
	$(PY) -m pytest -q tests

lint: install
	$(VENV)/bin/ruff check amoe coordinator tests bench examples deploy
	$(VENV)/bin/ruff format --check amoe coordinator tests bench examples deploy
	$(VENV)/bin/clang-format --dry-run --Werror cpp/*.cpp cpp/*.h

format: install
	$(VENV)/bin/ruff format amoe coordinator tests bench examples deploy
	$(VENV)/bin/ruff check --fix amoe coordinator tests bench examples deploy
	$(VENV)/bin/clang-format -i cpp/*.cpp cpp/*.h

# Each prints a table and a final JSON line; the AEP-vs-EP comparison (~10 min) is `amoe bench compare --preset quick`.
bench: install
	$(PY) bench/offline.py
	$(PY) bench/scheduler.py
	$(PY) bench/transport.py
	$(PY) bench/metrics_endpoint.py
	$(PY) bench/fuzz_api.py

clean:
	rm -rf build *.egg-info amoe/*.so
