# Two commands on a fresh machine with Python 3.11 and make: `make demo` and `make test`.
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
WORKSPACE ?= workspace
PREFECT_PORT ?= 4200

.PHONY: install demo test down lint clean

install: $(VENV)/.installed

# torch first, from its pinned CPU wheel: anything depending on torch installed before it pulls a
# multi-GB CUDA build. The marker file makes reinstall happen only when pyproject.toml changes.
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[dev]'
	touch $@

demo: install
	$(BIN)/smollm3 demo --workspace $(WORKSPACE) --port $(PREFECT_PORT)

# TEST_WORKERS=N shares the tests out to N pytest-xdist processes. Off by default: tried with 3
# workers on 2 cores, timing-bound tests failed, two workers each started a private Slurm cluster,
# and the served e2e run met a deployment another test registered on its worker's Prefect server.
TEST_WORKERS ?= 0
test: install
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadgroup

down:
	@if [ -x $(BIN)/smollm3 ]; then $(BIN)/smollm3 down; else echo "nothing to stop"; fi

# The formatter and linter are the project's: CI runs this before the tests.
lint: install
	$(BIN)/ruff format --check .
	$(BIN)/ruff check .

clean: down
	rm -rf $(WORKSPACE) .demo
