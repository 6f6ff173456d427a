# The two commands of the README: `make run` runs the product, `make test` runs every test.
# Both create .venv on first use. torch is pinned to the local CPU build (2.13.0); an
# unpinned torch would pull a multi-GB CUDA build.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: run test bootstrap demo bench-learn clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[test]'
	touch $(STAMP)

bootstrap: $(STAMP)

run: $(STAMP)
	$(BIN)/python -m trainer run demo

test: $(STAMP)
	$(BIN)/python -m pytest

bench-learn: $(STAMP)
	$(BIN)/python -m trainer bench learn --json

clean:
	rm -rf $(VENV) runs var .pytest_cache
