# `make test` and `make demo` set up their virtual environments themselves on a
# fresh machine (Python 3.11+ and pip): .venv has the newest releases,
# .venv-oldest the lower bounds that pyproject.toml states, and .venv-wheel
# (dist-check) only the built wheel and what it requires.
PYTHON ?= python3
export NO_MKDOCS_2_WARNING := 1
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
OLDEST := .venv-oldest
OLDEST_PY := $(OLDEST)/bin/python
OLDEST_STAMP := $(OLDEST)/.installed
# dist-check: the built sdist and wheel, and a fresh venv with only the wheel.
DIST := dist
WHEEL_VENV := .venv-wheel

.PHONY: test check-newest test-newest test-oldest lint typecheck docs-check \
	dist-check demo docs bench clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e ".[dev]"
	touch $(STAMP)

# The oldest supported stack: every runtime, flax and test requirement pinned
# to its lower bound in pyproject.toml (.ci/lower_bounds.py writes the pins).
$(OLDEST_STAMP): pyproject.toml .ci/lower_bounds.py
	test -x $(OLDEST_PY) || $(PYTHON) -m venv $(OLDEST)
	$(OLDEST_PY) -m pip install --quiet --upgrade pip
	$(OLDEST_PY) .ci/lower_bounds.py flax test > $(OLDEST)/constraints.txt
	$(OLDEST_PY) -m pip install --quiet -c $(OLDEST)/constraints.txt -e ".[test]"
	touch $(OLDEST_STAMP)

# Everything on the newest stack (lint, types, the suite with its doctests, a
# strict docs build, the built distributions), then the suite on the oldest.
# CI runs all of it on Python 3.11 and check-newest on 3.13.
test: check-newest test-oldest

check-newest: lint typecheck test-newest docs-check dist-check

test-newest: $(STAMP)
	$(PY) -m pytest -q

test-oldest: $(OLDEST_STAMP)
	$(OLDEST_PY) -m pytest -q

# ruff, and zizmor over the GitHub workflows (their schema and security).
lint: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(VENV)/bin/zizmor --offline --strict-collection --quiet \
		--config .github/zizmor.yml .github/workflows/*.yml

# mypy over lossscale/ ([tool.mypy] in pyproject.toml), on the newest stack
# (.venv): the annotations users' type checkers and editors read.
typecheck: $(STAMP)
	$(PY) -m mypy

# Builds the sdist and wheel into dist/, checks their metadata (twine) and
# contents (.ci/check_dist.py), installs the wheel alone into a fresh venv and
# runs the quickstart there, outside the source tree.
dist-check: $(STAMP)
	rm -rf $(DIST) $(WHEEL_VENV)
	$(PY) -m build --outdir $(DIST) .
	$(PY) -m twine check --strict $(DIST)/*
	$(PY) .ci/check_dist.py $(DIST)
	$(PYTHON) -m venv $(WHEEL_VENV)
	$(WHEEL_VENV)/bin/python -m pip install --quiet $(DIST)/*.whl
	run=$$(mktemp -d) && cp examples/quickstart.py .ci/installed_wheel.py "$$run" \
		&& cd "$$run" && $(abspath $(WHEEL_VENV))/bin/python -I installed_wheel.py \
		quickstart.py; status=$$?; rm -rf "$$run"; exit $$status

docs-check: $(STAMP)
	$(PY) -m mkdocs build --strict --site-dir $(VENV)/site

docs: $(STAMP)
	$(PY) -m mkdocs build --strict --site-dir site

demo: $(STAMP)
	$(PY) examples/demo.py

bench: $(STAMP)
	$(PY) benchmarks/optimizer_step.py

clean:
	rm -rf $(VENV) $(OLDEST) $(WHEEL_VENV) site build $(DIST) .pytest_cache \
		.ruff_cache .mypy_cache

# The benchmark tables of docs/ and README.md, rewritten from
# benchmarks/results/*.json by benchmarks/docs_tables.py (standard library
# only); tests/test_docs_tables.py fails while a table and its JSON differ.
.PHONY: docs-tables
docs-tables:
	$(PYTHON) benchmarks/docs_tables.py --write
