# hpkv — `make test` works on a fresh machine: it creates .venv and installs what the tests need.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml requirements-test.txt 2>/dev/null | cksum | cut -d' ' -f1)

.PHONY: test test-fast lint bench-tiers demo clean

$(STAMP):
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -r requirements-test.txt
	$(BIN)/pip install -q --no-deps -e .
	touch $@

venv: $(STAMP)

test: $(STAMP)
	$(BIN)/python -m pytest -q tests

lint: $(STAMP)
	$(BIN)/ruff check src tests
	$(BIN)/mypy

bench-tiers: $(STAMP)
	$(BIN)/python -m hpkv.bench.tiers

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
