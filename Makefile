# Two commands on a fresh machine: `make demo` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
DEMO_DIR ?= .demo

.PHONY: demo test test-all lint clean screenshots

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install -q -e '.[test]'
	touch $@

demo: $(VENV)/.installed
	$(BIN)/python tools/demo.py $(DEMO_DIR)

# `make test`: every test but the ones marked slow (a few minutes on 2 cores); `make test-all`: all of them.
# TEST_JOBS pytest-xdist workers, one test file each at a time (a file's module fixtures, its
# server and checkpoint, stay in one process): while one waits on a child or a server, the other
# computes. TEST_JOBS=0 runs in this process alone.
TEST_JOBS ?= 2
test: $(VENV)/.installed
	$(BIN)/python -m pytest -m "not slow" -n $(TEST_JOBS) --dist loadfile

test-all: $(VENV)/.installed
	$(BIN)/python -m pytest -n $(TEST_JOBS) --dist loadfile

# The chat page's screenshots in docs/ (desktop and phone widths), taken by its browser test;
# needs chromium and chromedriver (Debian: sudo apt-get install chromium chromium-driver).
screenshots: $(VENV)/.installed
	DSV4_SCREENSHOT_DIR=docs $(BIN)/python -m pytest -q tests/test_server_page.py

lint: $(VENV)/.installed
	$(BIN)/ruff check . && $(BIN)/ruff format --check .

clean:
	rm -rf $(DEMO_DIR) .pytest_cache
