# whoseturn — every command a newcomer needs. `make test` bootstraps .venv itself.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: help demo test lint check interference evaluate sim system-deps clean bench bench-fleet bench-tenants router-venv test-e2e vllm-venv tiny-model compare first-burst test-docker crosscheck-vllm status-shots

# Debian packages the tests use: a real Prometheus (dashboard and rules), a real
# headless Chromium (status page) and a real PostgreSQL (the batch store; its
# binaries live under /usr/lib/postgresql/*/bin, off PATH).
SYSTEM_DEPS := prometheus chromium postgresql
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

help:
	@echo "make demo          chat beside a batch job on two simulated engines, direct vs through the proxy (~2 min)"
	@echo "make interference  print the chat-behind-batch table from the simulated engine"
	@echo "make evaluate      chat beside a batch job, direct vs through the proxy (virtual time)"
	@echo "make sim           run the simulated vLLM engine on :8000, model tiny (whoseturn sim)"
	@echo "make test          bootstrap .venv (and Debian's prometheus, chromium, postgresql) and run the tests"
	@echo "make lint          ruff (lint + format check) and mypy --strict"
	@echo "make check         lint, then test (what CI runs)"
	@echo "make test-e2e      the real-vLLM tier: builds .venv-vllm and the tiny model once, runs tests/e2e"
	@echo "make test-docker   the image tier: builds and runs the Dockerfile and the compose stack on a local dockerd"
	@echo "make bench         what the proxy costs: direct, nginx, vllm-router and whoseturn side by side (a few min)"
	@echo "make bench-fleet   routing by prefix cache across fleets of 4 and 16 simulated engines: vllm-router and whoseturn arms, three workloads (~15 min)"
	@echo "make bench-tenants a quiet client beside a noisy one on one simulated engine: alone, arrival order, fair share (~3 min)"
	@echo "make compare       chat beside a batch job on real vLLM: three direct arms and the proxy (~15 min)"
	@echo "make first-burst   the first batch burst beside live chat on real vLLM, fresh and again, FCFS vs the proxy (~10 min)"
	@echo "make crosscheck-vllm  the harness against vllm bench serve on real vLLM, same requests (~10-15 min)"
	@echo "make status-shots  the status page beside chat and batch on simulated engines, in Chromium: docs/status-page.png (~1 min)"

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[dev]'
	touch $(STAMP)

system-deps:
	@missing=""; for b in prometheus promtool chromium; do command -v $$b >/dev/null || missing=1; done; \
	ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || missing=1; \
	if [ -n "$$missing" ]; then \
	  echo "installing Debian packages: $(SYSTEM_DEPS)"; \
	  $(SUDO) apt-get update -q && DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -q $(SYSTEM_DEPS); \
	fi

# The overhead benchmark (docs/overhead.md): Debian's nginx is its floor arm, vLLM's
# router (pinned in loadtests/bench/router-requirements.txt) runs from its own venv.
# LEVELS, PROMPT_CHARS: comma-separated concurrent streams and prompt sizes.
LEVELS ?= 1,64,256,1024
PROMPT_CHARS ?= 1000
ROUTER_VENV  := .venv-router
ROUTER_STAMP := $(ROUTER_VENV)/.installed

$(ROUTER_STAMP): loadtests/bench/router-requirements.txt
	rm -rf $(ROUTER_VENV)
	$(PYTHON) -m venv $(ROUTER_VENV)
	$(ROUTER_VENV)/bin/pip install --quiet -r loadtests/bench/router-requirements.txt
	touch $@

router-venv: $(ROUTER_STAMP)

bench: $(STAMP) $(ROUTER_STAMP)
	@command -v nginx >/dev/null || { $(SUDO) apt-get update -q && DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -q nginx; }
	$(BIN)/python -m loadtests.bench.overhead --levels $(LEVELS) --prompt-chars $(PROMPT_CHARS)

# The fleet benchmark (docs/fleet.md): fleets of simulated engines behind vLLM's router
# (round_robin, cache_aware, kv_aware; from .venv-router, as `bench`) and whoseturn (by
# load, by prefix), three workloads; it writes its tables into docs/fleet.md.
# FLEET_ARGS: more options, e.g. --engines 4 --duration-s 10 --repeat 1.
bench-fleet: $(STAMP) $(ROUTER_STAMP)
	$(BIN)/python -m loadtests.bench.fleet $(FLEET_ARGS)

# The tenants benchmark (docs/tenants.md): a quiet client beside a noisy one on one
# simulated engine, the proxy with no tenant config; alone, arrival order
# (fair_share: false) and fair share, each on a fresh engine and proxy, cold and warm.
# It writes its table into docs/tenants.md. TENANTS_ARGS: more options, e.g. --duration-s 30.
bench-tenants: $(STAMP)
	$(BIN)/python -m loadtests.bench.tenants $(TENANTS_ARGS)

test: $(STAMP) system-deps $(ROUTER_STAMP)
	$(BIN)/pytest

lint: $(STAMP)
	$(BIN)/ruff check proxy loadtests tests e2e
	$(BIN)/ruff format --check proxy loadtests tests e2e
	$(BIN)/mypy

check: lint test

# The real-vLLM tier (tests/e2e). vLLM lives in its own venv, apart from the proxy's;
# the model is built once, deterministically, and rebuilt when its script changes.
VLLM_VENV   := .venv-vllm
VLLM_STAMP  := $(VLLM_VENV)/.installed
MODEL_DIR   := .cache/tiny-model
MODEL2_DIR  := .cache/tiny-model-2l
MODEL_STAMP := $(MODEL_DIR)/.built-$(shell sha256sum e2e/build_tiny_model.py 2>/dev/null | cut -c1-16)

