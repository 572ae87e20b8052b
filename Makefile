PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install test demo bench-core bench-hat clean

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[test]'
	touch $(STAMP)

test: install
	$(BIN)/python -m pytest -q

demo: install
	$(BIN)/python -m shared.demo

bench-core: install
	$(BIN)/python -m shared.bench_core

clean:
	rm -rf $(VENV)

bench-hat: install
	$(BIN)/python -m shared.bench_hat
