# The two commands the README shows: `make serve` and `make test`.
# Both install what is missing into .venv first (torch comes from the wheel on this machine's disk).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.mmserve-installed
HOST ?= 127.0.0.1
PORT ?= 8000

export HF_HUB_OFFLINE := 1
export TRITON_INTERPRET := 1

.PHONY: install serve test bench clean

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test]'
	touch $(STAMP)

serve: install
	$(VENV)/bin/mmserve serve --host $(HOST) --port $(PORT)

test: install
	$(PY) -m pytest -q -p no:cacheprovider tests

bench: install
	$(PY) examples/bench_images.py

clean:
	rm -rf $(VENV) .mmserve