$(VLLM_STAMP): e2e/requirements.txt
	rm -rf $(VLLM_VENV)
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install --quiet -r e2e/requirements.txt
	$(VLLM_VENV)/bin/pip uninstall --quiet -y torchvision torchaudio torchcodec
	touch $@

$(MODEL_STAMP): | $(VLLM_STAMP)
	rm -rf $(MODEL_DIR) $(MODEL2_DIR)
	$(VLLM_VENV)/bin/python e2e/build_tiny_model.py $(MODEL2_DIR) 2
	$(VLLM_VENV)/bin/python e2e/build_tiny_model.py $(MODEL_DIR)
	touch $@

vllm-venv: $(VLLM_STAMP)

tiny-model: $(MODEL_STAMP)

test-e2e: $(STAMP) $(MODEL_STAMP) $(ROUTER_STAMP)
	WHOSETURN_E2E_VLLM_PYTHON=$(VLLM_VENV)/bin/python WHOSETURN_E2E_MODEL=$(MODEL_DIR) \
	  WHOSETURN_E2E_MODEL_2L=$(MODEL2_DIR) $(BIN)/pytest tests/e2e -p no:cacheprovider --durations=0

# The image tier (tests/docker): builds the Dockerfile on a local Docker engine and runs
# it. No registry is needed: the base image is made from Debian's packages (debootstrap)
# and cached by its tag; dockerd is started here (host networking) if none answers.
DOCKER_DATA ?= /var/cache/whoseturn/docker
test-docker: $(STAMP)
	@missing=""; for b in dockerd docker-compose debootstrap; do command -v $$b >/dev/null || missing=1; done; \
	if [ -n "$$missing" ]; then \
	  echo "installing Debian packages: docker.io docker-compose debootstrap"; \
	  $(SUDO) apt-get update -q && DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -q docker.io docker-compose debootstrap; \
	fi
	@docker info >/dev/null 2>&1 || { \
	  echo "starting dockerd (data in $(DOCKER_DATA), log in $(DOCKER_DATA).log)"; \
	  $(SUDO) mkdir -p $(DOCKER_DATA); \
	  $(SUDO) sh -c 'nohup dockerd --iptables=false --bridge=none --data-root $(DOCKER_DATA) >$(DOCKER_DATA).log 2>&1 &'; \
	  for i in $$(seq 60); do docker info >/dev/null 2>&1 && break; sleep 0.5; done; docker info >/dev/null; }
	$(SUDO) tests/docker/build-base.sh whoseturn-base:bookworm
	$(BIN)/pytest tests/docker -p no:cacheprovider --durations=0

# The baseline comparison on real vLLM, then the simulator's replay of it (fidelity).
COMPARE_OUT ?= artifacts/compare
compare: $(STAMP) $(MODEL_STAMP)
	WHOSETURN_E2E_VLLM_PYTHON=$(VLLM_VENV)/bin/python WHOSETURN_E2E_MODEL=$(MODEL_DIR) \
	  $(BIN)/python -m loadtests.compare.arms --repeats 3 --out $(COMPARE_OUT); status=$$?; \
	$(BIN)/python -m loadtests.compare.fidelity $(COMPARE_OUT)/records.jsonl || status=1; exit $$status

# The first burst beside live chat (fresh engine, fresh proxy) and later bursts, FCFS
# against the proxy on its defaults; with the engine's threshold flag, pieces per prompt.
FIRST_BURST_OUT ?= artifacts/first-burst
first-burst: $(STAMP) $(MODEL_STAMP)
	WHOSETURN_E2E_VLLM_PYTHON=$(VLLM_VENV)/bin/python WHOSETURN_E2E_MODEL=$(MODEL_DIR) \
	  $(BIN)/python -m loadtests.compare.first_burst --repeats 2 --out $(FIRST_BURST_OUT) \
	  --arms fcfs,proxy_auto,threshold_auto,threshold_off

# The harness against vLLM's own benchmark client on real vLLM (docs/crosscheck.md).
CROSSCHECK_OUT ?= artifacts/crosscheck-vllm
crosscheck-vllm: $(STAMP) $(MODEL_STAMP)
	WHOSETURN_E2E_VLLM_PYTHON=$(VLLM_VENV)/bin/python WHOSETURN_E2E_MODEL=$(MODEL_DIR) \
	  $(BIN)/python -m loadtests.compare.crosscheck_vllm run loadtests/workloads/crosscheck-vllm.yaml chat \
	  --requests 30 --out $(CROSSCHECK_OUT)/$$(date +%Y-%m-%d-%H%M%S)

demo: $(STAMP)
	$(BIN)/whoseturn demo

# The status page as it is today, in docs/ (docs/scheduling.md): two simulated engines
# and the proxy, chat beside batch, one engine stopped, /status in headless Chromium.
# SHOTS: the PNGs to write.
SHOTS ?= docs/status-page.png
status-shots: $(STAMP) system-deps
	$(BIN)/python -m loadtests.demo.status_shots $(SHOTS)

interference: $(STAMP)
	$(BIN)/whoseturn sim interference

evaluate: $(STAMP)
	$(BIN)/whoseturn sim evaluate

# The README's examples: model `tiny`, and the engine flag it recommends beside the proxy.
sim: $(STAMP)
	$(BIN)/whoseturn sim --profile cpu-tiny --port 8000 --long-prefill-token-threshold 256

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache .hypothesis *.egg-info
