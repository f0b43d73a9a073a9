# whoseturn — every command a newcomer needs. `make test` bootstraps .venv itself.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: help test lint check interference evaluate sim system-deps clean

# Debian packages the tests use: a real Prometheus (dashboard and rules) and a real
# headless Chromium (status page).
SYSTEM_DEPS := prometheus chromium
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

help:
	@echo "make interference  print the chat-behind-batch table from the simulated engine"
	@echo "make evaluate      chat beside a batch job, direct vs through the proxy (virtual time)"
	@echo "make sim           run the simulated vLLM engine on :8000 (whoseturn sim)"
	@echo "make test          bootstrap .venv (and Debian's prometheus, chromium) and run the tests"
	@echo "make lint          ruff (lint + format check) and mypy --strict"
	@echo "make check         lint, then test (what CI runs)"

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[dev]'
	touch $(STAMP)

system-deps:
	@missing=""; for b in prometheus promtool chromium; do command -v $$b >/dev/null || missing=1; done; \
	if [ -n "$$missing" ]; then \
	  echo "installing Debian packages: $(SYSTEM_DEPS)"; \
	  $(SUDO) apt-get update -q && DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -q $(SYSTEM_DEPS); \
	fi

test: $(STAMP) system-deps
	$(BIN)/pytest

lint: $(STAMP)
	$(BIN)/ruff check proxy loadtests tests
	$(BIN)/ruff format --check proxy loadtests tests
	$(BIN)/mypy

check: lint test

interference: $(STAMP)
	$(BIN)/whoseturn sim interference

evaluate: $(STAMP)
	$(BIN)/whoseturn sim evaluate

sim: $(STAMP)
	$(BIN)/whoseturn sim --port 8000

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache .hypothesis *.egg-info
