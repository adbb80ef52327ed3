# Duet: `make chat` and `make test` each set everything up on a fresh clone.
PY ?= python3
SHELL := /bin/bash
VENV := .venv
VPY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
MODEL := duet_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
# Fast BLAS on Linux: mlx[cpu] bundles reference BLAS; `duet` preloads OpenBLAS itself, tests do it here.
# (and OPENBLAS_CORETYPE where the CPU is newer than the OpenBLAS: mlx_engine/blas_preload.py)
BLAS_ENV = env $$($(VPY) -m mlx_engine.blas --env)
TEST_ENV = $(BLAS_ENV) HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false

.PHONY: setup kernels chat serve test soak-test test-fast lint bench bench-deps bench-cpu mac-check gpu-check clean

setup: $(STAMP) $(MODEL) kernels

$(STAMP): pyproject.toml setup.py
	@test -x $(VPY) || $(PY) -m venv $(VENV)
	@bash packaging/install_system_deps.sh || true
	$(VPY) -m pip install --quiet --upgrade pip
	$(VPY) -m pip install --quiet -r <($(VPY) packaging/requirements.py cpu dev)
	DUET_CPU_KERNELS_BUILD=0 $(VPY) -m pip install --quiet --no-build-isolation --no-deps -e .  # its build puts the bundled model into duet_smollm2/; cpu_kernels: see kernels
	@touch $(STAMP)

# The bundled model (not in git): the editable install above puts it there; this again if it went missing.
$(MODEL): | $(STAMP)
	$(VPY) packaging/smollm2/fetch.py

# The CPU kernels (cpu_kernels/, a C++ MLX extension): rebuilt when mlx or the sources change; without
# them Duet runs (dequantized CPU weights) and says so once.
kernels: $(STAMP)
	@$(VPY) -m cpu_kernels.build || echo "warning: cpu_kernels did not build (see above); Duet falls back to dequantized CPU weights"

chat: $(STAMP) $(MODEL) kernels
	$(VENV)/bin/duet chat

serve: $(STAMP) $(MODEL) kernels
	$(VENV)/bin/duet serve

test: $(STAMP) $(MODEL) kernels
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy  # mlx_engine/, peer/ and app/, as [tool.mypy] in pyproject.toml selects
	$(VENV)/bin/lint-imports  # kernels <- mlx_engine <- peer <- app ([tool.importlinter])
	$(TEST_ENV) $(VPY) -m pytest -q -ra -m "not soak"

soak-test: $(STAMP) $(MODEL) kernels
	$(TEST_ENV) $(VPY) -m pytest -q -ra -m soak

test-fast: $(STAMP) $(MODEL) kernels
	$(TEST_ENV) $(VPY) -m pytest -q -ra -m "not slow"

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/lint-imports

bench: $(STAMP) $(MODEL) kernels
	$(BLAS_ENV) $(VPY) bench/generate.py

# llama-cpp-python for bench/cpu.py (never part of `make test`): installing it compiles llama.cpp
# (~15-30 min on 2 cores), so the wheel is built once, for this CPU, into build/wheels/ and reused.
# A native build, unless the CPU lists AMX, where llama.cpp's AMX kernels die (bench/llama_cmake_args.py says why).
LLAMA_CPP_VERSION ?= 0.3.36
WHEELS = build/wheels/$(shell $(PY) bench/llama_cmake_args.py --tag)
LLAMA_CMAKE_ARGS ?= $(shell $(PY) bench/llama_cmake_args.py)

bench-deps: $(STAMP)
	@ls $(WHEELS)/llama_cpp_python-$(LLAMA_CPP_VERSION)-*.whl >/dev/null 2>&1 || \
	  CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" CMAKE_BUILD_PARALLEL_LEVEL=$$(nproc) nice -n 19 \
	  $(VPY) -m pip wheel --no-deps --no-cache-dir -w $(WHEELS) llama-cpp-python==$(LLAMA_CPP_VERSION)
	$(VPY) -m pip install --quiet --no-deps --force-reinstall $(WHEELS)/llama_cpp_python-$(LLAMA_CPP_VERSION)-*.whl diskcache

bench-cpu: bench-deps
	$(BLAS_ENV) $(VPY) bench/cpu.py

# On a Mac with Apple Silicon: the Apple-marked tests (the Metal kernels and the engine's Metal decode
# path, for real), then both kernel benchmarks; the output is markdown to paste into an issue.
mac-check: $(STAMP)
	@$(VPY) -c "import sys; from metal_kernels.spec import metal_available; sys.exit(0 if metal_available() else 'mac-check needs Apple Silicon with Metal and mlx >= 0.32')"
	@echo "## Duet mac-check: $$(git rev-parse --short HEAD 2>/dev/null), $$(sysctl -n machdep.cpu.brand_string), $$(sysctl -n hw.memsize | awk '{print $$1 / 2^30}') GiB, mlx $$($(VPY) -c 'import mlx.core as mx; print(mx.__version__)'), macOS $$(sw_vers -productVersion)"
	@echo; echo '```'; $(TEST_ENV) $(VPY) -m pytest -q -ra -m apple tests/ 2>&1 | tail -n 25; echo '```'; echo
	$(VPY) bench/kernels.py --json bench/out/kernels.json
	@echo
	$(VPY) bench/metal_decode.py --json bench/out/metal_decode.json

# On a machine with an NVIDIA GPU and MLX's CUDA backend installed (pip install -e '.[cuda]'): the
# engine's tests on it, prefill at 2K/8K on an 8B-shaped model, the planner's profile; markdown out
# (bench/out/gpu_check.md). Elsewhere the same script rehearses on the CPU (bench/gpu_check.py).
gpu-check: $(STAMP) kernels
	$(TEST_ENV) $(VPY) bench/gpu_check.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .mypy_cache
