# Two commands on a fresh machine: `make demo` and `make test`.
# Set-up is idempotent: .venv is rebuilt only when pyproject.toml or constraints.txt change.
SHELL := /bin/bash
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.furlong-installed
PIP := $(BIN)/pip install --disable-pip-version-check -q -c constraints.txt
export OMP_NUM_THREADS ?= 2
export TOKENIZERS_PARALLELISM := false
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export HF_DATASETS_OFFLINE := 1
export RAY_USAGE_STATS_ENABLED := 0

.PHONY: setup envs demo test test-fast test-extended docs screenshots check-claims clean

$(STAMP): pyproject.toml constraints.txt
	@test -x $(BIN)/python || $(PY) -m venv $(VENV)
	@echo "setting up $(VENV) (torch pinned to the CPU build via constraints.txt)"
	$(PIP) -e '.[dev,bench,envs]'
	@touch $(STAMP)

setup: $(STAMP)
	@command -v chromium >/dev/null || ./scripts/install-chromium.sh || echo "chromium not installed: browser tests will fail"
	@command -v bwrap >/dev/null || ./scripts/install-bubblewrap.sh || echo "bubblewrap not installed: the local sandbox will refuse to run code"

# The connector packages' own virtual environments (OpenEnv, Verifiers, NeMo Gym, Harbor), built
# side by side when missing and cached under ~/.cache/furlong/envs; a no-op when they are.
envs: setup
	$(BIN)/furlong envs setup --all

demo: setup
	$(BIN)/furlong demo

# The connectors' environments build in the background while the suite runs (scripts/run-tests.sh).
test: setup
	FURLONG_BUILD_ENVS=1 ./scripts/run-tests.sh

test-fast: setup
	./scripts/run-tests.sh -m "not slow and not extended"

test-extended: setup envs
	./scripts/run-tests.sh -m extended

# Regenerates the reference pages (CLI, config), then builds the site offline; strict: any
# warning (dead link or anchor, page missing from nav) fails. The banner about MkDocs 2.0 is
# not a build warning; NO_MKDOCS_2_WARNING silences it.
docs: setup
	$(BIN)/python -m tools.claims --write-reference
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

# The dashboard screenshots in docs/img/ (dashboard-<view>.png), taken of the browser tests' real run.
# Only this command writes them: a test run leaves every tracked file as it found it.
screenshots: setup
	FURLONG_SCREENSHOTS=1 $(BIN)/python -m pytest -q -p no:cacheprovider tests/browser/test_dashboard_views.py

# Links, anchors, counts, figures, the feature manifest against the last JUnit report
# (.reports/junit.xml, written by `make test`) and the staleness of generated pages.
check-claims: setup
	$(BIN)/python -m tools.claims

clean:
	rm -rf $(VENV) .pytest_cache site
