# Each target does its own set-up from scratch: a fresh clone needs nothing but python3.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp

.PHONY: venv test lint typecheck pytest demo bench wheel clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[test,s3,postgres]'
	touch $@

lint: venv
	$(BIN)/ruff check registry cli tests benchmarks migrations

typecheck: venv
	$(BIN)/mypy

pytest: venv
	$(BIN)/python -m pytest -q

test: lint typecheck pytest

demo: venv
	$(BIN)/python -m scripts.demo

bench: venv
	$(BIN)/python -m benchmarks.run

wheel: venv
	$(BIN)/pip wheel -q --no-deps -w dist .

clean:
	rm -rf $(VENV) dist build .bench .demo .services
