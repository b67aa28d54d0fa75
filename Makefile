# Two entry points for a fresh machine: `make train` and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
NPROC ?= 2

.PHONY: venv train test lint clean

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test]'
	touch $@

venv: $(VENV)/.installed

train: venv
	$(PY) experiments/train.py --nproc=$(NPROC)

test: venv
	$(PY) -m ruff check funcshard experiments tests
	$(PY) -m ruff format --check funcshard experiments tests
	$(PY) -m pytest -q --doctest-modules funcshard tests

clean:
	rm -rf $(VENV) out
