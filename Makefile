# `make test` and `make demo` set up .venv themselves on a fresh machine.
PYTHON ?= python3
export NO_MKDOCS_2_WARNING := 1
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: test demo docs lint bench clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e ".[dev]"
	touch $(STAMP)

lint: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

test: $(STAMP) lint
	$(PY) -m pytest -q
	$(PY) -m mkdocs build --strict --quiet --site-dir $(VENV)/site

docs: $(STAMP)
	$(PY) -m mkdocs build --strict --site-dir site

demo: $(STAMP)
	$(PY) examples/demo.py

bench: $(STAMP)
	$(PY) benchmarks/optimizer_step.py

clean:
	rm -rf $(VENV) site build dist .pytest_cache .ruff_cache
