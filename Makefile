# Two commands on a fresh machine: `make demo` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
DEMO_DIR ?= .demo

.PHONY: demo test lint clean browser

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install -q -e '.[test]'
	touch $@

demo: $(VENV)/.installed
	$(BIN)/python tools/demo.py $(DEMO_DIR)

# The chat page's test drives Debian's chromium through chromedriver; installed here when
# apt-get can be used (root, or sudo without a password), else that one test skips.
browser:
	@command -v chromedriver >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ]; then SUDO=""; elif sudo -n true 2>/dev/null; then SUDO="sudo -n"; else SUDO=none; fi; \
	  if [ "$$SUDO" != none ] && command -v apt-get >/dev/null 2>&1; then \
	    ($$SUDO apt-get update -qq && $$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver) \
	      || echo "make: could not install chromium; the browser test will skip"; \
	  else echo "make: no chromium/chromedriver and no apt-get as root; the browser test will skip"; fi; }

test: $(VENV)/.installed browser
	$(BIN)/python -m pytest

lint: $(VENV)/.installed
	$(BIN)/ruff check . && $(BIN)/ruff format --check .

clean:
	rm -rf $(DEMO_DIR) .pytest_cache
