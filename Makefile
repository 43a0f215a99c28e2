# `make demo` and `make test` work on a fresh machine: they create .venv, install the package
# with its dev extras under constraints.txt (which pins the CPU build of torch), then run.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
# Azurite (the Azure Storage emulator) for the az:// tests, from the npm registry.
AZURITE := .azurite/.installed-3.37.0

.PHONY: demo test lint typecheck docs pytest bench clean

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -qq --upgrade pip
	$(BIN)/python -m pip install -qq -c constraints.txt -e '.[dev,plot]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/asyncload demo

test: lint typecheck docs pytest

lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks examples
	$(BIN)/ruff format --check src tests benchmarks examples

typecheck: $(STAMP)
	$(BIN)/mypy

docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --quiet --site-dir .site

$(AZURITE):
	npm install --prefix .azurite --no-audit --no-fund --silent azurite@3.37.0
	touch $(AZURITE)

pytest: $(STAMP) $(AZURITE)
	$(BIN)/pytest

bench: $(STAMP) $(AZURITE)
	$(BIN)/python benchmarks/bench_loader.py
	$(BIN)/python benchmarks/bench_storage.py
	$(BIN)/python benchmarks/bench_shards.py
	$(BIN)/python benchmarks/bench_tails.py
	$(BIN)/python benchmarks/bench_cache.py

clean:
	rm -rf $(VENV) .site .mypy_cache .ruff_cache .pytest_cache .azurite
