# `make test` and `make demo` set up their virtual environments themselves on a
# fresh machine (Python 3.11+ and pip): .venv has the newest releases,
# .venv-oldest the lower bounds that pyproject.toml states.
PYTHON ?= python3
export NO_MKDOCS_2_WARNING := 1
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
OLDEST := .venv-oldest
OLDEST_PY := $(OLDEST)/bin/python
OLDEST_STAMP := $(OLDEST)/.installed

.PHONY: test test-newest test-oldest docs-check demo docs lint typecheck bench clean

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

# Lint, types, the suite (doctests included) on the newest stack, a strict
# docs build, then the suite on the oldest stack.
test: lint typecheck test-newest docs-check test-oldest

test-newest: $(STAMP)
	$(PY) -m pytest -q

test-oldest: $(OLDEST_STAMP)
	$(OLDEST_PY) -m pytest -q

lint: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

# mypy over lossscale/ ([tool.mypy] in pyproject.toml), on the newest stack
# (.venv): the annotations users' type checkers and editors read.
typecheck: $(STAMP)
	$(PY) -m mypy

docs-check: $(STAMP)
	$(PY) -m mkdocs build --strict --site-dir $(VENV)/site

docs: $(STAMP)
	$(PY) -m mkdocs build --strict --site-dir site

demo: $(STAMP)
	$(PY) examples/demo.py

bench: $(STAMP)
	$(PY) benchmarks/optimizer_step.py

clean:
	rm -rf $(VENV) $(OLDEST) site build dist .pytest_cache .ruff_cache \
		.mypy_cache
