# Two entry points for a fresh machine: `make train` and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
NPROC ?= 2

.PHONY: venv train test lint clean lighthouse

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test,ft]'
	@# iproute2 for tests/test_nodes.py (network namespaces; skipped without it): only as root
	@# with apt-get, and never failing the build.
	@command -v ip >/dev/null 2>&1 || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 \
		&& { apt-get install -y -q iproute2 || { apt-get update -q && apt-get install -y -q iproute2; }; } \
		>/dev/null 2>&1; } || echo "iproute2 not installed: tests/test_nodes.py will be skipped"
	touch $@

venv: $(VENV)/.installed

train: venv
	$(PY) experiments/train.py --nproc=$(NPROC)

# torchft's lighthouse for fault-tolerant runs (docs/fault-tolerance.md)
MIN_REPLICAS ?= 1
LIGHTHOUSE_PORT ?= 29510
lighthouse: venv
	$(VENV)/bin/torchft_lighthouse --min_replicas $(MIN_REPLICAS) \
		--bind [::]:$(LIGHTHOUSE_PORT) --heartbeat_timeout_ms 1000 --join_timeout_ms 1000

test: venv
	$(PY) -m ruff check funcshard experiments tests
	$(PY) -m ruff format --check funcshard experiments tests
	$(PY) -m pytest -q --doctest-modules funcshard tests

clean:
	rm -rf $(VENV) out
