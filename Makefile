# Quickstart: `make run` (set up, then run the four-hospital federation) and `make test`.
PYTHON ?= python3.11
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup run test lint format tools

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[test]'
	touch $(STAMP)

setup: $(STAMP)

run: $(STAMP)
	$(BIN)/silo-pfl run jobs/heart_disease.yaml --results results.json

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: $(STAMP)
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

# Debian's Prometheus and Chromium (/usr/bin), for the metrics and report tests: installed when
# missing, as root or with sudo; where they cannot be (no apt-get, offline), those tests skip and
# say so.
DEBIAN_TOOLS := prometheus chromium
tools:
	@missing=""; for t in $(DEBIAN_TOOLS); do [ -x /usr/bin/$$t ] || missing="$$missing $$t"; done; \
	if [ -n "$$missing" ]; then \
	  if ! command -v apt-get >/dev/null; then echo "note: no apt-get: the tests that need$$missing skip"; exit 0; fi; \
	  if [ "$$(id -u)" = 0 ]; then sudo=""; elif sudo -n true 2>/dev/null; then sudo="sudo -n"; \
	  else echo "note: not root: the tests that need$$missing skip"; exit 0; fi; \
	  echo "installing Debian packages:$$missing"; \
	  { $$sudo apt-get update -qq && $$sudo env DEBIAN_FRONTEND=noninteractive \
	    apt-get install -y -qq --no-install-recommends $$missing >/dev/null; } \
	  || echo "note: apt-get could not install$$missing: the tests that need them skip"; \
	fi

# pytest exits 5 when it collects no test: reported, and counted as a failure of the suite.
test: lint tools
	$(BIN)/python -m pytest -q -p no:cacheprovider --durations=30; rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "pytest collected no tests"; fi; exit $$rc
