# Two entry points for a fresh machine with Python 3.11 and pip:
#   make demo   - set up .venv and run the main job (small end-to-end training run on CPU)
#   make test   - set up .venv and run lint + type check + the test suite
PY ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test lint typecheck docs bench clean-venv sglang-cpu

$(BIN)/python:
	$(PY) -m venv $(VENV)

# torch first, pinned to the local CPU wheel, so no dependency pulls a multi-GB CUDA build.
$(STAMP): $(BIN)/python setup.py
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/python -m recipes.quickstart

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

# Packages listed under [tool.mypy] in pyproject.toml.
typecheck: $(STAMP)
	$(BIN)/mypy

# Two pytest-xdist workers, a test module each at a time (tests/conftest.py: SGLang modules share one, slowest first).
# Short tracebacks: a long one (Ray's frames print their whole source) pushed a CI failure's message out of view.
# compileall first: where PYTHONDONTWRITEBYTECODE is set (CI machines), each of the suite's ~300 Ray worker and
# recipe processes would otherwise compile the repository's modules from source again.
test: lint typecheck
	$(BIN)/python -m compileall -q algorithms controller dataproto recipes resource_pools workers benchmarks
	$(BIN)/python -m pytest -q -rs --tb=short --durations=40 -n 2 --dist loadgroup --no-loadscope-reorder tests

# The documentation site into site/ (mkdocs.yml): the README as its home, the guides in docs/, the API reference.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

bench: $(STAMP)
	$(BIN)/python -m benchmarks.bench_dataproto
	$(BIN)/python -m recipes.quickstart

# CPU SGLang engine in .venv (tests/CI without a GPU): pinned, idempotent; see the script's header.
sglang-cpu: $(STAMP)
	bash workers/rollout/sglang/install_cpu.sh

clean-venv:
	rm -rf $(VENV)
