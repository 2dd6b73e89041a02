# Two commands on a fresh machine:  make demo   (the main job)   and   make test
# The environment lives in .venv; torch is pinned first so pip does not pull a CUDA build on CPU boxes
# (on a GPU box with its own torch: make demo SYSTEM_PYTHON=1).
PYTHON ?= python3
VENV := .venv
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml setup.py | cksum | cut -d' ' -f1)

ifeq ($(SYSTEM_PYTHON),1)
PY := $(PYTHON)
ENV_DEP :=
else
PY := $(VENV)/bin/python
ENV_DEP := $(STAMP)
endif

.PHONY: demo test env clean

env: $(ENV_DEP)

$(STAMP):
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	$(VENV)/bin/pip install -q torch==2.13.0
	DS_BUILD_OPS=0 $(VENV)/bin/pip install -q -e '.[test]'
	touch $(STAMP)

demo: $(ENV_DEP)
	$(PY) examples/finetune.py

test: $(ENV_DEP)
	$(PY) -m pytest -q tests

clean:
	rm -rf $(VENV) .pytest_cache
