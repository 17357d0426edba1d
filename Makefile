# `make test` and `make demo` set up their virtual environments themselves on a
# fresh machine (Python 3.11+ and pip): .venv has the newest releases,
# .venv-oldest the lower bounds that pyproject.toml states, and .venv-wheel
# (dist-check) only the built wheel and what it requires.
#
# .venv is built with the newest Python this machine has (the newest JAX
# needs Python 3.12 or newer), .venv-oldest with the oldest supported one
# (3.11): .ci/find_python looks for python3.X on PATH, then pyenv's, then
# python3, and says on stderr when it falls back. `make test PYTHON=python`
# builds both with one Python; NEWEST_PYTHON=... and OLDEST_PYTHON=... each.
PYTHON ?=
NEWEST_PYTHON ?= $(or $(PYTHON),$(call found_python,newest))
OLDEST_PYTHON ?= $(or $(PYTHON),$(call found_python,oldest))
# Looked for once per run of make, and only by the targets that use it.
found_python = $(or $(FOUND_$1),$(eval FOUND_$1 := $$(shell .ci/find_python $1))$(FOUND_$1))
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

.PHONY: test check-newest test-newest test-oldest test-plain lint typecheck docs-check \
	dist-check demo docs bench bench-compare clean FORCE

# DIR/.python: the Python version DIR is built with (.ci/venv creates DIR,
# or rebuilds it when that Python's version changes, and rewrites the file
# only then, so that the stamps below reinstall only then).
$(VENV)/.python: FORCE
	@.ci/venv $(VENV) "$(NEWEST_PYTHON)"

$(OLDEST)/.python: FORCE
	@.ci/venv $(OLDEST) "$(OLDEST_PYTHON)"

$(STAMP): pyproject.toml $(VENV)/.python
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e ".[dev]"
	touch $(STAMP)

# The oldest supported stack: every runtime, flax and test requirement pinned
# to its lower bound in pyproject.toml (.ci/lower_bounds.py writes the pins).
$(OLDEST_STAMP): pyproject.toml .ci/lower_bounds.py $(OLDEST)/.python
	$(OLDEST_PY) -m pip install --quiet --upgrade pip
	$(OLDEST_PY) .ci/lower_bounds.py flax test > $(OLDEST)/constraints.txt
	$(OLDEST_PY) -m pip install --quiet -c $(OLDEST)/constraints.txt -e ".[test]"
	touch $(OLDEST_STAMP)

# Everything on the newest stack (lint, types, the suite with its doctests, a
# strict docs build, the built distributions), then the suite on the oldest.
# CI runs all of it with Python 3.11 and 3.13 installed (the newest stack on
# 3.13, the oldest on 3.11), and test-newest with 3.11 alone (PYTHON=python:
# the newest releases Python 3.11 gets).
test: check-newest test-plain test-oldest

check-newest: lint typecheck test-newest docs-check dist-check

test-newest: $(STAMP)
	$(PY) -m pytest -q

test-oldest: $(OLDEST_STAMP)
	$(OLDEST_PY) -m pytest -q

# The suite with the speed layer off and not even importable, as if
# lossscale/_speed/ were deleted: the contract holds on the plain core too;
# tests of the speed layer's own formulations skip.
test-plain: $(STAMP)
	LOSSSCALE_PLAIN=1 LOSSSCALE_BLOCK_SPEED=1 $(PY) -m pytest -q --ignore=tests/test_docs.py \
		--ignore=lossscale/_speed

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
	$(NEWEST_PYTHON) -m venv $(WHEEL_VENV)
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

# The optimizer step (float32 and bfloat16) at BASE and at the working tree,
# in alternating separate processes: exits 1 when the working tree is slower
# beyond the run's spread. Run before every change to the compiled step
# (timings are never asserted by the tests). make bench-compare BASE=c193e02
BASE ?=
bench-compare: $(STAMP)
	@test -n "$(BASE)" || { echo "usage: make bench-compare BASE=<git ref>"; exit 2; }
	$(PY) benchmarks/compare.py --base "$(BASE)"

clean:
	rm -rf $(VENV) $(OLDEST) $(WHEEL_VENV) site build $(DIST) .pytest_cache \
		.ruff_cache .mypy_cache

# The benchmark tables of docs/ and README.md, rewritten from
# benchmarks/results/*.json by benchmarks/docs_tables.py (standard library
# only); tests/test_docs_tables.py fails while a table and its JSON differ.
.PHONY: docs-tables
docs-tables:
	$(or $(PYTHON),python3) benchmarks/docs_tables.py --write
