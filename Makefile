# Two commands on a fresh machine with Python 3.11 and make: `make demo` and `make test`.
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
WORKSPACE ?= workspace
PREFECT_PORT ?= 4200
RECIPE ?= tiny

.PHONY: install bytecode demo test test-fast down lint clean

install: $(VENV)/.installed

# torch first, by pip, from its pinned CPU wheel (pip's find-links; uv does not look there): anything
# depending on torch installed before it pulls a multi-GB CUDA build. pip installs uv beside it; uv
# installs the rest (and the newest pip, as `pip install --upgrade pip` did), keeping the installed
# torch, which satisfies torch==2.13.0, and compiling bytecode as pip does; then uv is removed, so
# the venv holds the same packages a pip-only install gives. The marker file makes reinstall happen
# only when pyproject.toml changes.
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet torch==2.13.0 uv
	$(BIN)/uv pip install --quiet --python $(BIN)/python --compile-bytecode --upgrade-package pip pip -e '.[dev]'
	$(BIN)/uv pip uninstall --quiet --python $(BIN)/python uv
	touch $@

# The checkout's bytecode, written before the demo and the tests: where PYTHONDONTWRITEBYTECODE is
# set (this project's sandbox sets it) Python never caches it, and every process compiled the
# project modules it imports again (a trainer rank: 46 modules, 0.12 CPU-s), over a thousand
# processes in `make test`. compileall writes it whatever the variable says; a module edited after
# is compiled in memory again, as without it.
bytecode: install
	$(BIN)/python -m compileall -q -j 0 pipeline flows tasks curation evals trainers model infra benchmarks tests

demo: bytecode
	$(BIN)/smollm3 demo --workspace $(WORKSPACE) --port $(PREFECT_PORT) --recipe $(RECIPE)

# The suite runs on pytest-xdist workers: one more than the machine has cores (the tests wait on
# servers, subprocesses and Slurm besides computing), at most 8. A fourth worker on 2 cores is not
# shown to help: the CPU was idle 11% of a 3-worker run and 3-6% of two 4-worker runs, but the
# machine's own pace moved the times more (same day: 3 workers 2,018 s and 1,524 s of pytest, 4
# workers 1,760 s and 1,788 s; CONTRIBUTING.md, 2026-12-06), and 4 workers load it more.
# Tests that share the one Slurm cluster run on one worker (`xdist_group("slurm")`, `--dist
# loadgroup`); every other test has its own ports, workspace, Prefect home and server
# (tests/conftest.py). Tests are handed out heaviest first (`heaviest_first` in tests/conftest.py;
# `--no-loadscope-reorder` keeps that order instead of xdist's by group size), so the ten-minute
# runs never start last. TEST_WORKERS=0 runs the same tests serially in one process.
TEST_WORKERS ?= $(shell $(PYTHON) -c 'import os; print(min(8, (os.cpu_count() or 1) + 1))')
test: bytecode
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadgroup --no-loadscope-reorder

# The fast tier: unit and component tests (everything not marked `slow`), for before each commit.
test-fast: bytecode
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadgroup --no-loadscope-reorder -m "not slow"

down:
	@if [ -x $(BIN)/smollm3 ]; then $(BIN)/smollm3 down; else echo "nothing to stop"; fi

# The formatter and linter are the project's: CI runs this before the tests.
lint: install
	$(BIN)/ruff format --check .
	$(BIN)/ruff check .

clean: down
	rm -rf $(WORKSPACE) .demo
