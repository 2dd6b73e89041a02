# Two commands on a fresh machine:  make demo   (the main job)   and   make test
# The environment lives in .venv; torch is pinned first so pip does not pull a CUDA build on CPU boxes, and the
# rest comes from constraints.txt, the set the suite passed with (on a GPU box with its own torch:
# make demo SYSTEM_PYTHON=1).
# Drift:  make canary  runs the drift tests (tests/drift.py) against the newest published transformers, accelerate,
# peft, DeepSpeed and TRL in .venv-canary;  make oldest  against the oldest versions pyproject.toml declares
# (constraints-oldest.txt) in .venv-oldest. CI (.ci/run) runs make test, then both; each names the versions it ran.
PYTHON ?= python3
VENV := .venv
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml setup.py constraints.txt | cksum | cut -d' ' -f1)

ifeq ($(SYSTEM_PYTHON),1)
PY := $(PYTHON)
ENV_DEP :=
else
PY := $(VENV)/bin/python
ENV_DEP := $(STAMP)
endif

.PHONY: demo test lint test-system env clean canary oldest

# the Python sources ruff checks: every line at most 100 characters, no unused or undefined names (pyflakes),
# and ruff's format (pyproject.toml [tool.ruff])
LINT_PATHS := megatrain_ds tests benchmarks compat examples setup.py

env: $(ENV_DEP)

$(STAMP):
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	$(VENV)/bin/pip install -q torch==2.13.0
	DS_BUILD_OPS=0 $(VENV)/bin/pip install -q -c constraints.txt -e '.[test]'
	touch $(STAMP)

demo: $(ENV_DEP)
	$(PY) examples/finetune.py

# the lint first (seconds): a line over 100 characters or an unformatted file fails `make test`
lint: $(ENV_DEP)
	$(PY) -m ruff check $(LINT_PATHS)
	$(PY) -m ruff format --check $(LINT_PATHS)

# two workers (pytest-xdist), each test file whole on one worker (its module fixtures built once): half the suite
# waits on subprocesses (DeepSpeed, torchrun, the harness), so two workers fill the 2-core CI machine; the 15
# slowest tests are listed at the end (the suite's 15-minute budget: 2026-11-30, 12 min 13 s, the slowest 63 s)
test: $(ENV_DEP) lint
	$(PY) -m pytest -q -n 2 --dist loadfile --durations=15 tests --ignore=tests/system

# the system tests (tests/system): real cgroups, small filesystems, sshd + pdsh, SLURM, elastic restarts; root and
# Debian's packages (.ci/system-packages.sh installs them); one worker, the services they start are per test
test-system: $(ENV_DEP)
	$(PY) -m pytest -q -p no:xdist tests/system

# the newest releases, fetched again on every run (that is the point); torch stays at the CPU wheel
canary:
	test -x .venv-canary/bin/python || $(PYTHON) -m venv .venv-canary
	.venv-canary/bin/pip install -q --upgrade pip
	.venv-canary/bin/pip install -q torch==2.13.0
	DS_BUILD_OPS=0 .venv-canary/bin/pip install -q -e '.[test]'
	@echo "(pip may say the newest releases conflict with pyproject's tested ranges: expected, that is the canary)"
	DS_BUILD_OPS=0 .venv-canary/bin/pip install -q --upgrade transformers accelerate peft deepspeed trl torch==2.13.0
	.venv-canary/bin/python -m tests.drift canary

oldest:
	test -x .venv-oldest/bin/python || $(PYTHON) -m venv .venv-oldest
	.venv-oldest/bin/pip install -q --upgrade pip
	.venv-oldest/bin/pip install -q torch==2.13.0
	DS_BUILD_OPS=0 .venv-oldest/bin/pip install -q -c constraints-oldest.txt -e '.[test-core]'  # no TRL (pyproject.toml)
	.venv-oldest/bin/python -m tests.drift oldest

clean:
	rm -rf $(VENV) .venv-canary .venv-oldest .pytest_cache
